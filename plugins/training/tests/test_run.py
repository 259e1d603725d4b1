"""TrainingRun: the driver against the reference model, clipping against
``torch.nn.utils.clip_grad_norm_``, the state read back, save and restore."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.check.verify import TOLERANCES, step_checks
from dataflow_training.step.config import OptimizerPolicy, TrainConfig

pytest.importorskip("dataflow_family_gpt2")

FP32 = TOLERANCES["fp32"]["step"]


def _family():
    from dataflow_training.step.family import load_family

    return load_family("gpt2")


@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_clipped_steps_match_clip_grad_norm(clip):
    """A clip that binds (0.05 is far below gpt2_tiny's norm) and one that does not: the
    losses, the measured norm, the clipped step-0 gradients and the weights after three
    steps all match the float64 reference that calls clip_grad_norm_ before AdamW."""
    checks = step_checks(
        _family(),
        "gpt2_tiny",
        device="cpu",
        policy="fp32",
        steps=3,
        rounds=2,
        batch=2,
        seq_len=8,
        budget_bytes=None,
        seed=0,
        tolerance=FP32,
        clip=clip,
    )
    norms = [c for c in checks if c.name.startswith("grad norm")]
    assert len(norms) == 3
    failed = [c for c in checks if not c.ok]
    assert not failed, failed[:3]


def _gpt2_steps(**options):
    return step_checks(
        _family(),
        "gpt2_tiny",
        device="cpu",
        policy="fp32",
        budget_bytes=None,
        seed=0,
        tolerance=FP32,
        **{"steps": 3, "rounds": 2, "batch": 2, "seq_len": 8} | options,
    )


def test_every_step_is_checked_from_the_state_it_starts_from():
    """Three rounds of three sequences: compared over three steps from one start, the
    engine's and the reference's weights drifted apart through the near-zero gradients of
    the first step (a query bias 1.46e-4 off after step 2, against 1e-4). Each step from
    the engine's own weights and moments, every step's gradients and weights are held to
    the tolerance."""
    checks = _gpt2_steps(rounds=3, batch=3, seq_len=16)
    failed = [c for c in checks if not c.ok]
    assert not failed, failed[:3]
    for step in range(3):
        assert any(c.name == f"grad 1.attn.c_attn.bias (step {step})" for c in checks)
        assert any(
            c.name.startswith(f"weight 1.attn.c_attn.bias (after step {step}") for c in checks
        )


@pytest.mark.parametrize(
    ("wrong", "value"),
    [("lr", 1.02), ("update", 1)],  # a 2 % larger lr; Adam's bias correction of step 1
    ids=["lr", "bias-correction"],
)
def test_a_wrong_later_update_fails_its_own_step(monkeypatch, wrong, value):
    """The engine's third update goes wrong (its lr, or the step count its bias correction
    reads): the weights after step 2 fail, those after steps 0 and 1 and every
    gradient pass."""
    from dataflow_training.drive.run import TrainingRun

    step = TrainingRun.step

    def third_wrong(self, batches, lr=None, **kwargs):
        if self.updates != 2:
            return step(self, batches, lr, **kwargs)
        if wrong == "lr":
            return step(self, batches, value * self.train.optimizer.lr, **kwargs)
        updates, self.updates = self.updates, value - 1  # values["update"] = value
        stats = step(self, batches, lr, **kwargs)
        self.updates = updates + 1
        return stats

    monkeypatch.setattr(TrainingRun, "step", third_wrong)
    failed = [c.name for c in _gpt2_steps() if not c.ok]
    assert failed, "a wrong third update passed"
    assert all(n.startswith("weight ") and "(after step 2" in n for n in failed), failed


def test_binding_clip_changes_the_update():
    """Clipping at 0.05 must move the weights differently from no clipping (the check
    above could pass with clipping silently off only if this fails)."""
    from dataflow_training.drive.run import TrainingRun

    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))]
    out = {}
    for clip in (None, 0.05):
        train = TrainConfig(seq_len=8, batch=2, clip=clip, grad_norm=True)
        with TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0) as run:
            stats = run.step(batches)
            run.step(batches)
            out[clip] = (stats.grad_norm, run.state()[0]["emb.wte"])
    assert out[None][0] == pytest.approx(out[0.05][0], rel=1e-6)  # the norm before clipping
    assert out[None][0] > 0.05
    assert not torch.allclose(out[None][1], out[0.05][1])


def test_lr_per_step_reaches_the_update():
    """lr=0 leaves the weights as they were; the policy's default lr moves them."""
    from dataflow_training.drive.run import TrainingRun

    train = TrainConfig(seq_len=8, batch=2, optimizer=OptimizerPolicy(lr=1e-2))
    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))]
    with TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0) as run:
        before = run.state()[0]
        run.step(batches, lr=0.0)
        same = run.state()[0]
        run.step(batches)
        after = run.state()[0]
    assert all(torch.equal(before[k], same[k]) for k in before)
    assert not torch.equal(before["emb.wte"], after["emb.wte"])


