"""Steady-state training steps: weights, optimizer state and aux are persistent, the step
is planned as a cycle, and consecutive steps leave each where the next one starts.

- the lowering declares exactly the W/O/Aux objects persistent;
- ``place`` packs a fast-homed object's last and first residency at one offset;
- on the engine a fast-homed weight stays in one buffer from step to step (nothing is
  copied between steps), and several consecutive steps give exactly the losses and
  weights of the same run at an unbounded budget (plain autograd is the truth in
  ``verify``; here the tight and the unbounded engine runs must agree bit for bit).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dataflow_family_gpt2.family import GPT2Family  # noqa: E402
from dataflow_training import TrainConfig, TrainingRun, lower  # noqa: E402

from dataflow import Location, place, plan  # noqa: E402

TRAIN = TrainConfig(seq_len=32, batch=2, rounds=2)
STEPS = 4


def _program():
    return lower(GPT2Family(), "gpt2_tiny", TRAIN).program


def test_lowering_declares_weights_optimizer_state_and_aux_persistent() -> None:
    program = _program()
    kinds = {obj: obj.split("_", 1)[0] for obj in program.persistent}
    assert set(kinds.values()) <= {"W", "O", "Aux"}
    assert {o.id for o in program.objects if o.id.startswith(("W_", "O_"))} <= set(
        program.persistent
    )
    assert not any(o.startswith(("dW_", "x_", "t_", "loss_")) for o in program.persistent)


@pytest.mark.parametrize("share", [0.6, 1.0, 1.5, 4.0])
def test_fast_homes_wrap_at_one_offset(share: float) -> None:
    program = _program()
    persistent = sum(program.obj(o).size_bytes for o in program.persistent)
    planned = plan(program, int(persistent * share), cyclic=True)
    placement = place(planned)
    homed = [
        o
        for o in planned.program.persistent
        if planned.program.final_locations.get(o) is Location.FAST
    ]
    for obj in homed:
        blocks = sorted(placement.blocks_of(obj), key=lambda b: b.start)
        assert blocks[0].offset_bytes == blocks[-1].offset_bytes, obj
    if share >= 4.0:
        assert homed and planned.moved_bytes < persistent // 100  # everything stays fast


def _run(budget: int | None):
    gen = torch.Generator().manual_seed(0)
    losses, pointers = [], []
    with TrainingRun.of("gpt2", "gpt2_tiny", TRAIN, budget_bytes=budget) as run:
        homed = [
            o
            for o in run.compiled.program.persistent
            if run.compiled.program.final_locations.get(o) is Location.FAST
        ]
        for _ in range(STEPS):
            batches = [
                tuple(torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2))
                for _ in range(2)
            ]
            losses.append(run.step(batches, lr=1e-3).losses)
            buffers = run._engine._backend.fast.buffers
            pointers.append({o: buffers[o].data_ptr() for o in homed if o in buffers})
        weights, opt = run.state()
        moved = run.compiled.predicted()["moved_bytes"]
    return losses, weights, opt, pointers, moved


def test_consecutive_steps_agree_across_budgets_and_keep_fast_homes_in_place() -> None:
    losses, weights, opt, pointers, moved = _run(None)
    assert pointers[0] and all(p == pointers[0] for p in pointers)  # nothing moved
    assert moved < 10_000  # only the losses and norms go to slow memory
    persistent = sum(_program().obj(o).size_bytes for o in _program().persistent)
    tight = _run(int(persistent * 1.05))
    assert tight[4] > persistent // 2  # the tight budget really streams weights
    assert tight[0] == losses
    for name, w in weights.items():
        assert torch.equal(w, tight[1][name]), name
    for name, o in opt.items():
        assert torch.equal(o, tight[2][name]), name


@pytest.mark.parametrize("share", [0.6, 1.5])
def test_virtual_engine_repeats_the_simulated_steady_state_step(share: float) -> None:
    from dataflow import Engine

    program = _program()
    persistent = sum(program.obj(o).size_bytes for o in program.persistent)
    planned = plan(program, int(persistent * share), cyclic=True)
    with Engine("virtual") as engine:
        engine.load(planned)
        result = engine.run(steps=3)
    for trace in result.steps:
        assert trace.makespan_us == pytest.approx(planned.sim.makespan_us, rel=1e-12)
        assert trace.fast_peak_bytes == planned.sim.fast_peak_bytes
    assert planned.cycle is not None and planned.cycle.valid
