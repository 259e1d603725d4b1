"""``simulate``: price an annotated Program exactly as the engine would run it."""

from __future__ import annotations

from dataflow.schema import Program, validate
from dataflow.sim.compiled import compile_program
from dataflow.sim.failure import InvalidProgramError
from dataflow.sim.loop import COLLECTIVE, D2H, H2D, Outcome, run
from dataflow.sim.records import LinkStats, TaskTiming, TransferTiming
from dataflow.sim.result import SimResult
from dataflow.sim.states import CURRENT, RESIDENT

#: validate() problems that depend on the budget. The simulator prices a program under
#: whatever budget it is given, so these are failures of the run (SimResult.error), not
#: structural faults.
BUDGET_PROBLEMS = frozenset({"footprint", "final-fast-overflow", "final-slow-overflow"})


def simulate(
    program: Program,
    *,
    budget_bytes: int | None = None,
    slow_budget_bytes: int | None = None,
    record: bool = True,
    check: bool = True,
) -> SimResult:
    """Run ``program`` under the execution model and report what happens.

    ``budget_bytes`` / ``slow_budget_bytes`` override ``program.budget`` (the fast and
    slow limits; None keeps the program's, and no budget at all means unbounded).
    ``record=False`` skips the per-event timeline (tasks, transfers, memory curves), for
    callers that only need validity, makespan, peaks and the error: it is faster and
    gives identical totals.

    The program must be structurally valid: with ``check`` (the default) it is first run
    through ``dataflow.schema.validate`` and any problem raises ``InvalidProgramError``
    listing all of them. A program that is structurally valid but cannot run (a deadlock,
    use of a dropped object, a footprint over the budget, ...) is not an exception: the
    result is ``valid=False`` with ``error`` naming the task, objects and memory state.
    Pass ``check=False`` only for programs already validated (a planner's own output).
    """
    if check:
        problems = [p for p in validate(program) if p.code not in BUDGET_PROBLEMS]
        if problems:
            raise InvalidProgramError(program.name, problems)
    fast_budget, slow_budget = budget_bytes, slow_budget_bytes
    if program.budget is not None:
        if fast_budget is None:
            fast_budget = program.budget.fast_bytes
        if slow_budget is None:
            slow_budget = program.budget.slow_bytes
    for label, value in (("budget_bytes", fast_budget), ("slow_budget_bytes", slow_budget)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    compiled = compile_program(program)
    outcome = run(compiled, program.links, fast_budget, slow_budget, record)
    return _result(
        program,
        compiled.task_ids,
        compiled.obj_ids,
        compiled.size_bytes,
        outcome,
        fast_budget,
        slow_budget,
        record,
    )


def _result(
    program, task_ids, obj_ids, size_bytes, out: Outcome, fast_budget, slow_budget, record: bool
) -> SimResult:
    makespan = out.makespan_us
    links = {
        direction: LinkStats(
            direction=direction,
            transfers=out.link_transfers[direction],
            bytes=out.link_bytes[direction],
            busy_us=out.link_busy_us[direction],
            busy_fraction=out.link_busy_us[direction] / makespan if makespan > 0 else 0.0,
        )
        for direction in (H2D, D2H, COLLECTIVE)
    }
    tasks: tuple[TaskTiming, ...] = ()
    transfers: tuple[TransferTiming, ...] = ()
    if record:
        tasks = tuple(  # chain order (a collective task may end after later tasks)
            TaskTiming(task_ids[i], start, end) for i, start, end in sorted(out.task_log)
        )
        transfers = tuple(
            TransferTiming(obj_ids[o], direction, size_bytes[o], task_ids[by], enq, start, end)
            for o, direction, by, enq, start, end in out.transfer_log
        )
    return SimResult(
        program_name=program.name,
        valid=out.error is None,
        makespan_us=makespan,
        fast_budget_bytes=fast_budget,
        slow_budget_bytes=slow_budget,
        fast_peak_bytes=out.fast_peak_bytes,
        slow_peak_bytes=out.slow_peak_bytes,
        compute_busy_us=out.compute_busy_us,
        compute_idle_us=makespan - out.compute_busy_us,
        h2d=links[H2D],
        d2h=links[D2H],
        collective=links[COLLECTIVE],
        error=out.error,
        recorded=record,
        tasks=tasks,
        transfers=transfers,
        resident_at_end=tuple(
            obj_ids[o] for o, state in enumerate(out.fast_state) if state == RESIDENT
        ),
        slow_current_at_end=tuple(
            obj_ids[o] for o, state in enumerate(out.slow_state) if state == CURRENT
        ),
        fast_memory=tuple(out.fast_log) if record else (),
        slow_memory=tuple(out.slow_log) if record else (),
        program=program,
    )
