"""Frozen weights streamed under a tight budget (llama3_tiny on the CPU): a frozen weight,
or a LoRA run's base weight, that the plan homes in fast memory and drops within the step
is released and fetched again, never written back (``Program.read_only_ids``): the plan
has no device-to-host transfer of any of them, while the same step planned as before
(every weight treated as written: ``read_only_ids`` empty) wrote such a weight back and
moved more bytes. The run's losses equal an unconstrained run's, and the frozen weights
come out bit-identical."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.drive.run import TrainingRun
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.step.config import OptimizerPolicy, TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import load_family
from dataflow_training.step.freezing import frozen_names
from dataflow_training.step.lora import LoraConfig

from dataflow import Program, fast_homes

pytest.importorskip("dataflow_family_llama3")

PRESET = "llama3_tiny"
SHAPE = {"seq_len": 64, "batch": 4, "rounds": 1}
STEPS = 3
#: float32 on the CPU; the plans differ only in where objects wait, not in the math
TOLERANCE = 1e-6

CASES = {
    # 70 % of the unconstrained peak (1,657,860 bytes): both frozen weights homed fast,
    # block 0's dropped within the step (before: both written back)
    "frozen": (
        TrainConfig(**SHAPE, freeze=("embed", "layers.0"), optimizer=OptimizerPolicy(lr=3e-3)),
        1_160_000,
        {"W_emb", "W_0"},
    ),
    # 60 % of the unconstrained peak (1,987,588 bytes): every base weight homed fast and
    # dropped within the step (before: three of them written back)
    "lora": (
        TrainConfig(**SHAPE, lora=LoraConfig(4), optimizer=OptimizerPolicy(lr=3e-3)),
        1_190_000,
        {"W_emb", "W_0", "W_1", "W_head"},
    ),
}


def _compiled(train: TrainConfig, budget: int | None):
    return compile_step("llama3", PRESET, train, budget_bytes=budget, cost=RooflineCost())


def _written_back(plan, objects: set[str]) -> set[str]:
    return {t.obj_id for t in plan.sim.transfers if t.direction == "d2h"} & objects


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_frozen_weight_is_never_written_back(case, monkeypatch) -> None:
    train, budget, frozen = CASES[case]
    after = _compiled(train, budget).placement.plan
    program = after.program
    assert program.read_only_ids == frozen
    homed = fast_homes(program) & frozen
    dropped = {o for t in program.tasks for o in (*t.releases, *t.offloads)}
    assert homed & dropped, "the budget should make the plan drop a fast-homed frozen weight"
    assert not _written_back(after, frozen)
    assert not _written_back(after.cycle, frozen)  # nor in the second iteration
    assert not {o for t in program.tasks for o in t.offloads} & frozen  # releases only
    # the same step planned as before: a frozen weight is treated as written
    monkeypatch.setattr(Program, "read_only_ids", property(lambda self: frozenset()))
    before = _compiled(train, budget).placement.plan
    monkeypatch.undo()
    assert _written_back(before, frozen), "before, a frozen weight was written back"
    moved_before = before.sim.h2d.bytes + before.sim.d2h.bytes
    moved_after = after.sim.h2d.bytes + after.sim.d2h.bytes
    assert after.sim.d2h.bytes < before.sim.d2h.bytes
    assert moved_after < moved_before, (moved_before, moved_after)
    assert after.cycle.iteration_us <= before.cycle.iteration_us


def _run(train: TrainConfig, budget: int | None) -> tuple[list[float], dict, dict, set[str]]:
    """Losses of ``STEPS`` steps on one batch, the weights before and after, and the
    objects the engine wrote back in the last step."""
    run = TrainingRun.of(
        "llama3", PRESET, train, device="cpu", resolver="torch", cost=RooflineCost(),
        budget_bytes=budget,
    )  # fmt: skip
    before, _ = run.state()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.vocab_size, (train.batch, train.seq_len + 1), generator=g)
    batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    losses = [run.step(batch).loss for _ in range(STEPS)]
    after, _ = run.state()
    written = {t.obj for s in run.last_result.steps for t in s.transfers if t.direction == "d2h"}
    run.close()
    return losses, before, after, written


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_frozen_run_trains_as_an_unconstrained_one(case) -> None:
    train, budget, frozen = CASES[case]
    free, _, _, _ = _run(train, None)
    losses, before, after, written = _run(train, budget)
    assert losses == pytest.approx(free, rel=TOLERANCE, abs=TOLERANCE)
    assert losses[-1] < losses[0]
    assert not written & frozen, written
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    if case == "lora":  # the adapters train, the whole base is frozen
        assert changed and all("lora_" in name for name in changed), changed
    else:
        family = load_family("llama3")
        layers = family.layers(family.config(PRESET))
        assert changed == set(before) - frozen_names(layers, train.freeze)
