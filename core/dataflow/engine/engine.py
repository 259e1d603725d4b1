"""``Engine``: load a planned program with a resolver and initial values, run it, read back.

engine = Engine("torch", budget_bytes=plan_budget, device="cpu")
engine.load(plan, resolver, initial={"W_0": w0, ...})
result = engine.run(steps=3)
w0_after = engine.fetch("W_0")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dataflow.engine.contract import Resolver, resolve_all
from dataflow.engine.dispatcher import Dispatcher, DispatchTrace, EngineRunError
from dataflow.engine.ledger import Fast, Ledger, Slow
from dataflow.engine.result import RunResult
from dataflow.extras import require_torch
from dataflow.schema import Program, validate

BACKENDS = ("virtual", "torch")


class BudgetBreachError(RuntimeError):
    """The device allocator's own peak went over the budget: the plan's memory was not
    honest (undeclared kernel workspace, say)."""


class EngineLoadError(ValueError):
    """``Engine.load`` refused a program: names the object, task or field at fault."""


class Engine:
    """Runs one loaded program, step after step.

    ``backend`` is ``virtual`` (no data, virtual clock) or ``torch`` (with ``device``
    ``cpu`` or ``cuda``). ``budget_bytes`` is the fast-memory budget the run must stay in.
    """

    def __init__(
        self,
        backend: str = "torch",
        budget_bytes: int | None = None,
        slow_budget_bytes: int | None = None,
        *,
        device: str = "cpu",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown engine backend {backend!r}; known: {', '.join(BACKENDS)}")
        if backend == "torch":
            require_torch("the engine's torch backend")
        self.backend_name, self.device = backend, device
        self.budget_bytes, self.slow_budget_bytes = budget_bytes, slow_budget_bytes
        self.program: Program | None = None
        self.predicted = None
        self._backend: Any = None
        self._ledger: Ledger | None = None
        self._allocator_base = 0
        #: steps run since load; the next run's first step has this index
        self.steps_done = 0

    # -- load --------------------------------------------------------------------------
    def load(
        self,
        plan: Any,
        resolver: Resolver | None = None,
        *,
        initial: Mapping[str, Any] | None = None,
        resolver_name: str = "resolver",
        placement: Any = None,
    ) -> None:
        """Load ``plan`` (a ``Plan`` from ``dataflow.planning.plan`` or an annotated
        ``Program``). Every task is resolved now: an unknown compute key fails here, naming
        the task and the resolver. ``initial`` gives a tensor for every object that exists at
        start (torch backend)."""
        if placement is not None:
            plan = placement.plan  # place() may have re-planned at a smaller capacity
        program = plan.program if hasattr(plan, "program") else plan
        self.predicted = getattr(plan, "sim", None)
        problems = validate(program)
        if problems:
            listing = "\n".join(f"  - {problem.message}" for problem in problems)
            raise EngineLoadError(f"program {program.name!r} is not valid:\n{listing}")
        self.program = program
        if program.budget is not None:
            if self.budget_bytes is None:
                self.budget_bytes = program.budget.fast_bytes
            if self.slow_budget_bytes is None:
                self.slow_budget_bytes = program.budget.slow_bytes
        if self.backend_name == "virtual":
            from dataflow.engine.backends.virtual import VirtualBackend

            self._backend = VirtualBackend(program)
            return
        if resolver is None:
            raise EngineLoadError("the torch backend needs a resolver to run tasks")
        executables = resolve_all(program.tasks, resolver, resolver_name)
        self._allocator_base = _allocator_reset(self.device)
        self._backend = _torch_backend(program, executables, self.device, placement)
        self._put_initial(program, dict(initial or {}))

    def _put_initial(self, program: Program, initial: dict[str, Any]) -> None:
        at_start = [obj.id for obj in program.objects if program.exists_at_start(obj.id)]
        missing = [obj for obj in at_start if obj not in initial]
        unknown = [obj for obj in initial if obj not in at_start]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"no initial value for {', '.join(map(repr, missing))}")
            if unknown:
                parts.append(
                    f"initial values for objects that do not exist at start: "
                    f"{', '.join(map(repr, unknown))}"
                )
            raise EngineLoadError("; ".join(parts))
        for obj in at_start:
            self._backend.put_initial(obj, initial[obj])

    # -- run ---------------------------------------------------------------------------
    def run(
        self,
        steps: int = 1,
        *,
        values: Mapping[str, Any] | None = None,
        feed: Callable[[int], Mapping[str, Any]] | None = None,
    ) -> RunResult:
        """Run the program ``steps`` more times; steps count on across calls (``values``
        gets ``step``, the global step index). Before every step but the first, each object
        that exists at start is put back where it starts: from where the last step left it,
        or from ``feed(step)`` (a mapping of fresh values, e.g. the next batch)."""
        if self.program is None:
            raise RuntimeError("Engine.run before Engine.load")
        traces: list[DispatchTrace] = []
        launch_host_us: list[tuple[float, ...]] = []
        for _ in range(steps):
            step = self.steps_done
            if step:
                self._carry_over(step, dict(feed(step)) if feed else {})
            traces.append(self._run_step(dict(values or {}, step=step)))
            self.steps_done += 1
            runner = getattr(self._backend, "runner", None)
            launch_host_us.append(tuple(runner.launch_host_us) if runner is not None else ())
        result = RunResult.from_traces(
            self.program,
            self.backend_name,
            traces,
            self.budget_bytes,
            predicted=self.predicted,
            allocator_peak_bytes=self._allocator_peak(),
            launch_host_us=tuple(launch_host_us),
        )
        peak, budget = result.allocator_peak_bytes, self.budget_bytes
        if peak is not None and budget is not None and peak > budget:
            raise BudgetBreachError(
                f"the CUDA allocator's peak during load and run was {peak} bytes, over the "
                f"budget of {budget} bytes (ledger peak {result.fast_peak_bytes}): some kernel "
                "allocated memory its task did not declare as workspace_bytes"
            )
        return result

    def _run_step(self, values: dict[str, Any]) -> DispatchTrace:
        backend = self._backend
        if hasattr(backend, "start_run"):
            backend.start_run(values)
        dispatcher = Dispatcher(self.program, backend, self.budget_bytes, self.slow_budget_bytes)
        self._ledger = dispatcher.ledger
        return dispatcher.run()

    def _carry_over(self, step: int, fed: Mapping[str, Any]) -> None:
        if self.backend_name == "virtual":
            self._backend.clock_us = 0.0
            return
        backend, program = self._backend, self.program
        values = {}
        for obj in program.objects:
            if not program.exists_at_start(obj.id):
                continue
            if obj.id in fed:
                values[obj.id] = fed[obj.id]
                continue
            value = self._current_value(obj.id)
            if value is None:
                raise EngineRunError(
                    "error",
                    f"step {step}: object {obj.id!r} exists at start but step "
                    f"{step - 1} left no value of it; give one through feed",
                    task=None,
                    objects=(obj.id,),
                    fast_used_bytes=-1,
                    resident=(),
                )
            values[obj.id] = value.clone()
        backend.reset_fast()
        for obj_id, value in values.items():
            backend.put_initial(obj_id, value)

    def close(self) -> None:
        """Release the backend's workers; the engine cannot run again after this."""
        runner = getattr(self._backend, "runner", None)
        if runner is not None:
            runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- read back ---------------------------------------------------------------------
    def _current_value(self, obj: str):
        """Where the object's latest value is: by the last run's ledger, or (before any run)
        where it starts."""
        backend, ledger = self._backend, self._ledger
        if ledger is None:
            value = backend.fast_value(obj)
            return value if value is not None else backend.slow_value(obj)
        if ledger.fast[obj] is Fast.RESIDENT:
            return backend.fast_value(obj)
        if ledger.slow[obj] is Slow.CURRENT:
            return backend.slow_value(obj)
        return None

    def fetch(self, obj: str):
        """A copy (on CPU) of an object's current value after the last run."""
        if self.backend_name == "virtual":
            raise RuntimeError("the virtual backend holds no data; fetch needs backend 'torch'")
        if self.program is None or obj not in self.program.objects_by_id:
            raise KeyError(f"no object {obj!r} in the loaded program")
        value = self._current_value(obj)
        if value is None:
            raise KeyError(
                f"object {obj!r} has no value after the run: it was dropped "
                "(released, or never created)"
            )
        return value.detach().to("cpu", copy=True)

    def _allocator_peak(self) -> int | None:
        """The device allocator's peak since load, less what was allocated before it."""
        if self.backend_name != "torch" or not self.device.startswith("cuda"):
            return None
        import torch

        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device)) - self._allocator_base


