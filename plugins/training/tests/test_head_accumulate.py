"""``TrainConfig.head_accumulate="gradient"``: the head adds each chunk's weight-gradient
product straight into its own bf16 gradient object (no float32 (vocab, dim) table in its
workspace), and trains as the float32-summed head does; what stands in its way is
refused by name. Untied llama3_tiny in bf16 on the CPU (the torch kernel variant)."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

pytest.importorskip("dataflow_family_llama3")

PRESET, UNTIED = "llama3_tiny", {"tie_word_embeddings": False}


def _train(mode: str, **fields) -> TrainConfig:
    # 2 x 16 tokens a round in chunks of 8: four chunks a round, two rounds
    return TrainConfig(
        seq_len=16, batch=2, rounds=2, chunk_tokens=8, dtype=DtypePolicy.named("bf16"),
        head_accumulate=mode, **fields,
    )  # fmt: skip


def _batches(steps: int, ignored: bool = False) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        rounds = []
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, 16), generator=g)
            targets = torch.randint(0, 256, (2, 16), generator=g)
            if ignored:  # a round with ignored targets: its own count of scored tokens
                targets[:, :5] = -100
            rounds.append((tokens, targets))
        out.append(rounds)
    return out


@pytest.mark.parametrize(
    ("pieces", "device"), [(1, "cpu"), (2, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.gpu)]
)
def test_the_head_added_into_its_gradient_trains_as_the_float32_summed_one(
    monkeypatch, pieces, device
) -> None:
    """Three bf16 steps each way from the same weights and tokens (some targets ignored):
    the losses within 2e-2 (relative), the first step's gradients within bf16's step
    tolerance (5e-2 of each tensor's norm), every weight after three steps within 2e-2;
    the kernel was handed the gradient's views (one a vocabulary piece) every head task.
    On CUDA with the resolver ``dataflow train`` takes there (``auto``: the registry's
    Triton head, steps replayed from a CUDA graph)."""
    from dataflow_kernels_torch import cross_entropy
    from dataflow_training.drive.run import TrainingRun, resolver_for

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    handed = []
    fast = cross_entropy.chunked_cross_entropy

    def spy(*args, **kwargs):
        into = kwargs.get("d_weight_into")
        handed.append(None if into is None else len(cross_entropy.weight_pieces(into)))
        return fast(*args, **kwargs)

    if device == "cpu":  # on CUDA the Triton variant runs (and a graph replays the steps)
        monkeypatch.setattr(cross_entropy, "chunked_cross_entropy", spy)
    results = {}
    for mode in ("float32", "gradient"):
        train = _train(mode, vocab_pieces=pieces)
        run = TrainingRun.of(
            "llama3", PRESET, train, device=device, seed=0, overrides=UNTIED, keep_grads=True,
            resolver=resolver_for("auto", device),
        )  # fmt: skip
        handed.clear()  # the profiling pass launched the head too
        batches = _batches(3, ignored=True)
        first = run.step(batches[0]).loss
        grads = {k: v.clone() for k, v in run.grads().items()}
        losses = [first] + [run.step(rounds).loss for rounds in batches[1:]]
        weights, _ = run.state()
        run.close(keep_state=False)
        results[mode] = losses, grads, weights
        if device == "cpu":
            assert handed == [None if mode == "float32" else pieces] * 6  # 2 rounds x 3 steps
    (plain_l, plain_g, plain_w), (into_l, into_g, into_w) = results["float32"], results["gradient"]
    torch.testing.assert_close(torch.tensor(into_l), torch.tensor(plain_l), rtol=2e-2, atol=0)
    assert plain_g.keys() == into_g.keys() and "head.lm_head.weight" in plain_g
    for name, value in plain_g.items():
        error = (into_g[name].double() - value.double()).norm() / value.double().norm()
        assert error <= 5e-2, (name, float(error))
    for name, value in plain_w.items():
        torch.testing.assert_close(into_w[name].float(), value.float(), rtol=2e-2, atol=2e-2)


def test_the_head_task_says_so_and_is_profiled_apart() -> None:
    """The head task carries ``accumulate`` (its signature, the profile cache's key, then
    differs from the float32 head's, whose workspace holds the float32 table); the
    default lowers as before the field existed."""
    from dataflow_training.plan.profile import signature

    family = load_family("llama3")
    steps = {
        mode: lower(family, PRESET, _train(mode), overrides=UNTIED)
        for mode in ("float32", "gradient")
    }
    heads = {mode: [t for t in s.program.tasks if t.kind == "head"] for mode, s in steps.items()}
    assert all("accumulate" not in t.params for t in heads["float32"])
    assert all(t.params["accumulate"] == "gradient" for t in heads["gradient"])
    assert signature(steps["float32"], heads["float32"][0]) != signature(
        steps["gradient"], heads["gradient"][0]
    )


def test_what_stands_in_its_way_is_refused_by_name() -> None:
    family = load_family("llama3")
    with pytest.raises(ValueError, match="is tied to its embedding"):
        lower(family, PRESET, _train("gradient"))
    with pytest.raises(ValueError, match="the weights are float32"):
        lower(
            family,
            PRESET,
            TrainConfig(seq_len=16, batch=2, head_accumulate="gradient"),
            overrides=UNTIED,
        )
    with pytest.raises(ValueError, match="cannot go with head_vocab_tiles"):
        _train("gradient", head_vocab_tiles=True)
    with pytest.raises(ValueError, match="head_accumulate must be 'float32' or 'gradient'"):
        _train("bfloat16")
    # the default writes no field: older programs and checkpoints read the same
    from dataflow_training.step.config import OMITTED_DEFAULTS

    assert OMITTED_DEFAULTS["head_accumulate"] == "float32"
    plain = lower(family, PRESET, _train("float32"), overrides=UNTIED).program.to_json()
    assert "head_accumulate" not in plain


def test_the_command_refuses_a_tied_head_in_one_line(tmp_path) -> None:
    from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke

    result = invoke(
        "train", "--family", "llama3", "--preset", PRESET, "--steps", "1", "--device", "cpu",
        "--precision", "bf16", "--head-accumulate", "gradient", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert_one_line_error(result, FAILURE_EXIT, "--head-accumulate", "tied to its embedding")
