"""A cyclic plan's slow budget counts only what is slow: persistent objects homed fast need
none of it, so a slow budget smaller than every persistent object together still plans
when the fast budget can home them."""

from __future__ import annotations

import attrs
import pytest

from dataflow.planning import PlanningError, plan
from dataflow.schema import Location
from dataflow.testing.shapes import MiB, tiny_training


def _persistent():
    program = tiny_training()
    keep = tuple(obj.id for obj in program.objects if obj.id.startswith(("W", "O")))
    objects = tuple(
        attrs.evolve(obj, location=Location.SLOW) if obj.id in keep else obj
        for obj in program.objects
    )
    return attrs.evolve(program, objects=objects, persistent=keep)


def test_persistent_objects_homed_fast_need_no_slow_budget() -> None:
    program = _persistent()
    persistent_bytes = sum(program.obj(o).size_bytes for o in program.persistent)
    roomy = plan(program, 40 * MiB, cyclic=True)
    assert roomy.cycle.valid
    slow_peak = roomy.cycle.sim.slow_peak_bytes
    assert slow_peak < persistent_bytes  # the roomy plan homes some of them fast
    within = plan(program, 40 * MiB, cyclic=True, slow_budget_bytes=slow_peak)
    assert within.cycle.valid and within.cycle.sim.slow_peak_bytes <= slow_peak
    # a one-run plan starts and ends every persistent object slow: it needs them all
    with pytest.raises(PlanningError, match="objects that start or end there"):
        plan(program, 40 * MiB, slow_budget_bytes=persistent_bytes - 1)
