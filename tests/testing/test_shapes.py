"""The chain-shape generators: valid, seeded, bare, and plannable."""

from __future__ import annotations

import random

import pytest

from dataflow.planning import plan
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.schema import validate
from dataflow.testing.shapes import SHAPES, mutate_and_reuse, tiny_streaming, tiny_training


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shapes_are_valid_bare_and_seeded(shape: str, seed: int) -> None:
    program = SHAPES[shape](random.Random(seed))
    assert validate(program) == []
    assert program == program.bare()
    assert SHAPES[shape](random.Random(seed)) == program
    peak = no_offload_peak_bytes(build_chain(program))
    assert plan(program, peak * 2).sim.valid


@pytest.mark.parametrize("make", [tiny_training, tiny_streaming, mutate_and_reuse])
def test_small_chains_are_valid(make) -> None:
    assert validate(make()) == []


def test_training_phases_have_more_compute_than_transfers() -> None:
    program = SHAPES["training"](random.Random(3))
    h2d = program.links.h2d
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    for task in program.tasks:
        if task.kind == "opt":
            moved = sum(h2d.transfer_us(sizes[obj]) for obj in task.inputs + task.mutates)
            assert task.cost_us >= moved
