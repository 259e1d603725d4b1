"""Why a simulated run failed: one record naming the task, the objects and fast memory."""

from __future__ import annotations

import enum

import attrs

from dataflow.schema import Problem


class FailureKind(enum.StrEnum):
    """Stable codes of ``SimError.kind`` (docs/execution_model.md, section Failure)."""

    #: nothing runs, the next task cannot start and no queued transfer can start
    DEADLOCK = "deadlock"
    #: the next task needs an object that is not in fast memory and no prefetch brings it
    NOT_RESIDENT = "not-resident"
    #: the next task needs an object whose only copy a dirty release dropped
    LOST = "lost"
    #: release or offload of an object that is not resident (or already leaving)
    RELEASE_NOT_RESIDENT = "release-not-resident"
    OFFLOAD_NOT_RESIDENT = "offload-not-resident"
    #: prefetch of an object already in (or on its way to) fast memory
    PREFETCH_RESIDENT = "prefetch-resident"
    #: prefetch of an object with no current slow copy and no offload to make one
    PREFETCH_NO_SLOW_COPY = "prefetch-no-slow-copy"
    #: a task's inputs + mutates + outputs + workspace exceed the fast budget
    FOOTPRINT = "footprint"
    #: one prefetch is larger than the fast budget
    TRANSFER_TOO_LARGE = "transfer-too-large"
    #: an offload needs slow space that the slow budget no longer has
    SLOW_BUDGET = "slow-budget"
    #: the objects that start in fast (or slow) memory exceed its budget
    INITIAL_OVERFLOW = "initial-overflow"
    #: at the end, an object is not where ``final_locations`` says
    FINAL_LOCATION = "final-location"


@attrs.frozen
class SimError:
    """The failure of a run, at ``time_us``.

    ``task`` is the task that is blocked or whose directive failed (None when no task is
    involved: a stalled transfer after the last task, the initial state, final locations).
    ``objects`` are the objects it waits for or that are at fault. ``fast_bytes_in_use``,
    ``resident`` and ``incoming`` describe fast memory at that moment: ``resident`` and
    ``incoming`` are object ids in declaration order; ``reserved_bytes`` is what the running
    task holds for its outputs and workspace (0 when none runs).
    """

    kind: FailureKind
    message: str
    time_us: float
    task: str | None = None
    objects: tuple[str, ...] = ()
    fast_bytes_in_use: int = 0
    fast_budget_bytes: int | None = None
    resident: tuple[str, ...] = ()
    incoming: tuple[str, ...] = ()
    reserved_bytes: int = 0

    def __str__(self) -> str:
        return f"[{self.kind}] at {self.time_us:g} us: {self.message}"


class InvalidProgramError(ValueError):
    """``simulate`` was given a program that fails ``dataflow.schema.validate``.

    ``problems`` holds every structural problem found (budget-dependent ones excepted:
    those are failures of the run, reported in ``SimResult.error``).
    """

    def __init__(self, program_name: str, problems: list[Problem]):
        self.program_name = program_name
        self.problems = problems
        listing = "\n".join(f"  - [{problem.code}] {problem.message}" for problem in problems)
        super().__init__(
            f"program {program_name!r} is not structurally valid, so it cannot be simulated:\n"
            f"{listing}"
        )
