"""The bf16 yardstick of ``verify``'s step gradients: a gradient check passes within
``YARDSTICK_FACTOR`` times plain bf16 autograd's error on the same tensor where that is
above the flat tolerance; ``step_checks`` computes that error from the very weights,
batches and accumulation of the float64 reference; a wrong engine gradient still fails;
``--no-yardstick`` leaves the flat tolerance alone."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_training.check.verify import TOLERANCES, YARDSTICK_FACTOR, Check, step_checks
from dataflow_training.check.verify_checks import YARDSTICK_LOSS_SCALES

from dataflow.testing import invoke

pytest.importorskip("dataflow_family_gpt2")

BF16 = TOLERANCES["bf16"]["step"]
#: gpt2_tiny's step, small enough for a second on two CPU cores
SHAPE = {"steps": 1, "rounds": 2, "batch": 1, "seq_len": 8}


def _grad_check(rel: float, yardstick: float | None, **fields) -> Check:
    return Check(
        "step", "grad 0.q_norm.weight (step 2)", 1e-3, rel, BF16, yardstick=yardstick, **fields
    )


def test_a_yardstick_raises_the_tolerance_to_twice_itself_and_no_further():
    """5 % flat; a yardstick of 4.1 % accepts up to 8.2 %, and nothing past it."""
    assert YARDSTICK_FACTOR == 2.0
    assert _grad_check(0.07, 0.041).effective_tolerance == pytest.approx(0.082)
    assert _grad_check(0.07, 0.041).ok
    assert not _grad_check(0.09, 0.041).ok


def test_a_small_or_missing_yardstick_leaves_the_flat_tolerance():
    assert _grad_check(0.04, 0.01).effective_tolerance == BF16  # 2 x 1 % is below 5 %
    assert not _grad_check(0.06, 0.01).ok
    assert _grad_check(0.06, None).effective_tolerance == BF16
    assert not _grad_check(0.06, None).ok
    for broken in (math.nan, math.inf):  # plain bf16 overflowed: it proves nothing
        assert _grad_check(0.06, broken).effective_tolerance == BF16
        assert not _grad_check(0.06, broken).ok


def test_the_absolute_tolerance_still_applies_beside_the_yardstick():
    assert _grad_check(0.5, 0.041, abs_tolerance=1e-2).ok  # max |diff| 1e-3 <= 1e-2
    assert not _grad_check(0.5, 0.041, abs_tolerance=1e-4).ok


def _gpt2_bf16(**options):
    from dataflow_training.step.family import load_family

    return step_checks(
        load_family("gpt2"),
        "gpt2_tiny",
        device="cpu",
        budget_bytes=None,
        seed=0,
        **{"policy": "bf16", "tolerance": BF16, **SHAPE} | options,
    )


def _plain_grads(family, config, state, dtype, batches, scale=1.0):
    """The step's gradients by plain autograd in ``dtype`` of the loss times ``scale``
    (divided by it in float64), written out apart from ``step_checks`` (as
    benchmarks/bf16_yardstick.py does)."""
    model = family.reference_model(config).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    for x, t in batches:
        (model(x, t) / len(batches) * scale).backward()
    return {n: p.grad.double() / scale for n, p in model.named_parameters() if p.grad is not None}


def test_every_gradient_check_carries_plain_bf16_autogradients_error_and_no_other():
    """Each gradient check's yardstick is the largest relative error against float64 of
    plain bf16 autograd on that gradient, its loss scaled by each of
    ``YARDSTICK_LOSS_SCALES``, from the run's start weights (the seeded reference rounded
    to bf16) on the same two rounds; loss and weight checks have none."""
    from dataflow_training.check.verify_step import step_tokens
    from dataflow_training.step.family import embed_layer, load_family

    checks = _gpt2_bf16()
    grads = [c for c in checks if c.name.startswith("grad ")]
    assert grads and all(c.yardstick is not None for c in grads)
    assert all(math.isfinite(c.yardstick) and c.yardstick > 0 for c in grads)
    others = [c for c in checks if not c.name.startswith("grad ")]
    assert {c.name.split()[0] for c in others} == {"loss", "weight"}
    assert all(c.yardstick is None for c in others)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok][:3]

    family = load_family("gpt2")
    config = family.config("gpt2_tiny")
    torch.manual_seed(0)
    state = {
        k: v.detach().to(torch.bfloat16)
        for k, v in family.reference_model(config).state_dict().items()
    }
    vocab = embed_layer(family.layers(config)).params[0].shape[0]
    batches = [step_tokens(0, vocab, 1, 8, 0, r) for r in range(2)]
    exact = _plain_grads(family, config, state, torch.float64, batches)
    samples = [
        _plain_grads(family, config, state, torch.bfloat16, batches, scale)
        for scale in YARDSTICK_LOSS_SCALES
    ]
    assert len(set(YARDSTICK_LOSS_SCALES)) == 3 and 1.0 in YARDSTICK_LOSS_SCALES
    moved = 0
    for check in grads:
        name = check.name.removeprefix("grad ").removesuffix(" (step 0)")
        g = exact[name]
        errors = [((sample[name] - g).norm() / g.norm()).item() for sample in samples]
        assert check.yardstick == pytest.approx(max(errors), rel=1e-6), name
        moved += len(set(errors)) > 1  # another scale, another rounding
    assert moved > len(grads) / 2


def test_a_wrong_engine_gradient_fails_with_the_yardstick_on(monkeypatch):
    """One engine gradient 30 % too large is far past twice plain bf16's error (about
    1 % here): its check fails though it carries a yardstick; every other passes."""
    from dataflow_training.drive.run import TrainingRun

    grads = TrainingRun.grads
    wrong = "0.attn.c_attn.weight"

    def scaled(self):
        found = grads(self)
        found[wrong] = found[wrong] * 1.3
        return found

    monkeypatch.setattr(TrainingRun, "grads", scaled)
    checks = _gpt2_bf16()
    failed = [c for c in checks if not c.ok]
    assert [c.name for c in failed] == [f"grad {wrong} (step 0)"], failed
    assert failed[0].yardstick is not None and failed[0].rel == pytest.approx(0.3, abs=0.02)


def test_without_the_yardstick_and_in_fp32_no_check_carries_one():
    assert all(c.yardstick is None for c in _gpt2_bf16(yardstick=False))
    fp32 = _gpt2_bf16(policy="fp32", tolerance=TOLERANCES["fp32"]["step"])
    assert all(c.yardstick is None for c in fp32)


def test_the_command_passes_the_option_and_shows_a_raised_tolerance(monkeypatch):
    """``dataflow verify`` hands ``--yardstick`` (the default) or ``--no-yardstick`` to
    ``verify``; a check passing on its yardstick shows it in the tolerance cell."""
    import dataflow_training.check.verify as verify_module

    monkeypatch.setenv("COLUMNS", "200")  # the table's cells unwrapped
    given = []

    def fake_verify(*args, **kwargs):
        given.append(kwargs["yardstick"])
        return [_grad_check(0.07, 0.041)]

    monkeypatch.setattr(verify_module, "verify", fake_verify)
    tiny = ("verify", "--family", "gpt2", "--preset", "gpt2_tiny", "--dtype", "bf16")
    shown = invoke(*tiny)
    assert shown.exit_code == 0, shown.output
    assert "5e-02 or 2 x 4.1e-02" in shown.stdout
    assert invoke(*tiny, "--no-yardstick").exit_code == 0
    assert given == [True, False]


@pytest.mark.parametrize(
    ("family_name", "preset"),
    [("toy_moe", "toy_moe_tiny"), ("olmoe", "olmoe_tiny")],
    ids=["over-rounds", "routed"],
)
def test_a_mixture_of_experts_step_carries_yardsticks_too(family_name, preset):
    """The reference whose objective spans the rounds (toy_moe) and the one routed with
    the engine's recorded choices (olmoe) give every gradient check a yardstick."""
    from dataflow_training.step.family import load_family

    if family_name == "olmoe":
        pytest.importorskip("dataflow_family_olmoe")
    checks = step_checks(
        load_family(family_name),
        preset,
        device="cpu",
        policy="bf16",
        budget_bytes=None,
        seed=0,
        tolerance=BF16,
        **SHAPE,
    )
    grads = [c for c in checks if c.name.startswith("grad ")]
    assert grads and all(math.isfinite(c.yardstick) and c.yardstick > 0 for c in grads)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok][:3]


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_a_scaled_sample_is_the_same_gradient_clipped_the_same_way(clip):
    """``Reference.grads(loss_scale=s)``: the loss times s and the gradients divided by s
    in float64, then clipped there where the step clips; in float64 (no rounding to
    re-draw) that is the unscaled sample's gradient to 1e-12, clipped or not (1e-3 clips
    every step of gpt2_tiny here)."""
    from dataflow_training.check.verify_step import (
        Reference,
        start_weights,
        step_config,
        step_tokens,
    )
    from dataflow_training.step.family import embed_layer, load_family

    family = load_family("gpt2")
    config = family.config("gpt2_tiny")
    train = step_config("fp32", batch=1, seq_len=8, rounds=2, clip=clip)
    weights = start_weights(family, config, 0, torch.float64)
    vocab = embed_layer(family.layers(config)).params[0].shape[0]
    batches = [step_tokens(0, vocab, 1, 8, 0, r) for r in range(2)]
    reference = Reference(family, config, train)
    found = reference.grads(weights, batches)
    plain = {n: g.clone() for n, g in found.grads.items()}
    scaled = reference.grads(weights, batches, loss_scale=3.0)
    if clip is not None:  # both norms are the gradient's before clipping
        assert found.norm > clip
        assert float(scaled.norm) == pytest.approx(float(found.norm), rel=1e-9)
    for name, g in plain.items():
        torch.testing.assert_close(scaled.grads[name], g, rtol=1e-12, atol=1e-15)
