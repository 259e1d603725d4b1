"""The profiling pass: measure each distinct task once on the device, then price the
program with what was measured.

A task's **signature** is its compute key, its parameters other than where it sits in the
chain (layer, round, step) and the sizes of what it reads, changes and creates: the
twelve forward tasks of a 12-block model share one. For each signature the executable
runs on freshly filled buffers (random floats, token 0, packed objects filled through
their layouts, and a block's recorded decisions, ``AuxTemp``, as its forward task makes
them; see ``_decided``): once to warm up, on CUDA back to back for ``SETTLE_S`` seconds
(a task timed right after the device idled runs at clocks a loaded step does not keep),
then ``repeats`` times timed with the device's events (CUDA) or the host clock (CPU). On CUDA the allocator's peak above what was allocated
before the launch is the task's **workspace**: the temporaries its kernels take from the
framework allocator, which the plan must leave room for.

With ``graph`` (CUDA, the step will be replayed from a CUDA graph) a capturable task is
captured once into a graph of its own and the replays are timed: the device's time alone,
as in a replayed step, where no host launch gap shows. Otherwise each timed launch
includes whatever the host adds while it enqueues the task's kernels, as in a dispatched
step. A task that declares itself capturable but whose capture fails (an op that reads a
device tensor on the host) keeps its dispatched timing: the engine's capture of the step
fails the same way and it dispatches.

**The disk cache** (``ProfileCache``): a measurement is kept in one small JSON file per
signature under ``default_cache_dir()`` (``$DATAFLOW_PROFILE_CACHE``, else
``$XDG_CACHE_HOME/dataflow/profiles``, else ``~/.cache/dataflow/profiles``; ``off`` turns
the cache off), keyed by the signature, the kernel set (the resolver and the kernel
variant every op resolves to, with its distribution's version), the device (its name,
compute capability, torch and CUDA versions), ``PROFILE_VERSION`` (the version of this
measuring method) and the **code** that runs the tasks (``code_fingerprint``: a hash of
the Python source of the training plugin, the resolver's package, every chosen kernel
variant's package and the family's package), so that an edited kernel or family is
measured again rather than priced by what its older code took. Any of them changing is a
miss; an unreadable file is a miss and is written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import attrs
import torch

from dataflow import (
    LaunchContext,
    Link,
    Links,
    Program,
    Task,
    kernels,
    memsets_to_kernels,
    resolvers,
    typed_view,
)
from dataflow_training.step.family import embed_layer
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import Lowered

#: The version of the measuring method (fills, warm-up, timing); part of every cache key.
PROFILE_VERSION = 6  # 2: the token shape joined the signature; 3: AuxTemp as forward
# decides; 4: the task settles (SETTLE_S) before it is timed; 5: small memsets of the
# task's graph become fill kernels, as in the engine's captured step; 6: a replayed
# task's workspace is the larger of its dispatched launches' and its capture's
#: The version of the CPU's measuring method, in the key of a CPU's entries only (the
#: GPU profiles archived in benchmarks/results stay valid): 1: on a worker thread, once
#: settled, for at least HOST_TIMED_S, with the links kept beside the profiles
HOST_METHOD_VERSION = 1
#: How long (seconds) a task runs back to back before its timed launches on CUDA (see
#: ``profile_program``): benchmarks/profile_method.py measured what it changes.
SETTLE_S = 0.2
#: A CPU task is timed until its launches took this long (seconds), at least ``repeats``
#: and at most ``HOST_MAX_REPEATS`` launches (``_host_timed_us``).
HOST_TIMED_S = 0.005
HOST_MAX_REPEATS = 25
#: Before its timed launches a CPU task runs until two launches in a row are within this
#: factor of each other (give or take ``HOST_SETTLED_SLACK_US``, the host clock's and
#: Python's jitter), at most ``HOST_SETTLE_LAUNCHES`` times after its warm-up.
HOST_SETTLED = 1.25
HOST_SETTLED_SLACK_US = 200.0
HOST_SETTLE_LAUNCHES = 6
#: Whether the L2 cache is overwritten before each timed launch on CUDA.
FLUSH_L2 = False
#: Names the cache directory (``off``: no disk cache).
CACHE_ENV = "DATAFLOW_PROFILE_CACHE"
#: Workspace is rounded up to the allocator's block size (kMinBlockSize, 512 bytes).
ROUND_BYTES = 512
_POSITION = ("layer", "round", "step")
_DIRS = ("h2d", "d2h")


@attrs.frozen
class TaskProfile:
    cost_us: float
    workspace_bytes: int


def signature(step: Lowered, task: Task) -> tuple:
    """What a task's cost depends on: its kernel, its parameters, its objects' sizes and the
    step's token shape. Sizes alone are not enough: 64 x 1024 and 16 x 4096 tokens give
    attention the same bytes but four times the work per token."""
    sizes = step.program.objects_by_id
    train = step.layout.train
    params = tuple(sorted((k, repr(v)) for k, v in task.params.items() if k not in _POSITION))
    return (
        task.compute_key,
        params,
        (train.batch, train.seq_len),
        tuple(sizes[o].size_bytes for o in task.inputs),
        tuple(sizes[o].size_bytes for o in task.mutates),
        tuple(sizes[o].size_bytes for o in task.outputs),
    )


def _filled(
    program: Program,
    layout: StepLayout,
    obj_id: str,
    device: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
) -> torch.Tensor:
    obj = program.obj(obj_id)
    buffer = torch.zeros(obj.size_bytes, dtype=torch.uint8, device=device)
    packed = layout.packed.get(obj_id)
    views = packed.layout.views(buffer) if packed is not None else {}
    if obj.tensor is not None:
        views = {"": typed_view(buffer, obj)}
    # on a GPU the noise is drawn there (an 8B model's tasks touch ~20 GiB: drawn on the
    # host it took a minute), from a device generator seeded by the host one
    on_device = device.type == "cuda"
    if on_device:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        draw = torch.Generator(device=device).manual_seed(seed)
    for view in views.values():
        if view.is_floating_point() and on_device:
            view.normal_(0.0, 0.02, generator=draw)
        elif view.is_floating_point():  # drawn in place: no float32 copy to convert
            view.normal_(0.0, 0.02, generator=generator)
        elif int_high(obj_id) > 1:
            view.copy_(torch.randint(0, int_high(obj_id), view.shape, generator=generator))
    return buffer


def default_cache_dir() -> Path | None:
    """Where measurements are kept (module docstring); None when ``$DATAFLOW_PROFILE_CACHE``
    is ``off``."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return None if named == "off" else Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dataflow" / "profiles"


