"""The dispatcher: runs a program on a backend by the rules of docs/execution_model.md.

It owns the decisions (when a task may start, when a transfer may start, what a directive
does) and the ledger; a backend owns time and data. With the virtual backend the result
is the simulator's timeline, event for event.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Protocol

import attrs

from dataflow.engine.contract import MissingValueError
from dataflow.engine.ledger import Fast, Ledger, Slow
from dataflow.schema import Location, Program
from dataflow.sim.failure import FailureKind


class OpKind(enum.IntEnum):
    """What completed; the values are the tie order at one instant."""

    TASK = 1
    D2H = 2
    H2D = 3
    #: a collective task (an all-reduce on the collective link): it ends before a compute
    #: task that ends at the same instant
    COLLECTIVE = 0

    @classmethod
    def of(cls, task) -> OpKind:
        """The kind of a task's operation: where it runs."""
        return cls.COLLECTIVE if task.collective else cls.TASK


@attrs.frozen
class Completion:
    kind: OpKind
    ref: int  # task index (TASK, COLLECTIVE), or transfer serial
    start_us: float
    end_us: float


@attrs.define
class TransferRecord:
    serial: int
    obj: str
    direction: str  # "h2d" or "d2h"
    size_bytes: int
    by_task: str
    enqueue_us: float
    start_us: float | None = None
    end_us: float | None = None


@attrs.frozen
class TaskRecord:
    index: int
    task: str
    start_us: float
    end_us: float


class Backend(Protocol):
    """What the dispatcher needs from a backend (see engine/backends/). ``runs_in_order``:
    each of its lanes runs operations in launch order (a CUDA stream, the CPU backend's
    worker queues), so a task launched behind the running one starts when that one ends
    (``Dispatcher``'s ``run_ahead``)."""

    runs_in_order: bool

    def now_us(self) -> float: ...
    def can_alloc_fast(self, obj: str) -> bool: ...
    def can_start_task(self, index: int) -> bool: ...
    def alloc_fast(self, obj: str) -> None: ...
    def free_fast(self, obj: str) -> None: ...
    def launch_task(self, index: int) -> None: ...
    def launch_transfer(self, serial: int, obj: str, direction: str) -> None: ...
    def wait(self) -> list[Completion]: ...


class OpFailed(Exception):
    """Raised by a backend's ``wait`` when an operation raised; the dispatcher reports it
    as an ``EngineRunError`` with the memory state."""

    def __init__(self, kind: OpKind, ref: int, what: str, cause: BaseException) -> None:
        self.kind, self.ref, self.what, self.cause = kind, ref, what, cause
        if isinstance(cause, MissingValueError):  # its message names the task already
            super().__init__(str(cause))
        else:
            super().__init__(f"{what} raised {type(cause).__name__}: {cause}")


