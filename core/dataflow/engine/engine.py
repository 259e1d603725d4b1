"""``Engine``: load a planned program with a resolver and initial values, run it, read back.

engine = Engine("torch", budget_bytes=plan_budget, device="cpu")
engine.load(place(plan), resolver, initial={"W_0": w0, ...})
result = engine.run(steps=3)
w0_after = engine.fetch("W_0")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from dataflow.engine.contract import Resolver, resolve_all
from dataflow.engine.dispatcher import Dispatcher, DispatchTrace, EngineRunError
from dataflow.engine.ledger import Fast, Ledger, Slow
from dataflow.engine.result import RunResult
from dataflow.extras import require_torch
from dataflow.planning import Placement, Plan
from dataflow.schema import Location, Program, validate

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

    With ``graph`` (CUDA, a placed plan) the first step is dispatched as usual, the second
    is captured into a CUDA graph, and it and every later step are replays of it
    (``torch_graph``); when the step cannot be captured the engine goes on dispatching and
    ``graph_note`` says why, in one line. ``device_values`` hands per-step numeric values
    to executables as 0-d float32 device tensors; by default that is so on CUDA when every
    executable declares ``capturable = True`` (such executables take values either way),
    so a dispatched step and a replayed one compute with the same values, bit for bit.

    ``run_ahead`` (default on): a dispatched step launches a task behind the running one
    when that cannot change what it reads or writes (``Dispatcher``), so the host's launch
    hides behind the device's work; off, every task waits on the host for the one before.
    """

    def __init__(
        self,
        backend: str = "torch",
        budget_bytes: int | None = None,
        slow_budget_bytes: int | None = None,
        *,
        device: str = "cpu",
        graph: bool = False,
        device_values: bool | None = None,
        run_ahead: bool = True,
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
        self.graph_wanted = graph
        self.device_values = device_values
        self.run_ahead = run_ahead
        #: why steps are not replayed from a CUDA graph (None while they are, or may be)
        self.graph_note: str | None = None
        self._graph: Any = None
        #: small memset nodes of the captured step turned into fill-kernel nodes
        #: (``backends.graph_memsets``)
        self.memsets_replaced = 0
        self._graph_trace: DispatchTrace | None = None
        self._values: Any = None
        #: why the loaded program's executables cannot be captured (None: they can)
        self._not_capturable: str | None = None
        #: seconds ``load`` spent in each phase (torch backend): ``resolve`` (every task's
        #: executable), ``storage`` (the fast arena and the slow pool, page-locked on
        #: CUDA), ``start values`` (copied in)
        self.load_seconds: dict[str, float] = {}

    # -- load --------------------------------------------------------------------------
    def load(
        self,
        source: Placement | Plan | Program,
        resolver: Resolver | None = None,
        *,
        initial: Mapping[str, Any] | None = None,
        resolver_name: str = "resolver",
    ) -> None:
        """Load what runs: a ``Placement`` (``dataflow.planning.place``: its plan, each
        object at its packed offset in one arena; what CUDA graphs need), a ``Plan``
        (objects allocated one by one) or an annotated ``Program``. ``resolver`` turns its
        tasks into executables; every task is resolved now: an unknown compute key fails
        here, naming the task and the resolver. ``initial`` gives a tensor for every object
        that exists at start (torch backend)."""
        placement = source if isinstance(source, Placement) else None
        plan = source.plan if isinstance(source, Placement) else source
        program = plan.program if isinstance(plan, Plan) else plan
        self.predicted = plan.sim if isinstance(plan, Plan) else None
        problems = validate(program)
        if problems:
            listing = "\n".join(f"  - {problem.message}" for problem in problems)
            raise EngineLoadError(f"program {program.name!r} is not valid:\n{listing}")
        self.program = program
        #: the objects that exist at start, in program order (every step puts them back)
        self._at_start = tuple(obj for obj in program.objects if program.exists_at_start(obj.id))
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
        began = time.perf_counter()
        executables = resolve_all(program.tasks, resolver, resolver_name)
        from dataflow.engine.backends.torch_graph import not_capturable

        self._not_capturable = not_capturable(program, executables)  # once, not every step
        resolved = time.perf_counter()
        self._allocator_base = _allocator_reset(self.device)
        self._backend = _torch_backend(program, executables, self.device, placement)
        stored = time.perf_counter()
        self._put_initial(program, {} if initial is None else initial)
        self.load_seconds = {
            "resolve": resolved - began,
            "storage": stored - resolved,
            "start values": time.perf_counter() - stored,
        }

    def _put_initial(self, program: Program, initial: Mapping[str, Any]) -> None:
        """Each start value copied in as it is looked up (once per object), so a lazy
        mapping never holds every value at once."""
        at_start = [obj.id for obj in self._at_start]
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
        dispatch: bool = False,
    ) -> RunResult:
        """Run the program ``steps`` more times; steps count on across calls (``values``
        gets ``step``, the global step index). Before every step but the first, each object
        that exists at start is put back where it starts: from where the last step left it,
        or from ``feed(step)`` (a mapping of fresh values, e.g. the next batch).
        ``dispatch`` runs these steps task by task even where a captured CUDA graph would
        replay them (a replayed step has no per-task spans), and captures none."""
        if self.program is None:
            raise RuntimeError("Engine.run before Engine.load")
        traces: list[DispatchTrace] = []
        launch_host_us: list[tuple[float, ...]] = []
        for _ in range(steps):
            step = self.steps_done
            if step:
                self._carry_over(step, dict(feed(step)) if feed else {})
            step_values = dict(values or {}, step=step)
            if self._graph is None and step and not dispatch and self._may_capture(step_values):
                self._capture(self._device_values(step_values))
            if self._graph is not None and not dispatch:
                traces.append(self._replay(step_values))
                launch_host_us.append(())
            else:
                traces.append(self._run_step(self._device_values(step_values)))
                runner = getattr(self._backend, "runner", None)
                launch_host_us.append(tuple(runner.launch_host_us) if runner is not None else ())
            self.steps_done += 1
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

    # -- CUDA graphs -------------------------------------------------------------------
    def _may_capture(self, values: Mapping[str, Any]) -> bool:
        """Whether to capture this step; sets ``graph_note`` (once) when it will not."""
        if not self.graph_wanted or self.graph_note is not None:
            return False
        from dataflow.engine.backends.torch_graph import DeviceValues

        reason = None
        if self.backend_name != "torch" or not self.device.startswith("cuda"):
            reason = "CUDA graphs need the torch backend on a CUDA device"
        elif self._backend.fast.arena is None:
            reason = "CUDA graphs need a placed plan (Engine.load(placement, ...))"
        else:
            reason = DeviceValues.unsupported(values) or self._not_capturable
        if reason is not None:
            self._graph_off(reason)
            return False
        return True

    def _graph_off(self, reason: str) -> None:
        import warnings

        self.graph_note = f"steps are dispatched, not replayed from a CUDA graph: {reason}"
        warnings.warn(f"dataflow engine: {self.graph_note}", RuntimeWarning, stacklevel=3)

    def _device_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` as executables see them: device tensors with ``device_values``."""
        if self.device_values is False or self.backend_name != "torch":
            return values
        if not self.device.startswith("cuda"):
            return values
        from dataflow.engine.backends.torch_graph import DeviceValues

        if self.device_values is None and self._not_capturable is not None:
            return values
        if DeviceValues.unsupported(values) is not None:
            return values
        if self._values is None or (self._graph is None and set(self._values.names) != set(values)):
            import torch

            self._values = DeviceValues(sorted(values), torch.device(self.device))
        return self._values.update(values, self._backend.runner.compute_stream)

    def _capture(self, values: dict[str, Any]) -> None:
        """Capture one step into a CUDA graph; nothing runs until it is replayed. On any
        failure the engine goes on dispatching and says why (``graph_note``)."""
        import torch

        from dataflow.engine.backends.graph_memsets import memsets_to_kernels
        from dataflow.engine.backends.torch_graph import GraphCapture

        backend = self._backend
        backend.settle()
        runner = backend.runner
        capture = GraphCapture(self.program, runner.streams)
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # edited before it is instantiated
        torch.cuda.synchronize(self.device)
        backup = backend.snapshot()
        backend.runner = capture
        try:
            backend.start_run(values)
            dispatcher = Dispatcher(
                self.program, backend, self.budget_bytes, self.slow_budget_bytes
            )
            failure: Exception | None = None
            try:
                with torch.cuda.graph(graph, stream=capture.compute_stream):
                    capture.fork()
                    try:
                        trace = dispatcher.run()
                    except Exception as exc:  # end the capture cleanly, then report it
                        failure = exc
                    capture.join()  # the copy streams rejoin; the capture ends where it began
            except Exception:
                # ending a capture that a task broke fails too ("operation failed due to a
                # previous error during capture"): the task's error is the one to report
                if failure is None:
                    raise
            if failure is not None:
                raise failure
            self.memsets_replaced = memsets_to_kernels(graph.raw_cuda_graph())
            graph.instantiate()
        except Exception as exc:  # anything the capture refuses: dispatch instead
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a broken capture may have left an error
                pass
            _end_generator_capture(self.device)
            backend.restore(backup)
            what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._graph_off(f"capture failed: {what}")
            return
        finally:
            backend.runner = runner
            runner.forget_stream()
        self._graph, self._graph_trace = graph, trace
        self._ledger = dispatcher.ledger
        self._graph_end = backend.snapshot()  # where a replayed step leaves every object

    def replay_activity(self, values: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Run one more step, replayed from the captured graph under torch.profiler, and
        return what each stream did (``torch_graph.stream_activity``: busy microseconds of
        the compute stream and of each copy direction, and the span of the step). The
        step is a real one (it changes what the program mutates); the next step of
        ``run`` continues after it. Needs a captured graph (run two steps first)."""
        if self._graph is None:
            raise RuntimeError(
                "replay_activity needs a step captured into a CUDA graph: "
                f"{self.graph_note or 'run at least two steps with Engine(graph=True)'}"
            )
        from dataflow.engine.backends.torch_graph import stream_activity

        step = self.steps_done
        self._carry_over(step, {})
        step_values = dict(values or {}, step=step)
        activity = stream_activity(lambda: self._replay(step_values))
        self.steps_done += 1
        return activity

    def _replay(self, values: dict[str, Any]) -> DispatchTrace:
        """One step: the captured graph replayed, timed by events around it."""
        import torch

        runner = self._backend.runner
        self._backend.settle()  # the graph's copies read the slow pool without asking
        self._device_values(values)
        stream = runner.compute_stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            self._graph.replay()
            end.record(stream)
        end.synchronize()
        self._backend.restore(self._graph_end)
        trace = self._graph_trace
        return attrs.evolve(
            trace, tasks=(), transfers=(), makespan_us=start.elapsed_time(end) * 1e3, replayed=True
        )

    def _run_step(self, values: dict[str, Any]) -> DispatchTrace:
        backend = self._backend
        if hasattr(backend, "start_run"):
            backend.start_run(values)
        dispatcher = Dispatcher(
            self.program,
            backend,
            self.budget_bytes,
            self.slow_budget_bytes,
            run_ahead=self.run_ahead,
        )
        self._ledger = dispatcher.ledger
        try:
            return dispatcher.run()
        finally:  # fed values still arriving in the slow pool (none the step read)
            backend.settle()

    def _carry_over(self, step: int, fed: Mapping[str, Any]) -> None:
        """Put every object that exists at start where it starts, for step ``step``.

        A fed value is written to its start location. Any other value stays where the last
        step left it when that is where it starts (a persistent object homed fast, still
        resident at the same address; one homed slow, its slow copy current): nothing
        moves. Otherwise it is copied to its start location (a backed object's fast copy
        only, when its slow copy is current: ``Program.backed_ids``)."""
        if self.backend_name == "virtual":
            self._backend.clock_us = 0.0
            return
        backend, ledger = self._backend, self._ledger
        kept: list[str] = []
        moved: dict[str, Any] = {}
        backed_current: set[str] = set()  # backed objects whose slow copy is current
        for obj in self._at_start:  # not every object: a step has thousands
            if obj.id in fed:
                moved[obj.id] = fed[obj.id]
                continue
            resident = ledger is not None and ledger.fast[obj.id] is Fast.RESIDENT
            current = ledger is not None and ledger.slow[obj.id] is Slow.CURRENT
            if obj.location is Location.FAST and resident and backend.at_start_address(obj.id):
                kept.append(obj.id)
            elif obj.location is Location.SLOW and current:
                continue  # already in its slow slice
            elif resident or current:
                moved[obj.id] = self._current_value(obj.id).clone()
                if current and obj.id in self.program.backed_ids:
                    backed_current.add(obj.id)
            else:
                raise EngineRunError(
                    "error",
                    f"step {step}: object {obj.id!r} exists at start but step "
                    f"{step - 1} left no value of it; give one through feed",
                    task=None,
                    objects=(obj.id,),
                    fast_used_bytes=-1,
                    resident=(),
                )
        backend.reset_fast(keep=kept)
        for obj_id, value in moved.items():
            backend.put_initial(obj_id, value, per_step=True, fast_only=obj_id in backed_current)

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

    def read_scalar(self, obj: str) -> float:
        """The value of a one-element object after the last run, as a Python float: what
        ``float(fetch(obj))`` gives, without building a copy."""
        return self.read_scalars([obj])[0]

    def read_scalars(self, objs: Sequence[str]) -> list[float]:
        """``read_scalar`` of each of ``objs``, in order, the values of each device (and
        dtype) copied to the host together: a training step reads its losses, one per
        round, and its gradient norms this way every step."""
        known = self.program is not None and self.backend_name != "virtual"
        values = [
            self._current_value(o) if known and o in self.program.objects_by_id else None
            for o in objs
        ]
        if any(v is None for v in values):
            return [float(self.fetch(o)) for o in objs]  # one missing raises, saying why
        import torch

        found: dict[int, float] = {}
        groups: dict[tuple, list[int]] = {}  # torch.cat joins one device's one dtype
        for i, value in enumerate(values):
            groups.setdefault((value.device, value.dtype), []).append(i)
        for indices in groups.values():
            joined = torch.cat([values[i].reshape(1) for i in indices]).cpu()
            found.update(zip(indices, joined.tolist(), strict=True))
        return [found[i] for i in range(len(objs))]

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


def _end_generator_capture(device: Any) -> None:
    """Leave torch's CUDA random generators out of capture mode after a failed capture.

    A capture that an operation invalidated (a host sync, say) fails in its own end, before
    torch ends its generators' capture: they stay in capture mode, and the process's next
    random draw on the device outside a capture raises "Offset increment outside graph
    capture encountered unexpectedly" (H100, session 31: ``dataflow verify`` drew its next
    level's batch after a step whose capture failed). An empty capture begins and ends the
    generators' capture again. Nothing here raises: it may find nothing to mend."""
    import torch

    try:
        with torch.cuda.device(device):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream()):
                pass
    except Exception:  # noqa: BLE001 - best effort: the engine dispatches either way
        pass