def device_identity(device: str) -> str:
    """What makes one device's timings another's: its name, compute capability, torch and
    CUDA versions (CPU: the machine, the processor's model, how many CPUs, torch's version
    and intra-op thread count)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        return f"{name} sm{major}{minor} torch {torch.__version__} cuda {torch.version.cuda}"
    return (
        f"{dev.type} {platform.machine()} {processor_model()} cpus {os.cpu_count()} torch "
        f"{torch.__version__} threads {torch.get_num_threads()}"
    )


def processor_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; ``platform.processor()``, often
    empty on Linux, where there is none)."""
    try:
        with Path("/proc/cpuinfo").open() as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _chosen_variants(device: str) -> list[Any]:
    """The variant every registered op resolves to on ``device`` (as ``load_ops`` picks:
    highest priority first)."""

    registry = kernels()
    chosen = []
    for op in sorted({variant.op for variant in registry}):
        variants = registry.for_op(op, device=torch.device(device).type)
        if variants:
            chosen.append(variants[0])
    return chosen


def kernel_set(resolver: str, device: str) -> tuple[str, ...]:
    """The resolver and the variant every registered op resolves to on ``device``, each
    with its distribution's version."""

    registry = kernels()
    chosen = [f"resolver {resolver}"]
    for variant in _chosen_variants(device):
        dist = registry.distribution_of(variant.key)
        try:
            dist_version = version(dist)
        except PackageNotFoundError:
            dist_version = "?"
        chosen.append(f"{variant.key} ({dist} {dist_version})")
    return tuple(chosen)