class EngineRunError(RuntimeError):
    """A run that cannot go on: ``kind`` is a ``FailureKind`` (the codes of
    docs/execution_model.md, the same the simulator reports); names the task, the objects
    involved and fast memory at that moment."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        task: str | None,
        objects: tuple[str, ...],
        fast_used_bytes: int,
        resident: tuple[str, ...],
    ) -> None:
        self.kind, self.task, self.objects = kind, task, objects
        self.fast_used_bytes, self.resident = fast_used_bytes, resident
        memory = (
            f" (fast memory in use: {fast_used_bytes} bytes; resident: "
            f"{', '.join(resident) or 'nothing'})"
            if fast_used_bytes >= 0
            else ""
        )
        # an executable's or a copy's own error is not prefixed with its kind: the CLI
        # says "error: " already, and the message names the task and what it raised
        head = message if kind == "error" else f"{kind}: {message}"
        super().__init__(f"{head}{memory}")


@attrs.frozen
class DispatchTrace:
    """What one run did: spans, transfers, memory counters and peaks.

    A step replayed from a CUDA graph (``replayed``) has its measured makespan but no
    task or transfer spans (nothing is timed inside the graph); its memory counters and
    peaks are those of the captured step, which every replay repeats."""

    tasks: tuple[TaskRecord, ...]
    transfers: tuple[TransferRecord, ...]
    fast_counter: tuple[tuple[float, int], ...]
    slow_counter: tuple[tuple[float, int], ...]
    fast_peak_bytes: int
    slow_peak_bytes: int
    makespan_us: float
    replayed: bool = False
    #: tasks launched behind a running task rather than at its end (``run_ahead``)
    launched_ahead: int = 0


class Dispatcher:
    """One run of ``program`` on ``backend`` within the given budgets.

    ``run_ahead`` (on a backend whose lanes run in launch order, ``runs_in_order``): the
    next compute task is launched while the one before it still runs, when nothing that
    task's end does can change what the next one reads or where it writes (its inputs are
    resident or that task's outputs; no release or offload at that end touches them; room
    for its outputs and workspace is there now, beside the head of the h2d queue). The
    device then starts it the moment the running task ends, as the execution model says,
    instead of once the host has noticed that end and launched it: the host's launch time
    hides behind the device's work. Anything else waits for the end as before; the
    decisions and their order are the model's either way."""

    def __init__(
        self,
        program: Program,
        backend: Backend,
        fast_budget_bytes: int | None,
        slow_budget_bytes: int | None = None,
        *,
        run_ahead: bool = False,
    ) -> None:
        self.program, self.backend = program, backend
        self.tasks = program.tasks
        self.ledger = Ledger(program, fast_budget_bytes, slow_budget_bytes)
        self.next_task = 0
        self.running_task: int | None = None  # the compute task running
        self.run_ahead = run_ahead and backend.runs_in_order
        self.queued_task: int | None = None  # launched behind the running task
        self.early: Completion | None = None  # the queued task's end, seen before the running's
        self.launched_ahead = 0
        self.running_collective: int | None = None  # the collective task running
        self.held: frozenset[str] = frozenset()  # the objects the running collective uses
        self.queues: dict[str, deque[TransferRecord]] = {"d2h": deque(), "h2d": deque()}
        self.running: dict[str, TransferRecord | None] = {"d2h": None, "h2d": None}
        self.transfers: list[TransferRecord] = []
        self.pending_prefetch: dict[str, int] = {}  # object -> queued or running prefetches
        self.dropped_by: dict[str, str] = {}  # object -> task whose release lost its value
        self.checked_task = -1  # the last task checked when it became next
        self.task_records: list[TaskRecord] = []
        self.fast_counter: list[tuple[float, int]] = [(0.0, self.ledger.fast_used_bytes)]
        self.slow_counter: list[tuple[float, int]] = [(0.0, self.ledger.slow_used_bytes)]
        self.end_us = 0.0

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> DispatchTrace:
        self._check_start()
        try:
            prologue = self.program.prologue
            if prologue:  # fires at time 0, before task 0 can be dispatched
                self._fire(prologue)
                self._count_fast()
            self._loop()
        except OpFailed as failed:  # an executable or a copy raised, at launch or later
            task = (
                self.tasks[failed.ref].id
                if failed.kind in (OpKind.TASK, OpKind.COLLECTIVE)
                else None
            )
            raise EngineRunError(
                "error",
                str(failed),
                task=task,
                objects=(),
                fast_used_bytes=self.ledger.fast_used_bytes,
                resident=tuple(self.ledger.resident_objects()),
            ) from failed.cause
        self._check_final_locations()
        return DispatchTrace(  # tasks in chain order (a collective may end after later ones)
            tasks=tuple(sorted(self.task_records, key=lambda record: record.index)),
            transfers=tuple(self.transfers),
            fast_counter=tuple(self.fast_counter),
            slow_counter=tuple(self.slow_counter),
            fast_peak_bytes=self.ledger.fast_peak_bytes,
            slow_peak_bytes=self.ledger.slow_peak_bytes,
            makespan_us=self.end_us,
            launched_ahead=self.launched_ahead,
        )

    def _loop(self) -> None:
        while True:
            while self._dispatch() | self._start("d2h") | self._start("h2d"):
                pass
            if self._finished():
                return
            idle = self.running_task is None and self.running_collective is None
            if idle and not any(self.running.values()):
                self._deadlock()
            for completion in self.backend.wait():
                self._complete(completion)

    def _finished(self) -> bool:
        return (
            self.next_task == len(self.tasks)
            and self.running_task is None
            and self.running_collective is None
            and not any(self.queues.values())
            and not any(self.running.values())
        )

    # -- starting work -----------------------------------------------------------------
    def _dispatch(self) -> bool:
        """Dispatch the next task if it can start; a collective task that starts lets the
        task after it start at the same instant (docs/execution_model.md)."""
        dispatched = False
        while self._dispatch_next():
            dispatched = True
            if self.running_task is not None:
                break
        return dispatched

    def _dispatch_next(self) -> bool:
        if self.next_task == len(self.tasks):
            return False
        if self.running_task is not None:
            return self._launch_ahead()
        task = self.tasks[self.next_task]
        busy_link = self.running_collective is not None
        if self.checked_task != self.next_task and not busy_link:
            # it is next and nothing before it runs: what can never improve
            self.checked_task = self.next_task
            self._check_next(task)
        if busy_link and (task.collective or self.held.intersection(task.inputs + task.mutates)):
            return False  # the link is taken, or the task uses what is being reduced
        if not self._uses_ready(task):
            return False
        if not self._take_room(self.next_task, 0):
            return False
        index = self.next_task
        self.next_task += 1
        if task.collective:
            self.running_collective = index
            self.held = frozenset(task.uses)
        else:
            self.running_task = index
        self.backend.launch_task(index)
        return True

    def _launch_ahead(self) -> bool:
        """Launch the next task behind the running one, when ``run_ahead`` allows (class
        doc); its dispatch checks hold already (its uses are resident, or come from the
        running task, and its reserve fits now)."""
        if (
            not self.run_ahead
            or self.queued_task is not None
            or self.running_collective is not None
        ):
            return False
        index, ledger = self.next_task, self.ledger
        task, running = self.tasks[index], self.tasks[self.running_task]
        if task.collective:
            return False
        leaving = set(running.releases) | set(running.offloads)
        if leaving.intersection(task.inputs + task.mutates):
            return False
        if not self._uses_ready(task, coming=frozenset(running.outputs)):
            return False
        head = self.queues["h2d"]
        waiting = ledger.size[head[0].obj] if head and self.running["h2d"] is None else 0
        if not self._take_room(index, waiting):
            return False
        self.checked_task, self.next_task = index, index + 1
        self.queued_task = index
        self.launched_ahead += 1
        self.backend.launch_task(index)
        return True

    def _uses_ready(self, task, coming: frozenset[str] = frozenset()) -> bool:
        """Whether every object ``task`` reads or mutates is resident with no offload
        pending, or among ``coming`` (outputs of the task running before it)."""
        ledger = self.ledger
        return all(
            obj in coming
            or (ledger.fast[obj] is Fast.RESIDENT and obj not in ledger.offload_pending)
            for obj in task.inputs + task.mutates
        )

    def _take_room(self, index: int, beside: int) -> bool:
        """Reserve task ``index``'s outputs and workspace and allocate its outputs, when
        they fit with ``beside`` bytes more still free and the backend has their regions."""
        task, ledger = self.tasks[index], self.ledger
        reserve = task.workspace_bytes + sum(ledger.size[obj] for obj in task.outputs)
        if not ledger.fits_fast(reserve + beside):
            return False
        if not self.backend.can_start_task(index):
            return False
        if not all(self.backend.can_alloc_fast(obj) for obj in task.outputs):
            return False
        ledger.reserve_fast(reserve)
        for obj in task.outputs:
            self.backend.alloc_fast(obj)
        self._count_fast()
        return True

    def _check_next(self, task) -> None:
        ledger, budget = self.ledger, self.ledger.fast_budget_bytes
        footprint = task.workspace_bytes + sum(ledger.size[obj] for obj in set(task.uses))
        if budget is not None and footprint > budget:
            self._error(
                FailureKind.FOOTPRINT,
                f"task {task.id!r} needs {footprint} bytes of "
                f"fast memory at once but the budget is {budget}",
                task.id,
                (),
            )
        for obj in task.inputs + task.mutates:
            absent = ledger.fast[obj] is not Fast.RESIDENT or obj in ledger.offload_pending
            if absent and not self.pending_prefetch.get(obj):
                self._fail_never_resident(task.id, obj)

    def _start(self, direction: str) -> bool:
        queue = self.queues[direction]
        if self.running[direction] is not None or not queue:
            return False
        transfer, ledger = queue[0], self.ledger
        obj = transfer.obj
        if direction == "d2h":
            if not ledger.slow_space_ready(obj):  # slow space is never given back: fail now
                self._error(
                    FailureKind.SLOW_BUDGET,
                    f"offload of {obj!r} needs {ledger.size[obj]} bytes of slow memory; "
                    f"{ledger.slow_used_bytes} of the slow budget {ledger.slow_budget_bytes} "
                    "are taken",
                    transfer.by_task,
                    (obj,),
                )
            ledger.ensure_slow_space(obj)
            self._count_slow()
        else:
            if obj in ledger.offload_pending or ledger.slow[obj] is not Slow.CURRENT:
                return False
            if not ledger.fits_fast(ledger.size[obj]):
                return False
            if not self.backend.can_alloc_fast(obj):
                return False
            ledger.reserve_fast(ledger.size[obj])
            ledger.fast[obj] = Fast.INCOMING
            self.backend.alloc_fast(obj)
            self._count_fast()
        queue.popleft()
        self.running[direction] = transfer
        self.backend.launch_transfer(transfer.serial, obj, direction)
        return True

    # -- completions -------------------------------------------------------------------
    def _complete(self, completion: Completion) -> None:
        self.end_us = max(self.end_us, completion.end_us)
        if completion.kind in (OpKind.TASK, OpKind.COLLECTIVE):
            self._complete_task(completion)
            return
        direction = "d2h" if completion.kind is OpKind.D2H else "h2d"
        transfer = self.running[direction]
        assert transfer is not None and transfer.serial == completion.ref
        transfer.start_us, transfer.end_us = completion.start_us, completion.end_us
        self.running[direction] = None
        ledger, obj = self.ledger, transfer.obj
        if direction == "d2h":
            ledger.slow[obj] = Slow.CURRENT
            ledger.offload_pending.discard(obj)
            self._drop(obj)
        else:
            ledger.fast[obj] = Fast.RESIDENT
            self.pending_prefetch[obj] -= 1

    def _complete_task(self, completion: Completion) -> None:
        index = completion.ref
        if index == self.queued_task:  # reported with or before the running task's end
            self.early = completion
            return
        task, ledger = self.tasks[index], self.ledger
        self.task_records.append(TaskRecord(index, task.id, completion.start_us, completion.end_us))
        if completion.kind is OpKind.COLLECTIVE:
            self.running_collective, self.held = None, frozenset()
        else:
            self.running_task, self.queued_task = self.queued_task, None
        ledger.free_fast(task.workspace_bytes)
        for obj in task.outputs:
            ledger.fast[obj] = Fast.RESIDENT
            ledger.slow[obj] = Slow.ABSENT if obj not in ledger.slow_space else Slow.STALE
            self.dropped_by.pop(obj, None)
        for obj in task.mutates:
            ledger.make_dirty(obj)
        self._fire(task)
        self._count_fast()
        if self.early is not None and self.early.ref == self.running_task:
            early, self.early = self.early, None
            self._complete_task(early)

    def _fire(self, task) -> None:
        """A task's (or the prologue's) directives: releases, offloads, then prefetches."""
        ledger = self.ledger
        for obj in task.releases:
            self._require_resident(task.id, FailureKind.RELEASE_NOT_RESIDENT, "release", obj)
            if not ledger.is_clean(obj):
                self.dropped_by[obj] = task.id
            self._drop(obj)
        for obj in task.offloads:
            self._require_resident(task.id, FailureKind.OFFLOAD_NOT_RESIDENT, "offload", obj)
            if ledger.is_clean(obj):
                self._drop(obj)
            else:
                ledger.offload_pending.add(obj)
                self._enqueue(task.id, obj, "d2h")
        for obj in task.prefetches:
            self._check_prefetch(task.id, obj)
            self.pending_prefetch[obj] = self.pending_prefetch.get(obj, 0) + 1
            self._enqueue(task.id, obj, "h2d")

    def _check_prefetch(self, task_id: str, obj: str) -> None:
        ledger, budget = self.ledger, self.ledger.fast_budget_bytes
        leaving = obj in ledger.offload_pending
        if self.pending_prefetch.get(obj) or (ledger.fast[obj] is Fast.RESIDENT and not leaving):
            self._error(
                FailureKind.PREFETCH_RESIDENT,
                f"task {task_id!r} prefetches {obj!r}, "
                "which is already in fast memory or on its way",
                task_id,
                (obj,),
            )
        if ledger.slow[obj] is not Slow.CURRENT and not leaving:
            self._error(
                FailureKind.PREFETCH_NO_SLOW_COPY,
                f"task {task_id!r} prefetches {obj!r}, which has no current slow copy to read",
                task_id,
                (obj,),
            )
        if budget is not None and ledger.size[obj] > budget:
            self._error(
                FailureKind.TRANSFER_TOO_LARGE,
                f"task {task_id!r} prefetches {obj!r} "
                f"({ledger.size[obj]} bytes), larger than the fast budget {budget}",
                task_id,
                (obj,),
            )

    def _enqueue(self, task_id: str, obj: str, direction: str) -> None:
        transfer = TransferRecord(
            len(self.transfers),
            obj,
            direction,
            self.ledger.size[obj],
            task_id,
            self.backend.now_us(),
        )
        self.transfers.append(transfer)
        self.queues[direction].append(transfer)

    def _drop(self, obj: str) -> None:
        self.ledger.drop_fast(obj)
        self.backend.free_fast(obj)
        self._count_fast()

    # -- counters ----------------------------------------------------------------------
    def _count_fast(self) -> None:
        self._count(self.fast_counter, self.ledger.fast_used_bytes)

    def _count_slow(self) -> None:
        self._count(self.slow_counter, self.ledger.slow_used_bytes)

    def _count(self, counter: list[tuple[float, int]], value: int) -> None:
        now = self.backend.now_us()
        if counter[-1][0] == now:
            counter[-1] = (now, value)
        elif counter[-1][1] != value:
            counter.append((now, value))

    # -- failures ----------------------------------------------------------------------
    def _error(self, kind: FailureKind, message: str, task: str | None, objects: tuple[str, ...]):
        ledger = self.ledger
        raise EngineRunError(
            kind,
            message,
            task=task,
            objects=objects,
            fast_used_bytes=ledger.fast_used_bytes,
            resident=tuple(ledger.resident_objects()),
        )

    def _check_start(self) -> None:
        ledger = self.ledger
        for memory, used, budget in (
            ("fast", ledger.fast_used_bytes, ledger.fast_budget_bytes),
            ("slow", ledger.slow_used_bytes, ledger.slow_budget_bytes),
        ):
            if budget is not None and used > budget:
                self._error(
                    FailureKind.INITIAL_OVERFLOW,
                    f"the objects that start in {memory} "
                    f"memory take {used} bytes, more than its budget {budget}",
                    None,
                    (),
                )

    def _require_resident(self, task_id: str, kind: FailureKind, directive: str, obj: str) -> None:
        ledger = self.ledger
        if obj in self.held:
            self._error(
                kind,
                f"task {task_id!r} {directive}s {obj!r}, which the collective task "
                f"{self.tasks[self.running_collective].id!r} is still reducing",
                task_id,
                (obj,),
            )
        if ledger.fast[obj] is not Fast.RESIDENT:
            self._error(
                kind,
                f"task {task_id!r} {directive}s {obj!r}, which is not resident",
                task_id,
                (obj,),
            )
        if obj in ledger.offload_pending:
            self._error(
                kind,
                f"task {task_id!r} {directive}s {obj!r}, which has an offload pending",
                task_id,
                (obj,),
            )

    def _fail_never_resident(self, task_id: str, obj: str) -> None:
        if obj in self.dropped_by:
            self._error(
                FailureKind.LOST,
                f"task {task_id!r} needs {obj!r}, but task "
                f"{self.dropped_by[obj]!r} released it while dirty, losing its value",
                task_id,
                (obj,),
            )
        if self.ledger.fast[obj] is Fast.RESIDENT:
            why = "it is being offloaded and nothing prefetches it back"
        else:
            why = "it is not in fast memory and nothing prefetches it"
        self._error(
            FailureKind.NOT_RESIDENT, f"task {task_id!r} needs {obj!r}, but {why}", task_id, (obj,)
        )

    def _deadlock(self) -> None:
        ledger = self.ledger
        if self.next_task < len(self.tasks):
            task = self.tasks[self.next_task]
            waits = tuple(
                obj
                for obj in task.inputs + task.mutates
                if ledger.fast[obj] is not Fast.RESIDENT or obj in ledger.offload_pending
            )
            blocked = task.id
            message = (
                f"task {task.id!r} cannot start: waiting for "
                f"{', '.join(waits) if waits else 'room for its outputs and workspace'}"
            )
        else:
            blocked, waits = None, ()
            message = "all tasks ran but queued transfers can never start"
        heads = [f"{d} head: {q[0].obj!r}" for d, q in self.queues.items() if q]
        if heads:
            message += f"; {'; '.join(heads)}"
        self._error(FailureKind.DEADLOCK, message, blocked, waits)

    def _check_final_locations(self) -> None:
        ledger = self.ledger
        wrong = []
        for obj, location in self.program.final_locations.items():
            if location is Location.FAST and ledger.fast[obj] is not Fast.RESIDENT:
                wrong.append(f"{obj!r} should end in fast memory but is not resident")
            if location is Location.SLOW and ledger.slow[obj] is not Slow.CURRENT:
                wrong.append(f"{obj!r} should end in slow memory but has no current slow copy")
        if wrong:
            self._error(
                FailureKind.FINAL_LOCATION,
                "final locations do not hold: " + "; ".join(wrong),
                None,
                tuple(self.program.final_locations),
            )
