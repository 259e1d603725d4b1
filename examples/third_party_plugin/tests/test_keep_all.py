"""keep-all: the bare chain back when everything fits; a clear error when it does not."""

from __future__ import annotations

import attrs
import pytest
from dataflow_planner_example import plugin
from dataflow_planner_example.keep_all import KeepAllError, Peak, no_offload_peak, plan_keep_all

from dataflow import Obj, Program, Task, get_plugin_manager, planners
from dataflow.testing import tiny_chain

# tiny_chain: x 64 + w0 256 + w1 256 start fast (576); layer_0 adds h0 128 (704), layer_1
# adds h1 128 (832), loss adds loss 8 plus 32 of workspace (872).
PEAK_BYTES = 872


def test_no_offload_peak_counts_every_object_kept_resident() -> None:
    assert no_offload_peak(tiny_chain()) == Peak(PEAK_BYTES, "loss")


def test_peak_at_start_when_no_task_adds_to_it() -> None:
    program = Program(
        name="p",
        objects=(Obj("w", 100, "param", "fast"), Obj("y", 1, "activation")),
        tasks=(Task("t", "k", "k", inputs=("w",), outputs=("y",)),),
    )
    assert no_offload_peak(program) == Peak(101, "t")
    assert no_offload_peak(Program(name="empty", objects=program.objects[:1], tasks=())) == Peak(
        100, None
    )


def test_a_program_that_fits_comes_back_bare_with_its_budget() -> None:
    program = tiny_chain()
    planned = plan_keep_all(program, PEAK_BYTES)
    assert planned.tasks == program.tasks
    assert planned.objects == program.objects
    assert planned.budget is not None and planned.budget.fast_bytes == PEAK_BYTES


def test_existing_directives_are_dropped() -> None:
    program = tiny_chain()
    first, *rest = program.tasks
    with_release = attrs.evolve(program, tasks=(attrs.evolve(first, releases=("x",)), *rest))
    assert plan_keep_all(with_release, PEAK_BYTES).tasks == program.tasks


def test_over_budget_names_the_peak_the_task_and_the_budget() -> None:
    with pytest.raises(KeepAllError) as failure:
        plan_keep_all(tiny_chain(), PEAK_BYTES - 1)
    message = str(failure.value)
    assert "needs 872 B of fast memory" in message and "budget of 871 B;" in message
    assert "task 'loss'" in message and "pressurefit" in message


def test_large_sizes_are_given_in_units_and_bytes() -> None:
    program = Program(
        name="big",
        objects=(Obj("w", 3 * 2**30, "param", "fast"), Obj("y", 2**30, "activation")),
        tasks=(Task("t", "k", "k", inputs=("w",), outputs=("y",)),),
    )
    with pytest.raises(KeepAllError, match=r"needs 4 GiB \(4294967296 bytes\) of fast memory"):
        plan_keep_all(program, 2**30)


def test_an_object_that_starts_slow_cannot_be_used() -> None:
    program = Program(
        name="p",
        objects=(Obj("w", 100, "param", "slow"), Obj("y", 1, "activation")),
        tasks=(Task("t", "k", "k", inputs=("w",), outputs=("y",)),),
    )
    with pytest.raises(KeepAllError, match="task 't' uses object 'w', which starts in slow"):
        plan_keep_all(program, 10_000)


def test_a_final_location_that_needs_a_move_is_refused() -> None:
    program = Program(
        name="p",
        objects=(Obj("w", 100, "param", "fast"), Obj("y", 1, "activation")),
        tasks=(Task("t", "k", "k", inputs=("w",), outputs=("y",)),),
        final_locations={"y": "slow"},
    )
    with pytest.raises(KeepAllError, match="'y' must end in slow memory but stays in fast"):
        plan_keep_all(program, 10_000)


def test_an_invalid_program_lists_its_problems() -> None:
    program = Program(
        name="p",
        objects=(Obj("y", 1, "activation"),),
        tasks=(Task("t", "k", "k", inputs=("missing",), outputs=("y",)),),
    )
    with pytest.raises(KeepAllError, match="program 'p' is not valid:\n  - "):
        plan_keep_all(program, 10_000)


def test_options_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="keep-all takes no options, got: lookahead"):
        plan_keep_all(tiny_chain(), PEAK_BYTES, lookahead=3)


def test_found_through_the_dataflow_registry() -> None:
    manager = get_plugin_manager(autoload=False, allow=["dataflow-planner-example"])
    assert manager.planners().distribution_of("keep-all") == "dataflow-planner-example"
    planned = manager.planners().get("keep-all").plan(tiny_chain(), PEAK_BYTES)
    assert planned.budget is not None and planned.budget.fast_bytes == PEAK_BYTES


def test_registered_through_an_isolated_manager(isolated_plugin_manager) -> None:
    isolated_plugin_manager(plugin)
    assert planners().names() == ["keep-all"]
