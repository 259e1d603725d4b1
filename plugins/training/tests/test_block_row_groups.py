"""``TrainConfig.block_row_groups``: each block task runs its math over groups of the
round's sequences, one after the other, and trains as the whole batch at once does;
what stands in its way is refused by name.

Tolerances: float32 on the CPU, the torch kernel variants. The groups' gradients are
summed in the gradient object (as a round's are) instead of inside one matmul over the
batch: a different order of float32 sums, so the losses agree to 1e-5 (relative) and
each gradient to 1e-5 of its tensor's norm; every weight after three AdamW steps to
1e-4 (Adam's update divides by the gradients' root mean square, which amplifies a
last-bit difference where a gradient is near zero)."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

#: (family, preset): the hybrid (linear and full attention, gated delta rule, SwiGLU),
#: a plain decoder, and GPT-2 (LayerNorm, learned positions)
DENSE = [("qwen3_5", "qwen3_5_tiny"), ("llama3", "llama3_tiny"), ("gpt2", "gpt2_tiny")]


def _train(groups: int, **fields) -> TrainConfig:
    return TrainConfig(seq_len=16, batch=4, rounds=2, block_row_groups=groups, **fields)


def _batches(vocab: int, steps: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        [
            (
                torch.randint(0, vocab, (4, 16), generator=g),
                torch.randint(0, vocab, (4, 16), generator=g),
            )
            for _ in range(2)
        ]
        for _ in range(steps)
    ]


@pytest.mark.parametrize(("family", "preset"), DENSE)
@pytest.mark.parametrize("recompute", [False, True])
def test_row_groups_train_as_the_whole_batch(family, preset, recompute, forced_planner) -> None:
    """Three float32 steps with 1, 2 and 4 groups from the same weights and tokens, the
    blocks' saves kept or re-derived by a recompute task (every block: the planner's
    budget-free choice would keep them all)."""
    pytest.importorskip(f"dataflow_family_{family}")
    from dataflow_training.drive.run import TrainingRun

    plugin = load_family(family)
    config = plugin.config(preset)
    blocks = len(plugin.layers(config)) - 2
    units = frozenset((r, i) for r in range(2) for i in range(blocks))
    how = {"planner": forced_planner(units)} if recompute else {"recompute": False}
    batches = _batches(min(config.vocab_size, 256), 3)
    results = {}
    for groups in (1, 2, 4):
        run = TrainingRun.of(
            family, preset, _train(groups), device="cpu", seed=0, keep_grads=True,
            budget_bytes=None, **how,
        )  # fmt: skip
        tasks = [t for t in run.compiled.program.tasks if t.kind in ("fwd", "rec", "bwd")]
        assert tasks and all(t.params.get("row_groups", 1) == groups for t in tasks)
        assert any(t.kind == "rec" for t in tasks) == recompute
        losses = [run.step(rounds).loss for rounds in batches[:1]]
        grads = {k: v.clone() for k, v in run.grads().items()}
        losses += [run.step(rounds).loss for rounds in batches[1:]]
        weights, _ = run.state()
        run.close(keep_state=False)
        results[groups] = losses, grads, weights
    whole_l, whole_g, whole_w = results[1]
    for groups in (2, 4):
        losses, grads, weights = results[groups]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole_l), rtol=1e-5, atol=0)
        assert grads.keys() == whole_g.keys()
        for name, value in whole_g.items():
            error = (grads[name].double() - value.double()).norm() / value.double().norm()
            assert error <= 1e-5, (groups, name, float(error))
        for name, value in whole_w.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-4)


def test_the_block_tasks_say_so_and_are_profiled_apart() -> None:
    """The block tasks carry ``row_groups`` (their signature, the profile cache's key,
    then differs: their workspace is about a group's); the embedding and head tasks do
    not; the default lowers and writes as before the field existed."""
    pytest.importorskip("dataflow_family_llama3")
    from dataflow_training.plan.profile import signature
    from dataflow_training.step.config import OMITTED_DEFAULTS

    family = load_family("llama3")
    steps = {g: lower(family, "llama3_tiny", _train(g)) for g in (1, 2)}
    for kind in ("fwd", "bwd"):
        one, two = ([t for t in steps[g].program.tasks if t.kind == kind][0] for g in (1, 2))
        assert "row_groups" not in one.params and two.params["row_groups"] == 2
        assert signature(steps[1], one) != signature(steps[2], two)
    assert all(
        "row_groups" not in t.params
        for t in steps[2].program.tasks
        if t.kind not in ("fwd", "rec", "bwd")
    )
    assert OMITTED_DEFAULTS["block_row_groups"] == 1
    assert "block_row_groups" not in steps[1].program.to_json()


def test_what_stands_in_its_way_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"block_row_groups=3 \(--block-row-groups\) must divide batch=4"
    ):
        _train(3)
    with pytest.raises(ValueError, match="block_row_groups must be >= 1"):
        _train(0)
    pytest.importorskip("dataflow_family_llama3")
    with pytest.raises(ValueError, match="cannot go with segments"):
        lower(load_family("llama3"), "llama3_tiny", _train(2, segments=True))
    pytest.importorskip("dataflow_family_qwen3_5_moe")
    with pytest.raises(ValueError, match=r"layer .* has Aux, a leader or a loss term"):
        lower(load_family("qwen3_5_moe"), "qwen3_5_moe_tiny", _train(2))


def test_the_command_takes_the_option_and_refuses_a_bad_one_in_one_line(tmp_path) -> None:
    pytest.importorskip("dataflow_family_llama3")
    from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke

    result = invoke(
        "train", "--preset", "llama3_tiny", "--steps", "2", "--batch", "4", "--seq-len",
        "16", "--device", "cpu", "--block-row-groups", "2", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = invoke(
        "train", "--preset", "llama3_tiny", "--steps", "2", "--batch", "4", "--seq-len",
        "16", "--device", "cpu", "--block-row-groups", "3", "--out", str(tmp_path / "bad"),
    )  # fmt: skip
    assert_one_line_error(result, FAILURE_EXIT, "--block-row-groups", "must divide batch=4")
    result = invoke(
        "train", "--preset", "llama3_tiny", "--steps", "2", "--device", "cpu",
        "--block-row-groups", "2", "--out", str(tmp_path / "searched"),
    )  # fmt: skip
    assert_one_line_error(result, 2, "--block-row-groups", "give --batch too")