def _package_dir(obj: Any) -> Path | None:
    """The folder of the top-level package that defines ``obj`` (None for a builtin)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    top = sys.modules.get(module.__name__.partition(".")[0]) if module else None
    path = getattr(top, "__file__", None)
    return Path(path).parent if path else None


def code_fingerprint(resolver: str, device: str, family: Any = None) -> str:
    """A short hash of the Python source that runs and shapes the profiled tasks: the
    training plugin (task executables, the shared kit), the package of ``resolver``, the
    package of every kernel variant the ops resolve to on ``device`` and, when given,
    ``family``'s package. Hashes every ``.py`` file under each, by path and content."""

    roots = {Path(__file__).parent}
    if resolver in resolvers().names():  # (one that is not installed runs nothing here)
        roots.add(_package_dir(resolvers().get(resolver).build))
    for variant in _chosen_variants(device):
        try:
            roots.add(_package_dir(variant.load()))
        except ImportError:  # a variant that cannot load runs nothing (load_ops says so)
            continue
    if family is not None:
        roots.add(_package_dir(type(family)))
    digest = hashlib.sha256()
    for root in sorted(root for root in roots if root is not None):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class ProfileCache:
    """Measured task profiles on disk, one JSON file per signature (module docstring).
    ``hits`` and ``misses`` count lookups since the cache was made."""

    def __init__(
        self,
        directory: str | Path,
        device: str,
        kernels: tuple[str, ...],
        graph: bool = False,
        code: str | None = None,
        host_method: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.context = {"device": device, "kernels": list(kernels), "version": PROFILE_VERSION}
        if host_method is not None:  # a CPU's: HOST_METHOD_VERSION
            self.context["host_method"] = host_method
        if code is not None:  # code_fingerprint of what runs the tasks
            self.context["code"] = code
        if graph:  # timed as graph replays: another measurement than a dispatched launch
            self.context["timing"] = "graph"
        self.hits = self.misses = 0

    @classmethod
    def for_device(
        cls,
        device: str,
        resolver: str,
        directory: str | Path | None = None,
        *,
        graph: bool = False,
        family: Any = None,
    ) -> ProfileCache | None:
        """The cache for ``resolver``'s tasks (of ``family``, whose code joins the key) on
        ``device`` (None when the cache is off), for tasks timed as graph replays with
        ``graph``."""
        directory = directory or default_cache_dir()
        if directory is None:
            return None
        on_host = torch.device(device).type == "cpu"
        return cls(
            directory,
            device_identity(device),
            kernel_set(resolver, device),
            graph,
            code_fingerprint(resolver, device, family),
            HOST_METHOD_VERSION if on_host else None,
        )

    def _path(self, key: tuple) -> tuple[Path, str]:
        text = json.dumps({**self.context, "signature": key}, sort_keys=True, default=repr)
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json", text

    def get(self, key: tuple) -> TaskProfile | None:
        entry = self._read(key)
        try:
            found = TaskProfile(float(entry["cost_us"]), int(entry["workspace_bytes"]))
        except (KeyError, TypeError, ValueError):
            found = None
        return self._counted(found)

    def put(self, key: tuple, profile: TaskProfile) -> None:
        self._write(key, attrs.asdict(profile))

    def get_links(self, key: tuple) -> Links | None:
        """The links measured beside the task of signature ``key`` (CPU: ``price_step``)."""
        entry = self._read(("links", key))
        try:
            h2d, d2h = (Link(float(entry[d]["bw"]), float(entry[d]["latency_us"])) for d in _DIRS)
            found = Links(h2d=h2d, d2h=d2h, duplex_bytes_per_us=float(entry["duplex"]))
        except (KeyError, TypeError, ValueError):
            found = None
        return self._counted(found)

    def put_links(self, key: tuple, links: Links) -> None:
        entry: dict[str, Any] = {"duplex": links.duplex_bytes_per_us}
        for d in _DIRS:
            link = getattr(links, d)
            entry[d] = {"bw": link.bw_bytes_per_us, "latency_us": link.latency_us}
        self._write(("links", key), entry)

    def _counted(self, found: Any) -> Any:
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def _read(self, key: tuple) -> dict[str, Any] | None:
        """The entry stored for ``key`` (None: none, another key's, or unreadable)."""
        path, text = self._path(key)
        try:
            entry = json.loads(path.read_text())
            return entry if isinstance(entry, dict) and entry.get("key") == text else None
        except (OSError, ValueError):
            return None

    def _write(self, key: tuple, payload: dict[str, Any]) -> None:
        path, text = self._path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": text, **payload}))
        partial.replace(path)


def profile_program(
    step: Lowered,
    resolver: Callable[[Task], Any],
    *,
    device: str = "cuda",
    repeats: int = 3,
    seed: int = 0,
    int_high: Callable[[str], int] | None = None,
    graph: bool = False,
    cache: ProfileCache | None = None,
    settle_s: float = SETTLE_S,
    flush_l2: bool = FLUSH_L2,
) -> dict[tuple, TaskProfile]:
    """Measure every distinct task signature of ``step`` once (see the module docstring),
    or take it from ``cache`` (and store what was measured there). Integer tensors are
    filled uniformly from ``[0, int_high(obj_id))`` (default: the step's tokens and
    targets over the vocabulary, or the embedding's scatter-add contends on one row;
    every other integer tensor zeros).

    ``settle_s`` (CUDA): before its timed launches each task runs back to back for that
    long, so the clocks are those of a loaded device rather than of one that idled between
    short tasks. ``flush_l2`` (CUDA): a buffer twice the L2 cache is overwritten before
    every timed launch, so no input is read from a cache the previous launch warmed.

    Any other program (not lowered by this plugin) is priced by the core's
    ``dataflow.engine.measure.priced_by_measurement``; handed one, this says so."""
    if not isinstance(step, Lowered):
        raise TypeError(
            f"profile_program prices a lowered training step (Lowered), not a "
            f"{type(step).__name__}: price any program whose tasks have a resolver with "
            "dataflow.engine.measure.priced_by_measurement(program, resolver) or `dataflow "
            "plan PROGRAM.json --measured --resolver NAME`"
        )
    dev = torch.device(device)
    timing = _Timing.on(dev, settle_s, flush_l2)
    generator = torch.Generator().manual_seed(seed)
    profiles: dict[tuple, TaskProfile] = {}
    program, layout = step.program, step.layout
    int_high = int_high or vocabulary_high(step)

    def decided(obj_id: str) -> torch.Tensor:
        return _decided(step, obj_id, resolver, dev, generator, int_high, made)

    made: dict[tuple, torch.Tensor] = {}
    try:
        for task in program.tasks:
            if task.collective:
                continue  # the collective link prices it, not a measurement of compute
            key = signature(step, task)
            if key in profiles:
                continue
            cached = cache.get(key) if cache is not None else None
            if cached is not None:
                profiles[key] = cached
                continue
            executable, ctx = _prepared(
                program, layout, task, resolver, dev, generator, int_high, decided
            )
            replay = graph and dev.type == "cuda" and getattr(executable, "capturable", False)
            profiles[key] = _measure(executable, ctx, dev, repeats, replay, timing)
            if cache is not None:
                cache.put(key, profiles[key])
    finally:
        timing.close()
    return profiles


def busiest_task(step: Lowered, profiles: dict[tuple, TaskProfile]) -> Task:
    """The first task of the signature that takes most of ``step``'s profiled compute
    time (its cost times its count)."""
    totals: dict[tuple, float] = {}
    first: dict[tuple, Task] = {}
    for task in step.program.tasks:
        key = signature(step, task)
        if task.collective or key not in profiles:
            continue
        totals[key] = totals.get(key, 0.0) + profiles[key].cost_us
        first.setdefault(key, task)
    return first[max(totals, key=totals.__getitem__)]


def task_launcher(
    step: Lowered,
    resolver: Callable[[Task], Any],
    task: Task,
    *,
    device: str | torch.device,
    int_high: Callable[[str], int] | None = None,
    seed: int = 0,
) -> Callable[[Any], None]:
    """``launch(stream)``: ``task`` enqueued on a CUDA ``stream`` (run in place on the
    CPU, where ``stream`` is None) over filled buffers of its own, as the profiling pass
    fills them. ``measure_links(beside=...)`` keeps the busiest task running this way
    while it times copies, so the links are priced as a step's copies run, beside its
    kernels."""
    dev = torch.device(device)
    program, layout = step.program, step.layout
    int_high = int_high or vocabulary_high(step)
    generator = torch.Generator().manual_seed(seed)
    made: dict[tuple, torch.Tensor] = {}

    def decided(obj_id: str) -> torch.Tensor:
        return _decided(step, obj_id, resolver, dev, generator, int_high, made)

    executable, ctx = _prepared(program, layout, task, resolver, dev, generator, int_high, decided)

    def launch(stream: Any) -> None:
        if stream is None:
            executable.launch(ctx)
            return
        with torch.cuda.stream(stream):
            executable.launch(attrs.evolve(ctx, stream=stream))

    return launch


def _prepared(
    program: Program,
    layout: StepLayout,
    task: Task,
    resolver: Callable[[Task], Any],
    dev: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
    decided: Callable[[str], torch.Tensor],
) -> tuple[Any, LaunchContext]:
    """``task``'s executable and a launch context over fresh, filled buffers of its own."""
    buffers = _buffers(program, layout, task, dev, generator, int_high, decided)
    return resolver(task), _launch_context(program, task, dev, buffers)


def _buffers(
    program: Program,
    layout: StepLayout,
    task: Task,
    dev: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
    decided: Callable[[str], torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Fresh, filled buffers for every object ``task`` names; with ``decided``, an AuxTemp
    the task reads holds what ``decided`` returns for it."""
    return {
        o: (
            decided(o)
            if decided is not None and _is_decision(layout, o) and o not in task.outputs
            else _filled(program, layout, o, dev, generator, int_high)
        )
        for o in task.uses
    }


def _launch_context(
    program: Program, task: Task, dev: torch.device, buffers: dict[str, torch.Tensor]
) -> LaunchContext:
    objs = program.objects_by_id

    def views(names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(typed_view(buffers[o], objs[o]) for o in names)

    return LaunchContext(
        task=task,
        device=dev.type,
        stream=None,
        inputs=views(task.inputs),
        mutates=views(task.mutates),
        outputs=views(task.outputs),
        values={"step": 0},
    )


def _is_decision(layout: StepLayout, obj_id: str) -> bool:
    packed = layout.packed.get(obj_id)
    return packed is not None and packed.kind == "AuxTemp"


def _decided(
    step: Lowered,
    obj_id: str,
    resolver: Callable[[Task], Any],
    dev: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
    made: dict[tuple, torch.Tensor],
) -> torch.Tensor:
    """A buffer holding AuxTemp ``obj_id`` as the task that writes it (its block's forward)
    decides it on filled inputs. Noise is not a decision: a router's expert offsets filled
    with zeros route every row nowhere, so a backward timed on them skips the experts'
    GEMMs, and a loop over the offsets refuses them. The writer runs once per signature
    (``made``); each reader gets its own copy."""
    program, layout = step.program, step.layout
    writer = program.tasks[program.producers[obj_id]]
    key = (signature(step, writer), writer.outputs.index(obj_id))
    if key not in made:
        buffers = _buffers(program, layout, writer, dev, generator, int_high, None)
        resolver(writer).launch(_launch_context(program, writer, dev, buffers))
        made[key] = buffers[obj_id]
    return made[key].clone()


@attrs.frozen
class _Timing:
    """How timed launches are prepared: on CUDA ``profile_program``'s ``settle_s`` and
    ``flush_l2``; on a CPU the worker thread that runs them (``on_worker``)."""

    settle_s: float = 0.0
    scratch: torch.Tensor | None = None
    worker: ThreadPoolExecutor | None = None

    @classmethod
    def on(cls, dev: torch.device, settle_s: float, flush_l2: bool) -> _Timing:
        if dev.type != "cuda":
            worker = ThreadPoolExecutor(1, thread_name_prefix="dataflow-profile")
            worker.submit(lambda: None).result()  # its thread started: not in a timing
            return cls(worker=worker)
        scratch = None
        if flush_l2:
            l2 = torch.cuda.get_device_properties(dev).L2_cache_size
            scratch = torch.empty(2 * l2, dtype=torch.uint8, device=dev)
        return cls(settle_s, scratch)

    def settle(self, launch: Callable[[], None], dev: torch.device) -> None:
        """Launch back to back until ``settle_s`` has passed on the host clock."""
        if self.settle_s <= 0:
            return
        began = time.perf_counter()
        while time.perf_counter() - began < self.settle_s:
            for _ in range(4):
                launch()
            torch.cuda.synchronize(dev)

    def before_launch(self) -> None:
        if self.scratch is not None:
            self.scratch.fill_(1)

    def on_worker(self, work: Callable[[], object]) -> None:
        """``work()`` run on the worker thread (CPU), as the engine's compute worker runs
        a step's tasks, handed over and waited for as the engine's dispatcher hands it
        a task and hears it end: torch's intra-op threads are per calling thread, and on
        a loaded 2-core machine a block's forward took 180 ms a launch from the main
        thread, whose threads had just run other work, and 3.5 ms from a worker's (1.5
        ms on one thread)."""
        if self.worker is None:
            work()
        else:
            self.worker.submit(work).result()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _measure(
    executable: Any,
    ctx: LaunchContext,
    dev: torch.device,
    repeats: int,
    replay: bool = False,
    timing: _Timing = _Timing(),
) -> TaskProfile:
    if dev.type != "cuda":
        times = _host_timed_us(lambda: timing.on_worker(lambda: executable.launch(ctx)), repeats)
        return TaskProfile(statistics.median(times), 0)
    executable.launch(ctx)  # warm-up: lazy initialisation, library handles, caches
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    if not replay:
        timing.settle(lambda: executable.launch(ctx), dev)
    times = _dispatched_us(executable, ctx, repeats, timing)
    workspace = max(0, torch.cuda.max_memory_allocated(dev) - base)
    if replay:
        try:
            times, captured = _replayed_us(executable, ctx, dev, repeats, timing)
            # the captured launch may take another path than the dispatched ones (the
            # segmented attention's varlen layout is read on the host, so a graph runs the
            # masked kernel: about 1 GB more at 2 x 4096 tokens on the H100, session 32);
            # the step replays the captured one
            workspace = max(workspace, captured)
        except Exception:  # noqa: BLE001 - whatever the capture refuses
            # An op that reads the device on the host (e.g. grouped_mm's reference loop
            # reading its offsets) cannot be captured. The engine's own capture then fails
            # too and it dispatches every step (saying why), so dispatched launches are the
            # time this task will take: timed again, settled as every other timing is (the
            # ones above were taken to measure the workspace, without settling).
            _after_failed_capture(dev)
            timing.settle(lambda: executable.launch(ctx), dev)
            times = _dispatched_us(executable, ctx, repeats, timing)
    return TaskProfile(statistics.median(times), -(-workspace // ROUND_BYTES) * ROUND_BYTES)


def _host_timed_us(launch: Callable[[], None], repeats: int) -> list[float]:
    """A CPU task launched until it has settled (two launches in a row within
    ``HOST_SETTLED`` of each other, at most ``HOST_SETTLE_LAUNCHES``), then timed by the
    host clock ``repeats`` times, and more while those took less than ``HOST_TIMED_S`` (up
    to ``HOST_MAX_REPEATS``): a short task's median then rests on enough launches to
    ride out another process taking the cores for a moment. ``launch`` hands the task to
    the worker and waits for it (``_Timing.on_worker``), so each time holds the two
    thread hand-overs the engine's dispatcher makes per task. One warm-up is not enough on
    a CPU: gpt2_tiny's block forward at batch 32 took 9.5 s (torch's first use), then 71,
    113, 17, 9 and 8 ms a launch (glibc's allocator raises its mmap threshold as large
    temporaries are freed, so the first launches fault in fresh pages), where the
    engine's steps ran it in 8-15 ms."""
    last = _launch_us(launch)  # warm-up: lazy initialisation, caches
    for _ in range(HOST_SETTLE_LAUNCHES):
        now = _launch_us(launch)
        settled = max(now, last) <= HOST_SETTLED * min(now, last) + HOST_SETTLED_SLACK_US
        last = now
        if settled:
            break
    times: list[float] = []
    while len(times) < repeats or (
        sum(times) < HOST_TIMED_S * 1e6 and len(times) < HOST_MAX_REPEATS
    ):
        times.append(_launch_us(launch))
    return times


def _launch_us(launch: Callable[[], None]) -> float:
    start = time.perf_counter()
    launch()
    return (time.perf_counter() - start) * 1e6


def _dispatched_us(
    executable: Any, ctx: LaunchContext, repeats: int, timing: _Timing
) -> list[float]:
    """Each of ``repeats`` launches of the task timed by events around it."""
    times = []
    for _ in range(repeats):
        timing.before_launch()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        executable.launch(ctx)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _after_failed_capture(dev: torch.device) -> None:
    """Let the work queued before a refused capture finish; the refused capture's own
    error may surface again here and means nothing more."""
    try:
        torch.cuda.synchronize(dev)
    except Exception:  # noqa: BLE001
        pass


def _replayed_us(
    executable: Any, ctx: LaunchContext, dev: torch.device, repeats: int, timing: _Timing
) -> tuple[list[float], int]:
    """The task captured into a CUDA graph of its own, each replay timed by events; and
    the allocator's peak during the capture above the bytes in use before it (what the
    captured launch allocates: its workspace in a replayed step)."""
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    on_stream = attrs.evolve(ctx, stream=stream)
    # one launch on the capture's stream first: what the libraries keep per stream (cuBLAS's
    # workspace) is allocated there, outside the capture's peak (runtime_reserve_bytes
    # counts it once for the run)
    with torch.cuda.stream(stream):
        executable.launch(on_stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.cuda.graph(graph, stream=stream):
        executable.launch(on_stream)
    captured = max(0, torch.cuda.max_memory_allocated(dev) - base)
    memsets_to_kernels(graph.raw_cuda_graph())  # as the engine's step graph has them
    graph.instantiate()
    graph.replay()  # warm: the first replay uploads the graph
    timing.settle(graph.replay, dev)
    times = []
    for _ in range(repeats):
        timing.before_launch()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return times, captured


def vocabulary_high(step: Lowered) -> Callable[[str], int]:
    """``int_high`` of the profiling pass: the step's tokens and targets drawn over its
    vocabulary, every other integer tensor zeros (a step's segments too: one sequence a
    row, every position 0, priced through the segmented attention as the step runs it)."""
    vocab = embed_layer(step.layers).params[0].state_shape[0]
    drawn = {o for o, (_, role) in step.layout.data_objects().items() if role != "segments"}
    return lambda obj_id: vocab if obj_id in drawn else 1


def without_workspace(profiles: dict[tuple, TaskProfile]) -> tuple[dict[tuple, TaskProfile], int]:
    """``profiles`` with no workspace, and the most any of them measured. On CUDA task
    workspace is taken from the framework allocator beside the arena, so a program priced
    by these is planned at the budget less that most (docs/planning.md, Static placement)."""
    largest = max((found.workspace_bytes for found in profiles.values()), default=0)
    stripped = {key: attrs.evolve(found, workspace_bytes=0) for key, found in profiles.items()}
    return stripped, largest


def apply_profile(step: Lowered, profiles: dict[tuple, TaskProfile]) -> Program:
    """``step``'s program with every task's cost and workspace from its measured signature
    (collective tasks stay as they are: the collective link prices them)."""
    program = step.program
    tasks = []
    for task in program.tasks:
        if task.collective:
            tasks.append(task)
            continue
        measured = profiles[signature(step, task)]
        tasks.append(
            attrs.evolve(task, cost_us=measured.cost_us, workspace_bytes=measured.workspace_bytes)
        )
    return attrs.evolve(program, tasks=tuple(tasks))
