"""``TrainingRun``: the one loop that drives the engine for training.

    run = TrainingRun("gpt2", "gpt2_tiny", TrainConfig(seq_len=64, batch=8), budget_bytes=...)
    stats = run.step([(tokens, targets)], lr=3e-4)     # one optimizer update
    run.save("ckpt/step_000001"); run.restore("ckpt/step_000001")

It lowers the step once, plans it into the budget, places it and loads the engine once
(lazily, at the first step, because the engine takes the first step's data with the
start values). Every later step feeds only the rounds' tokens and targets; weights and
optimizer state stay where the plan leaves them between steps. The learning rate and
the optimizer's step count go in through ``Engine.run(values=...)``: ``lr`` and
``update`` (the number of updates so far + 1, so a restored run's bias correction
continues where the saved one stopped).

The model state is ``{"<layer>.<param>": tensor}`` (the reference model's ``state_dict``
keys); the optimizer state is kept raw, as the packed ``O_*`` objects' bytes, because
only this program's layout reads it. ``dataflow verify``, ``dataflow train`` and the
fleet share this class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from dataflow.units import format_size
from dataflow_training.config import TrainConfig
from dataflow_training.family import Family, embed_layer, load_family
from dataflow_training.lowering import Lowered, lower
from dataflow_training.step import StepLayout
from dataflow_training.values import StartValues, read_state, start_values

Batch = tuple[torch.Tensor, torch.Tensor]

#: the budget used when none is given: large enough never to bind
UNBOUNDED_BYTES = 2**62


#: Host memory kept free beside the page-locked slow pool (``check_backing``): what the
#: process still allocates after the check (CUDA graph capture, staging, Python). The
#: device machine's llama3_8b run at 16 GiB peaked at 98 GiB of host memory with an
#: 80 GiB pool and the 16 GB of starting weights (docs/throughput.md, session 5): the
#: weights are already counted as used when the check reads the available memory.
HOST_RESERVE_BYTES = 8 * 2**30

#: Plans ``TrainingRun`` makes, at most, to bring the slow pool inside the host (the pool's
#: excess over the slow peak changes with each plan, so one re-plan may fall short)
FIT_POOL_TRIES = 3


#: ``resolver_for``'s choice for "auto" on CUDA: each block kind's math compiled, what the
#: throughput rows of docs/throughput.md run (compare.py --resolver torch-compiled)
CUDA_RESOLVER = "torch-compiled"


def resolver_for(name: str, device: str) -> str:
    """The registered resolver ``name`` names for ``device``: "auto" is ``CUDA_RESOLVER`` on
    CUDA where it is installed, else ``torch`` (eager: the compiled resolver is made for
    CUDA, and on a CPU compiling a small model's tasks takes longer than its steps). A
    name that is not registered is a ValueError naming the known ones."""
    from dataflow.plugins import resolvers

    known = [spec.name for spec in resolvers()]
    if name == "auto":
        return CUDA_RESOLVER if device.startswith("cuda") and CUDA_RESOLVER in known else "torch"
    if name not in known:
        raise ValueError(
            f"--resolver {name!r}: not a registered resolver; known: auto, {', '.join(known)}"
        )
    return name


def _differences(theirs: Any, ours: Any, path: str) -> list[tuple[str, Any, Any]]:
    """``(dotted path, theirs, ours)`` of every value that differs between two manifest
    fields, nested mappings compared key by key (a missing key is None)."""
    if isinstance(theirs, Mapping) and isinstance(ours, Mapping):
        found = []
        for key in sorted(set(theirs) | set(ours), key=str):
            found += _differences(theirs.get(key), ours.get(key), f"{path}.{key}")
        return found
    return [] if theirs == ours else [(path, theirs, ours)]


def available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    try:
        with Path("/proc/meminfo").open() as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reference_state(
    family: Family, config: Any, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The family reference model's initial state under ``seed``, in ``dtype``. The
    float32 model's tensors are dropped one by one as their copies are made, so the host
    holds the float32 model and little more, not the float32 model beside its whole copy
    (for an 8B model that is 32 GB, not 48)."""
    import gc

    torch.manual_seed(seed)
    model = family.reference_model(config)
    state = model.state_dict()
    del model
    gc.collect()  # a module in a reference cycle would keep its parameters otherwise
    weights = {}
    for key in list(state):
        weights[key] = state.pop(key).detach().to(dtype, copy=True)
    return weights


@attrs.frozen
class StepStats:
    """What one ``TrainingRun.step`` did. ``step`` counts updates before this one (the
    first step is 0); ``losses`` one per round; ``grad_norm`` the global gradient norm
    before clipping (None when the step does not measure it); ``step_s`` the wall time of
    the engine run and the read-back."""

    step: int
    losses: tuple[float, ...]
    loss: float
    lr: float
    grad_norm: float | None
    step_s: float
    fast_peak_bytes: int
    allocator_peak_bytes: int | None


class TrainingRun:
    """A family preset trained on the engine, one optimizer update per ``step``.

    ``family`` is a registered family name or a family object; ``state`` the initial model
    state (default: the family's reference model initialised under ``seed``);
    ``budget_bytes`` the fast-memory budget (default: unbounded); ``resolver`` the
    registered resolver that runs the tasks; ``planner``
    a planner spec for ``plan`` (default: the ``recompute`` planner, or PressureFit alone
    with ``recompute=False``);
    ``keep_grads`` keeps each step's weight gradients for ``grads()`` (checks only);
    ``keep_aux_temp`` each step's AuxTemp (recorded decisions) for ``aux_temps()`` (checks
    only);
    ``cost`` and ``links`` (a ``RooflineCost`` and ``Links``, e.g. from a hardware entry)
    price the step where the profiling pass does not (off CUDA) and give its links.
    ``graph`` (CUDA only) replays every step after the first from one captured CUDA graph
    (``graph_note`` says why not, when it cannot).
    ``grad_share`` makes the run one member of a data-parallel fleet whose tokens are that
    share of the fleet's: each step all-reduces the gradients before the update
    (``lower``'s ``grad_share``, ``dataflow_training.fleet``).
    ``backing_bytes`` bounds the slow (pinned host, on CUDA) memory the plan uses at any
    moment (its slow peak). The engine's slow pool holds a slice for every object the plan
    ever puts in slow memory, so it is larger than that peak: ``pinned_limit_bytes``
    (default ``backing_bytes``) bounds it, checked before the pool is allocated at the
    first step (``check_backing``). On CUDA the pool is page-locked host memory, and
    page-locking more than the host has stalls or kills the process rather than failing:
    so the check also refuses a pool larger than the host's available memory less
    ``HOST_RESERVE_BYTES``, whatever the limits given. Without ``backing_bytes``, a plan
    whose pool exceeds those limits is made again inside a slow budget that fits them
    (``pool_note`` says so), and only what still does not fit is refused.
    After a step, ``last_result`` is the engine's ``RunResult`` of it (task spans,
    transfers, peaks: what benchmarks read); None before the first step.
    """

    def __init__(
        self,
        family: str | Family,
        preset: str,
        train: TrainConfig,
        *,
        budget_bytes: int | None = None,
        backing_bytes: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        overrides: Mapping[str, Any] | None = None,
        state: Mapping[str, torch.Tensor] | None = None,
        resolver: str = "torch",
        planner: Any = None,
        keep_grads: bool = False,
        keep_aux_temp: bool = False,
        graph: bool = True,
        recompute: bool = True,
        cost: Any = None,
        links: Any = None,
        grad_share: float | None = None,
        pinned_limit_bytes: int | None = None,
    ) -> None:
        from dataflow.planning import place, plan
        from dataflow.plugins import kernels, resolvers

        kernels().check_pins()  # a bad DATAFLOW_KERNELS fails here, not in the first task
        self.family = load_family(family) if isinstance(family, str) else family
        self.preset, self.train, self.device, self.seed = preset, train, device, seed
        self.graph = graph and device.startswith("cuda")
        self.overrides = dict(overrides or {})
        self.config = self.family.config(preset, **self.overrides)
        self.lowered: Lowered = lower(
            self.family,
            preset,
            train,
            overrides=self.overrides,
            keep_grads=keep_grads,
            keep_aux_temp=keep_aux_temp,
            cost=cost,
            links=links,
            grad_share=grad_share,
        )
        self.fleet = grad_share is not None
        self.program = self.lowered.program
        self.layout: StepLayout = self.lowered.layout
        # Weights, optimizer state and aux are persistent: the plan is a steady-state cycle,
        # each of them homed (fast or slow) between steps where the planner chooses.
        if planner is None:
            from dataflow.planning import PRESSUREFIT
            from dataflow_training.recompute import RECOMPUTE

            planner = RECOMPUTE if recompute else PRESSUREFIT
        options: dict[str, Any] = {"planner": planner, "cyclic": bool(self.program.persistent)}
        self.backing_bytes = backing_bytes
        #: why the plan was made again inside a slow budget (``fit_pool``), else None
        self.pool_note: str | None = None
        self.pinned_limit_bytes = (
            backing_bytes if pinned_limit_bytes is None else pinned_limit_bytes
        )
        if backing_bytes is not None:
            options["slow_budget_bytes"] = backing_bytes
        self.vocab_size = embed_layer(self.lowered.layers).params[0].shape[0]
        self.budget_bytes = budget_bytes or UNBOUNDED_BYTES
        if device.startswith("cuda"):
            from dataflow_training.cuda_plan import plan_for_cuda

            plan_for_cuda(self, resolver, options)
        else:

            def plan_and_place(options: dict[str, Any]) -> None:
                self.planned = plan(self.program, self.budget_bytes, **options)
                self.placement = place(self.planned)

            plan_and_place(options)
            self.fit_pool(plan_and_place, options)
        self.resolver_name = resolver
        # the plan the engine runs: place() may have re-planned (the recompute planner may
        # then have chosen other layers), so the resolver reads that plan's step layout
        self._resolver = resolvers().get(resolver).build(self.placement.plan.program)
        self.grad_norms = tuple(
            o.id for o in self.program.objects if o.id.startswith("gn_") and o.role == "output"
        )
        self.updates = 0  # optimizer updates done so far
        dtype = getattr(torch, train.dtype.param)
        self._weights: dict[str, torch.Tensor] | None = (
            _reference_state(self.family, self.config, seed, dtype)
            if state is None
            else {k: v.detach().to(dtype, copy=True) for k, v in state.items()}
        )
        self._opt_state: dict[str, torch.Tensor] | None = None
        self._engine: Any = None
        self._lost: str | None = None  # why the state is gone (a failed engine load)
        self.last_result: Any = None

    # -- stepping ----------------------------------------------------------------------
    def pool_limit_bytes(self) -> int | None:
        """The most the engine's slow pool may take: ``pinned_limit_bytes`` and, on CUDA,
        the host's available memory less ``HOST_RESERVE_BYTES`` (None: no limit)."""
        return min((limit for limit, _what in self._pool_limits()), default=None)

    def _pool_limits(self) -> list[tuple[int, str]]:
        """Each limit on the slow pool, with what it is (``pool_limit_bytes``)."""
        limits = []
        if self.pinned_limit_bytes is not None:
            limits.append((self.pinned_limit_bytes, "pinned_limit_bytes"))
        available = available_host_bytes() if self.device.startswith("cuda") else None
        if available is not None:
            host = available - HOST_RESERVE_BYTES - self._weights_to_make_bytes()
            what = f"the host's available memory less {format_size(HOST_RESERVE_BYTES)}"
            limits.append((host, what))
        return limits

    def _weights_to_make_bytes(self) -> int:
        """While ``__init__`` plans, the starting weights' host copy is not made yet, but
        will be in host memory when the pool is allocated (``check_backing``)."""
        if hasattr(self, "_weights"):
            return 0
        return sum(p.layout.size_bytes for p in self.layout.packed.values() if p.kind == "W")

    def fit_pool(self, plan_and_place: Callable[[dict[str, Any]], None], options: dict) -> None:
        """With no ``backing_bytes`` the plan's slow memory is unbounded; where its pool
        would not fit ``pool_limit_bytes`` (the host, on CUDA), plan again inside a slow
        budget that leaves room for the pool's excess over the slow peak (a slice per
        object), a few times, so the run fits the host instead of being refused. What
        still does not fit is refused by ``check_backing`` with its message."""
        from dataflow.planning import PlanningError

        limits = self._pool_limits()
        if self.backing_bytes is not None or not limits:
            return
        limit, what = min(limits)
        for _ in range(FIT_POOL_TRIES):
            pool = self.pinned_bytes
            if pool <= limit:
                return
            slow_budget = self.predicted()["slow_peak_bytes"] - (pool - limit)
            if slow_budget <= 0:
                return
            kept = self.planned, self.placement
            try:
                plan_and_place(dict(options, slow_budget_bytes=slow_budget))
            except PlanningError:  # no plan inside it: keep the first for the message
                self.planned, self.placement = kept
                return
            self.backing_bytes = slow_budget  # the engine holds the run to it
            self.pool_note = (
                f"a slow pool of {format_size(pool)} would not fit the "
                f"{format_size(limit)} allowed ({what}): planned inside a "
                f"slow budget of {format_size(slow_budget)}"
            )

    def step(
        self, batches: Sequence[Batch], lr: float | None = None, *, dispatch: bool = False
    ) -> StepStats:
        """One optimizer update over ``batches``, one ``(tokens, targets)`` per
        accumulation round, each int64 of shape (batch, seq_len). ``lr`` defaults to the
        optimizer policy's; ``dispatch`` runs the step task by task even where a CUDA
        graph would replay it (``Engine.run``), so that ``last_result`` times every task."""
        batches = self._checked(batches)
        lr = self.train.optimizer.lr if lr is None else float(lr)
        values = {"lr": lr, "update": self.updates + 1}
        if self.fleet:
            values["fleet"] = 1
        started = time.perf_counter()
        if self._engine is None:
            self._load(batches)
            result = self._engine.run(values=values)
        else:
            result = self._engine.run(
                values=values, feed=lambda _step: self._data(batches), dispatch=dispatch
            )
        self.last_result = result
        # the losses and gradient norms of the step, fetched from the device together
        step = self.layout.step
        names = [f"loss_{step}_{r}" for r in range(self.train.rounds)]
        read = self._engine.read_scalars([*names, *self.grad_norms])
        losses = tuple(read[: len(names)])
        grad_norm = None
        if self.grad_norms:
            grad_norm = sum(read[len(names) :]) ** 0.5
        step_s = time.perf_counter() - started
        self.updates += 1
        return StepStats(
            self.updates - 1,
            losses,
            sum(losses) / len(losses),
            lr,
            grad_norm,
            step_s,
            result.fast_peak_bytes,
            result.allocator_peak_bytes,
        )

    def _checked(self, batches: Sequence[Batch]) -> list[Batch]:
        if len(batches) != self.train.rounds:
            raise ValueError(
                f"step got {len(batches)} batch(es); the step has {self.train.rounds} "
                "accumulation round(s), one (tokens, targets) each"
            )
        shape = (self.train.batch, self.train.seq_len)
        out = []
        for r, (tokens, targets) in enumerate(batches):
            for name, t in (("tokens", tokens), ("targets", targets)):
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"round {r} {name} have shape {tuple(t.shape)}; the step takes {shape} "
                        "(batch, seq_len)"
                    )
            largest = int(tokens.max())
            if largest >= self.vocab_size:
                raise ValueError(
                    f"round {r} tokens reach id {largest}; the model's vocabulary has "
                    f"{self.vocab_size} ids"
                )
            out.append((tokens.to(torch.int64), targets.to(torch.int64)))
        return out

    def _data(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        return start_values(self.program, {}, lambda _step, round_: batches[round_], data_only=True)

    def _load(self, batches: list[Batch]) -> None:
        from dataflow.engine import Engine

        opt_state = self._opt_state or {}
        for obj_id, raw in opt_state.items():
            packed = self.layout.packed.get(obj_id)
            if packed is None or packed.kind != "O" or (packed.layout.size_bytes,) != raw.shape:
                raise ValueError(
                    f"optimizer state {obj_id!r} does not fit this step's layout "
                    f"({tuple(raw.shape)} bytes given)"
                )
        self.check_backing()
        # built object by object as the engine copies them in: the host holds the pinned
        # pool and one object's bytes at a time, not every start value at once, and the
        # weights' host copy goes as each parameter object is put (consume)
        initial = StartValues(
            self.program, self._weights, lambda _step, r: batches[r], given=opt_state, consume=True
        )
        engine = Engine(
            "torch",
            budget_bytes=self.budget_bytes,
            slow_budget_bytes=self.backing_bytes,
            device=self.device,
            graph=self.graph,
        )
        try:
            engine.load(self.planned, self._resolver, initial=initial, placement=self.placement)
        except BaseException as exc:  # the weights were handed over: the state is gone
            self._weights = self._opt_state = None
            self._lost = f"its engine failed to load ({type(exc).__name__}: {exc})"
            raise
        self._engine = engine
        self._weights = self._opt_state = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the engine's slow pool for this plan (pinned host memory on CUDA): a
        slice for every object that starts slow or is ever offloaded."""
        from dataflow.engine.backends.torch_storage import slow_pool_bytes

        return slow_pool_bytes(self.placement.plan.program)

    def check_backing(self) -> None:
        """Refuse, before anything is allocated, a plan whose slow pool exceeds
        ``pinned_limit_bytes`` or, on CUDA, the host's available memory less
        ``HOST_RESERVE_BYTES`` (class docstring)."""
        from dataflow.planning import PlanningError

        pool = self.pinned_bytes
        limit = self.pinned_limit_bytes
        if limit is not None and pool > limit:
            what = f"pinned_limit_bytes: more than the {format_size(limit)} allowed"
        else:
            available = available_host_bytes() if self.device.startswith("cuda") else None
            if available is None or pool <= available - HOST_RESERVE_BYTES:
                return
            what = (
                f"host memory: more than the {format_size(available)} this host has "
                f"available less {format_size(HOST_RESERVE_BYTES)} kept for the process"
            )
        peak = format_size(self.predicted()["slow_peak_bytes"])
        raise PlanningError(
            f"{what}: the engine's slow pool for this plan takes {format_size(pool)} (a "
            f"slice for every object ever in slow memory; the plan's slow peak is {peak}); "
            "a larger fast budget (fewer objects offloaded) or fewer tokens a round "
            "(smaller activations) needs a smaller pool"
        )

    def step_activity(self, lr: float | None = None) -> dict[str, float]:
        """One more optimizer update on the last step's batches, replayed from the CUDA
        graph under torch.profiler: busy microseconds of the compute stream and of each
        copy direction, and the step's span (``Engine.replay_activity``). For benchmarks:
        compute idle is ``1 - compute_busy_us / span_us``."""
        if self._engine is None:
            raise RuntimeError("step_activity needs the steps before it run first")
        lr = self.train.optimizer.lr if lr is None else float(lr)
        activity = self._engine.replay_activity(values={"lr": lr, "update": self.updates + 1})
        self.updates += 1
        return activity

    @property
    def graph_note(self) -> str | None:
        """Why steps are dispatched rather than replayed from a CUDA graph (None when they
        are replayed, or before the engine has tried)."""
        if not self.graph:
            return "CUDA graphs are off (not on CUDA, or graph=False)"
        return None if self._engine is None else self._engine.graph_note

    @property
    def load_seconds(self) -> dict[str, float]:
        """Seconds the engine's load (in the first step) spent in each phase
        (``Engine.load_seconds``); empty before the first step."""
        return {} if self._engine is None else dict(self._engine.load_seconds)

    # -- state -------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(model state, optimizer state)``: ``{"<layer>.<param>": tensor}`` and the raw
        bytes of every ``O_*`` object (zeros before the first update), on the CPU."""
        if self._engine is None:
            if self._weights is None:
                raise RuntimeError(f"the run has no state: {self._lost}")
            weights = {k: v.clone() for k, v in self._weights.items()}
            if self._opt_state is not None:
                return weights, {k: v.clone() for k, v in self._opt_state.items()}
            opt = {
                p.id: torch.zeros(p.layout.size_bytes, dtype=torch.uint8)
                for p in self.layout.of_kind("O")
            }
            return weights, opt
        fetch = self._engine.fetch
        weights = {k: v.cpu() for k, v in read_state(self.program, fetch, "W").items()}
        opt = {p.id: fetch(p.id).detach().cpu().clone() for p in self.layout.of_kind("O")}
        return weights, opt

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's weight gradients (as the update saw them: clipped when the
        step clips), ``{"<layer>.<param>": tensor}``; needs ``keep_grads``."""
        if self._engine is None or not self.layout.of_kind("dW"):
            raise RuntimeError("grads() needs a step run with keep_grads=True")
        if not any(p.id in self.program.final_locations for p in self.layout.of_kind("dW")):
            raise RuntimeError("grads() needs TrainingRun(..., keep_grads=True)")
        return {k: v.cpu() for k, v in read_state(self.program, self._engine.fetch, "dW").items()}

    def aux_temps(self) -> list[dict[str, dict[str, torch.Tensor]]]:
        """The last step's AuxTemp, per round ``{"<layer>": {name: tensor}}`` on the CPU
        (every block that records decisions); needs ``keep_aux_temp``."""
        temps = self.layout.of_kind("AuxTemp")
        if self._engine is None or not temps:
            raise RuntimeError("aux_temps() needs a step run of a program with AuxTemp")
        if not all(p.id in self.program.final_locations for p in temps):
            raise RuntimeError("aux_temps() needs TrainingRun(..., keep_aux_temp=True)")
        per_layer = len({p.layer for p in temps})
        rounds: list[dict[str, dict[str, torch.Tensor]]] = []
        for i, packed in enumerate(temps):  # lowered round by round, block by block
            if i % per_layer == 0:
                rounds.append({})
            views = packed.layout.views(self._engine.fetch(packed.id))
            rounds[-1][packed.layer] = {name: view.cpu().clone() for name, view in views.items()}
        return rounds

    def set_state(
        self,
        weights: Mapping[str, torch.Tensor],
        opt_state: Mapping[str, torch.Tensor] | None,
        updates: int,
    ) -> None:
        """Continue from a given state: the engine is loaded afresh at the next step."""
        self.close()
        dtype = getattr(torch, self.train.dtype.param)
        self._weights = {k: v.to(dtype).clone() for k, v in weights.items()}
        self._opt_state = None if opt_state is None else dict(opt_state)
        self.updates = updates

    def save(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a complete checkpoint to ``path`` (atomically; see
        ``dataflow_training.checkpoint``); ``extra`` goes into its manifest."""
        from dataflow_training.checkpoint import write_checkpoint

        weights, opt = self.state()
        return write_checkpoint(path, weights, opt, self.manifest(extra))

    def restore(self, path: str | Path, loose: Sequence[str] = ()) -> dict[str, Any]:
        """Continue from the checkpoint at ``path``; returns its manifest. A checkpoint of
        another family, preset, overrides or training step is an error naming the field;
        ``loose`` names training-step fields not compared (a fleet member restores a
        checkpoint rank 0 wrote with its own ``rounds``)."""
        from dataflow_training.checkpoint import read_checkpoint, set_rng_state

        weights, opt, manifest, rng = read_checkpoint(path)
        mine = self.manifest()
        for field in ("family", "preset", "overrides", "train"):
            theirs, ours = manifest.get(field), mine[field]
            if field == "train" and loose and isinstance(theirs, dict):
                theirs = {k: v for k, v in theirs.items() if k not in loose}
                ours = {k: v for k, v in ours.items() if k not in loose}
            differences = _differences(theirs, ours, field)
            if differences:
                where, was, now = differences[0]
                more = [d[0] for d in differences[1:]]
                also = f" (and {len(more)} more: {', '.join(more)})" if more else ""
                raise ValueError(
                    f"checkpoint {path}: {where} is {was!r}; this run's is {now!r}{also}"
                )
        self.set_state(weights, opt, int(manifest["step"]))
        set_rng_state(rng)
        return manifest

    def manifest(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint of this run records about it (``checkpoint.MANIFEST_FIELDS``)."""
        from dataflow_training.checkpoint import package_versions, plan_hash, train_dict

        return {
            "step": self.updates,
            "family": self.family.name,
            "preset": self.preset,
            "overrides": self.overrides,
            "train": train_dict(self.train),
            "seed": self.seed,
            "device": self.device,
            "budget_bytes": self.planned.budget_bytes,
            "plan_hash": plan_hash(self.planned.program),
            "versions": package_versions(),
            **dict(extra or {}),
        }

    # -- what the plan says ------------------------------------------------------------
    @property
    def simulated(self) -> Any:
        """The simulator's step of the placed plan (``place`` may have re-planned)."""
        return self.placement.plan.sim if hasattr(self.placement, "plan") else self.planned.sim

    def predicted(self) -> dict[str, float]:
        """The simulator's figures for one step of the placed plan."""
        sim = self.simulated
        step_s = sim.makespan_us / 1e6
        tokens = self.train.tokens_per_round * self.train.rounds
        return {
            "step_s": step_s,
            "tok_s": tokens / step_s if step_s > 0 else float("inf"),
            "fast_peak_bytes": sim.fast_peak_bytes,
            "slow_peak_bytes": sim.slow_peak_bytes,
            "moved_bytes": sim.h2d.bytes + sim.d2h.bytes,
            "compute_busy_s": sim.compute_busy_us / 1e6,
            "h2d_bytes": sim.h2d.bytes,
            "d2h_bytes": sim.d2h.bytes,
            "h2d_busy_s": sim.h2d.busy_us / 1e6,
            "d2h_busy_s": sim.d2h.busy_us / 1e6,
        }

    def close(self, keep_state: bool = True) -> None:
        """Give the engine's memory back, keeping the state on the host for a later step
        (``keep_state=False``: drop it; a large model's state need not be copied out when
        the run ends)."""
        if self._engine is not None:
            if keep_state:
                self._weights, self._opt_state = self.state()
            else:
                self._weights = self._opt_state = None
                self._lost = "the run was closed with keep_state=False"
            self._engine.close()
            self._engine = None

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