def test_bad_batches_name_what_is_wrong():
    from dataflow_training.drive.run import TrainingRun

    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    run = TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0)
    good = (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="2 accumulation round"):
        run.step([good])
    with pytest.raises(ValueError, match=r"round 1 tokens have shape \(2, 9\)"):
        run.step([good, (torch.zeros(2, 9, dtype=torch.int64), good[1])])
    with pytest.raises(ValueError, match="reach id 300"):
        run.step([good, (torch.full((2, 8), 300), good[1])])


def test_the_engine_takes_start_values_one_object_at_a_time(monkeypatch):
    """The first step's start values are built as the engine copies each in (the zero
    optimizer state of a 30B model would not fit beside the pinned pool otherwise): each
    looked up once, and no earlier one still alive when the next is built; the step
    equals one loaded from every value built up front (``start_values``)."""
    import gc
    import weakref

    from dataflow_training.drive import values
    from dataflow_training.drive.run import TrainingRun

    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    batches = [tuple(torch.randint(0, 256, (2, 8)) for _ in range(2)) for _ in range(2)]
    alive: list[weakref.ref] = []
    looked_up: list[str] = []
    built = values.StartValues.__getitem__

    def spy(self, obj_id):
        gc.collect()
        assert all(ref() is None for ref in alive), f"a value is alive when {obj_id} is built"
        value = built(self, obj_id)
        looked_up.append(obj_id)
        if obj_id.startswith(("W_", "O_")):
            alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(values.StartValues, "__getitem__", spy)
    lazy = TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0)
    stats = lazy.step(batches)
    program = lazy.compiled.program
    assert sorted(looked_up) == sorted(
        o.id for o in program.objects if program.exists_at_start(o.id)
    )
    assert len(alive) > 4
    monkeypatch.undo()
    eager = TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0)
    eager_initial = values.start_values(
        eager.compiled.running, eager._weights, lambda _s, r: batches[r]
    )
    assert set(eager_initial) == set(looked_up)
    assert eager.step(batches).losses == stats.losses


@pytest.mark.parametrize("tied", [False, True])
def test_layer_order_trains_as_round_order_does(tied):
    """Two steps of 3 rounds in a budget that offloads: by layers (and by layers in groups
    of 2 rounds) the losses and weights are the round order's, bit for bit without tied
    embeddings (every gradient sums its rounds
    in the same order); tied, the head's rounds reach the embedding's gradient before the
    embedding backward's, a different order of the same float32 sums."""
    pytest.importorskip("dataflow_family_llama3")
    from dataflow_training.drive.run import TrainingRun

    torch.manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))) for _ in range(3)]
    out = {}
    orders = ("round", "layer") if tied else ("round", "layer", "layer:2")
    for order in orders:
        train = TrainConfig(seq_len=8, batch=2, rounds=3, order=order)
        overrides = {"tie_word_embeddings": tied}
        with TrainingRun.of(
            "llama3", "llama3_tiny", train, seed=0, overrides=overrides, budget_bytes=3 * 2**20
        ) as run:
            losses = [run.step(batches).loss for _ in range(2)]
            moved = run.last_result.steps[-1].transfers
            out[order] = (losses, run.state()[0], moved)
    (round_losses, round_state, moved), (layer_losses, layer_state, _), *grouped = out.values()
    assert moved, "the budget should make the plan move objects"
    if tied:
        assert layer_losses == pytest.approx(round_losses, rel=1e-6)
        for key, value in round_state.items():
            torch.testing.assert_close(layer_state[key], value, rtol=1e-5, atol=1e-6)
    else:
        for losses, state, _ in ((layer_losses, layer_state, None), *grouped):
            assert losses == round_losses
            assert all(torch.equal(state[k], v) for k, v in round_state.items())


def test_a_gradient_of_the_wrong_shape_fails_its_checks_without_stopping_verify(monkeypatch):
    """A gradient read back at the wrong shape fails its grad check and its weight check
    (no allowance can be made from it); the other checks still run."""
    from dataflow_training.drive.run import TrainingRun

    grads = TrainingRun.grads

    def one_wrong(self):
        found = grads(self)
        found["head.ln_f.bias"] = found["head.ln_f.bias"][:-1]
        return found

    monkeypatch.setattr(TrainingRun, "grads", one_wrong)
    checks = _gpt2_steps(steps=1)
    failed = {c.name for c in checks if not c.ok}
    assert any(n.startswith("grad head.ln_f.bias (step 0)") for n in failed), failed
    assert "weight head.ln_f.bias (after step 0; its gradients' shapes differ)" in failed
    assert len(failed) == 2, failed