def _allocator_reset(device: str) -> int:
    """On CUDA: reset the allocator's peak and return the bytes allocated before the load."""
    if not device.startswith("cuda"):
        return 0
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def _torch_backend(program: Program, executables, device: str, placement: Any):
    import torch

    from dataflow.engine.backends.torch_backend import TorchBackend

    dev = torch.device(device)
    if dev.type == "cuda":
        from dataflow.engine.backends.torch_cuda import CudaRunner

        runner = CudaRunner(dev)
    else:
        from dataflow.engine.backends.torch_cpu import CpuRunner

        runner = CpuRunner()
    layout = {} if placement is None else _placement_layout(placement)
    return TorchBackend(program, executables, dev, runner, **layout)


def _last_occupants(blocks: list[Any]) -> list[tuple[Any, list[Any]]]:
    """For each block (in start order), the blocks that last held some of its bytes.

    In a valid placement the blocks holding one address follow each other in time, and
    each may begin only once its own last occupants ended, so waiting for the last
    occupants of every byte is waiting for every earlier overlapping block: one sweep over
    an address map instead of comparing all pairs.
    """
    segments: list[tuple[int, int, Any]] = []  # (start, end, owner), sorted, disjoint
    result = []
    for block in blocks:
        lo, hi = block.offset_bytes, block.end_bytes
        kept, before = [], []
        for start, end, owner in segments:
            if end <= lo or start >= hi:
                kept.append((start, end, owner))
                continue
            if owner not in before:
                before.append(owner)
            if start < lo:
                kept.append((start, lo, owner))
            if end > hi:
                kept.append((hi, end, owner))
        kept.append((lo, hi, block))
        kept.sort(key=lambda segment: segment[0])
        segments = kept
        result.append((block, before))
    return result


def workspace_key(task_id: str) -> str:
    return f"workspace:{task_id}"


def _placement_layout(placement: Any) -> dict[str, Any]:
    """Arena size, offsets by (object, occurrence) and the region rule from a Placement.

    The k-th time an object becomes resident it takes its k-th block (blocks in time
    order); a task's workspace is its own block (key ``("workspace:<task>", 0)``), handed
    to the executable as ``ctx.workspace``. A block may begin only once every earlier block
    that overlaps it in the arena has ended.
    """
    by_obj: dict[str, list[Any]] = {}
    # ``start``/``end`` order blocks by the run's events, exactly, also within one instant.
    blocks = sorted(
        placement.blocks, key=lambda b: (b.start, b.end, b.obj_id or "", b.task_id or "")
    )
    keys = {}
    for block in blocks:
        if block.obj_id is None:
            keys[id(block)] = (workspace_key(block.task_id), 0)
            continue
        occurrences = by_obj.setdefault(block.obj_id, [])
        keys[id(block)] = (block.obj_id, len(occurrences))
        occurrences.append(block)
    predecessors = {
        keys[id(block)]: tuple(keys[id(other)] for other in before)
        for block, before in _last_occupants(blocks)
    }

    def offset_of(obj: str, occurrence: int) -> int:
        try:
            return by_obj[obj][occurrence].offset_bytes
        except (KeyError, IndexError):
            raise EngineLoadError(
                f"the placement has no block for residency {occurrence} of {obj!r}: it was "
                "made for another plan"
            ) from None

    return {
        "arena_bytes": placement.arena_bytes,
        "offset_of": offset_of,
        "predecessors": predecessors,
        "workspace_offsets": None
        if getattr(placement, "workspace_outside_bytes", 0)
        else {b.task_id: b.offset_bytes for b in placement.blocks if b.task_id is not None},
    }
