"""``compile_step``: one training step made once per run, as one immutable value.

    step = compile_step(family, "gpt2_tiny", TrainConfig(seq_len=64, batch=8), budget_bytes=...)
    run = TrainingRun(step)                      # the driver: engine, steps, state

``compile_step`` lowers the step with the family object it is given, prices it (from the
profiling pass and measured links on the device it runs on, ``pricing.price_step``; off
CUDA from declared costs when a cost model is given), plans it (the recompute search over candidates the same family
object re-lowers, then PressureFit), places it, and re-plans inside a slow budget where
the engine's slow pool would not fit the host. The ``CompiledStep`` it returns holds the
step as lowered, the one placement whose plan runs and that plan's step layout: every
consumer (the executables, the engine, checkpoints, predict, measure, verify, export)
takes it, and none looks the family up again or parses a layout back out of metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs

from dataflow import (
    PRESSUREFIT,
    InfeasibleBudget,
    Placement,
    Plan,
    PlannerSpec,
    PlanningError,
    Program,
    format_size,
    kernels,
    place,
    plan,
    resolvers,
)
from dataflow_training.plan.plan_memo import plan_key, plan_options, recall
from dataflow_training.plan.pricing import price_as_compiled
from dataflow_training.plan.recompute import MAX_CANDIDATES, Rewriter, step_planner
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import Family, embed_layer, load_family
from dataflow_training.step.forward_only import lower_forward
from dataflow_training.step.lowering import Lowered, lower

#: the budget used when none is given: large enough never to bind
UNBOUNDED_BYTES = 2**62

#: Host memory kept free beside the page-locked slow pool (``check_backing``): what the
#: process still allocates after the check (CUDA graph capture, staging, Python). The
#: device machine's llama3_8b run at 16 GiB peaked at 98 GiB of host memory with an
#: 80 GiB pool and the 16 GB of starting weights (docs/throughput.md, session 5): the
#: weights are already counted as used when the check reads the available memory.
HOST_RESERVE_BYTES = 8 * 2**30

#: Plans ``compile_step`` and the step search make, at most, to bring the slow pool inside
#: the host (the pool's excess over the slow peak changes with each plan, so one re-plan
#: may fall short): ``fit_slow_budget``
FIT_POOL_TRIES = 3

Made = TypeVar("Made")


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


def pool_limits(
    device: str, pinned_limit_bytes: int | None, weights_to_make_bytes: int = 0
) -> list[tuple[int, str]]:
    """Each limit on the engine's slow pool, with what it is: ``pinned_limit_bytes`` and,
    on CUDA, the host's available memory less ``HOST_RESERVE_BYTES`` and the starting
    weights' host copy not made yet (``weights_to_make_bytes``)."""
    limits = []
    if pinned_limit_bytes is not None:
        limits.append((pinned_limit_bytes, "pinned_limit_bytes"))
    available = available_host_bytes() if device.startswith("cuda") else None
    if available is not None:
        host = available - HOST_RESERVE_BYTES - weights_to_make_bytes
        what = f"the host's available memory less {format_size(HOST_RESERVE_BYTES)}"
        limits.append((host, what))
    return limits


def slow_pool_bytes(placement: Placement) -> int:
    """Bytes of the engine's slow pool for the placed plan (pinned host memory on CUDA):
    a slice for every object that starts slow or is ever offloaded."""
    from dataflow import slow_pool_bytes as pool_of  # loads the torch backend

    return pool_of(placement.plan.program)


@attrs.frozen
class CompiledStep:
    """A training step as planned for one run (module docstring).

    ``lowered`` is the step as lowered (on CUDA, priced by the profiling pass);
    ``running`` the step the placement runs (``placement.plan.program`` with its own
    layout: the recompute planner chose its ``rec`` tasks); ``budget_bytes`` the fast
    budget the engine holds the run to and ``planned_budget_bytes`` the budget its plan
    was made in (on CUDA, less the libraries' reserve and the workspace beside the arena);
    ``backing_bytes`` the slow budget the plan was made in (given, or chosen to fit the
    host: ``pool_note`` says so) and ``pinned_limit_bytes`` the bound on the slow pool;
    ``resolver`` the registered resolver that runs the tasks; ``graph`` whether steps
    after the first replay one CUDA graph; ``fleet`` whether each step all-reduces its
    gradients (a member of a data-parallel fleet); ``priced_for`` what the simulator's
    prediction is for (``cpu (measured)``: the profiling pass on this device; ``cpu
    (declared costs, not measured)``: a cost model the caller gave)."""

    lowered: Lowered
    running: Lowered
    placement: Placement
    device: str
    resolver: str
    budget_bytes: int
    planned_budget_bytes: int
    backing_bytes: int | None
    pinned_limit_bytes: int | None
    graph: bool
    fleet: bool
    priced_for: str
    pool_note: str | None = None

    @property
    def family(self) -> Family:
        return self.lowered.family

    @property
    def config(self) -> Any:
        return self.lowered.config

    @property
    def train(self) -> TrainConfig:
        return self.lowered.layout.train

    @property
    def preset(self) -> str:
        return self.lowered.layout.preset

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.lowered.layout.overrides)

    @property
    def plan(self) -> Plan:
        """The plan that runs (``place`` may have re-planned the first one)."""
        return self.placement.plan

    @property
    def program(self) -> Any:
        return self.placement.plan.program

    @property
    def layout(self) -> Any:
        return self.running.layout

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (the token table's rows in the state, not as stored)."""
        return embed_layer(self.lowered.layers).params[0].state_shape[0]

    @property
    def pinned_bytes(self) -> int:
        return slow_pool_bytes(self.placement)

    def executables(self) -> Any:
        """The registered resolver's executables of the step that runs."""
        return resolvers().get(self.resolver).build(self.running)

    def predicted(self) -> dict[str, float]:
        """The simulator's figures for one step of the plan that runs."""
        sim = self.plan.sim
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


def compile_step(
    family: str | Family,
    preset: str,
    train: TrainConfig,
    *,
    overrides: dict[str, Any] | None = None,
    budget_bytes: int | None = None,
    backing_bytes: int | None = None,
    pinned_limit_bytes: int | None = None,
    device: str = "cpu",
    resolver: str = "torch",
    planner: PlannerSpec | None = None,
    recompute: bool = True,
    graph: bool = True,
    cost: Any = None,
    links: Any = None,
    grad_share: float | None = None,
    keep_grads: bool = False,
    keep_aux_temp: bool = False,
    forward_only: bool = False,
    first_slow_bytes: int | None = None,
) -> CompiledStep:
    """The step of ``family``'s ``preset`` (a registered name, loaded here once, or a
    family object) under ``train``, planned into ``budget_bytes`` (default: unbounded) on
    ``device``.

    ``planner``: a planner spec for the plan (default: the recompute search, or PressureFit
    alone with ``recompute=False``). ``backing_bytes`` bounds the plan's slow memory at
    any moment (its slow peak). The engine's slow pool holds a slice for every object the
    plan ever puts in slow memory, so it is larger than that peak: ``pinned_limit_bytes``
    (default ``backing_bytes``) bounds it, and on CUDA so does the host's available
    memory less ``HOST_RESERVE_BYTES``; without ``backing_bytes``, a plan whose pool
    exceeds those is made again inside a slow budget that fits them (``pool_note``), and
    what still does not fit is refused when the engine loads (``TrainingRun``).
    The step is priced by the profiling pass and measured links on ``device``
    (``price_step``) unless ``cost`` is given off CUDA: then ``cost`` and ``links`` price
    it (a prediction for the hardware they describe, not for this device). ``links``'
    collective link is kept either way; ``graph`` (CUDA only) replays steps from one CUDA graph;
    ``grad_share`` makes the step one member of a data-parallel fleet (``lower``);
    ``keep_grads`` and ``keep_aux_temp`` keep the gradients and AuxTemp for checks;
    ``forward_only`` compiles the step's forward-only variant (``forward_only.lower_forward``:
    what an evaluation runs; nothing saved, so no recompute search). ``first_slow_bytes``
    (without ``backing_bytes``): the slow budget to plan in first, the step search's for
    the chosen shape (``Tried.slow_budget_bytes``), whose plan ``plan_memo`` then holds;
    the host's limits are checked against that plan as against an unbounded one."""
    kernels().check_pins()  # a bad DATAFLOW_KERNELS fails here, not in the first task
    family = load_family(family) if isinstance(family, str) else family
    if forward_only:
        lowered = lower_forward(
            family, preset, train, overrides=dict(overrides or {}), cost=cost, links=links
        )
    else:
        lowered = lower(
            family,
            preset,
            train,
            overrides=dict(overrides or {}),
            keep_grads=keep_grads,
            keep_aux_temp=keep_aux_temp,
            cost=cost,
            links=links,
            grad_share=grad_share,
        )
    on_cuda = device.startswith("cuda")
    graph = graph and on_cuda
    if forward_only:  # another program than the one the search planned
        first_slow_bytes = None
    budget = budget_bytes or UNBOUNDED_BYTES
    searched = planner is None and recompute and not forward_only
    priced = price_as_compiled(
        lowered, resolver, device=device, graph=graph, search=searched, declared=cost is not None
    )
    lowered, rewriter, reserve, beside, priced_for = priced
    # the step search's plan of this very step is taken (``plan_memo``) only where the
    # planner is the one it plans with
    searchable = planner is None
    if planner is None:
        planner = step_planner(rewriter, MAX_CANDIDATES) if searched else PRESSUREFIT
    outside = reserve + beside
    if budget <= outside:
        raise PlanningError(
            f"a budget of {budget} bytes leaves nothing for the arena: the CUDA libraries' "
            f"reserve ({reserve} bytes) and the largest task workspace ({beside} bytes) take "
            "it all"
        )
    program = lowered.program
    cyclic = bool(program.persistent)

    def plan_and_place(slow_budget: int | None) -> Placement:
        options = plan_options(slow_budget, cyclic=cyclic)
        try:
            kept = None
            if searchable:
                kept = recall(plan_key(program, budget - outside, planner.name, options))
            planned = kept or plan(program, budget - outside, planner=planner, **options)
        except InfeasibleBudget as exc:  # in the budget the caller gave
            if not outside:
                raise
            raise InfeasibleBudget(
                exc.program_name,
                budget,
                exc.minimal_budget_bytes + outside,
                exc.task_id,
                exc.footprint_bytes,
                f"{exc.reason} (budgets here include the CUDA libraries' reserve of "
                f"{reserve} bytes and {beside} bytes of task workspace beside the arena)",
            ) from None
        return _placed(planned, rewriter, beside, options)

    pinned_limit = backing_bytes if pinned_limit_bytes is None else pinned_limit_bytes
    pool_note = None
    if backing_bytes is not None:
        placement = plan_and_place(backing_bytes)
    else:
        weights = sum(p.layout.size_bytes for p in lowered.layout.of_kind("W"))
        placement, backing_bytes, pool_note = _fit_pool(
            plan_and_place, pool_limits(device, pinned_limit, weights), first_slow_bytes
        )
    running = running_step(lowered, rewriter, placement.plan.program)
    return CompiledStep(
        lowered=lowered,
        running=running,
        placement=placement,
        device=device,
        resolver=resolver,
        budget_bytes=budget,
        planned_budget_bytes=budget - outside,
        backing_bytes=backing_bytes,
        pinned_limit_bytes=pinned_limit,
        graph=graph,
        fleet=grad_share is not None,
        priced_for=priced_for,
        pool_note=pool_note,
    )


def _placed(
    planned: Plan, rewriter: Rewriter | None, beside: int, options: dict[str, Any]
) -> Placement:
    """``planned`` placed (``place``, with ``beside`` bytes of workspace beside the arena).
    Where fragmentation keeps every packing above the budget and the plan came from the
    recompute search, steps with more blocks recomputed (``_recomputing``) are planned
    by PressureFit at the same budget, and the first that places is kept: ``place``
    re-plans only the step the search chose, which the search took because its
    simulated peak fits. With measured costs the plan's intervals, so its packing, vary
    from run to run: gpt2_tiny at 2 MiB on a CPU packed in 3 of 5 fresh profiles
    without this (the others took 2.15 MB; the search kept no block recomputed)."""
    try:
        return place(planned, workspace_beside_bytes=beside)
    except InfeasibleBudget:
        raise
    except PlanningError as exc:
        fragmented = exc
    for program in _recomputing(rewriter):
        try:
            again = plan(program, planned.budget_bytes, planner=PRESSUREFIT, **options)
            return place(again, workspace_beside_bytes=beside)
        except PlanningError:
            continue
    raise fragmented


def _recomputing(rewriter: Rewriter | None) -> Iterator[Program]:
    """The rewriter's step with its first block, then the first half of its blocks, then
    every block recomputed in every round (nothing without a rewriter)."""
    if rewriter is None:
        return
    blocks = 1 + max((block for _, block in rewriter.all), default=-1)
    for first in sorted({1, blocks // 2, blocks} - {0}):
        units = frozenset(unit for unit in rewriter.all if unit[1] < first)
        yield rewriter.candidate(units).program


def fit_slow_budget(
    plan_in: Callable[[int | None], Made],
    excess: Callable[[Made], int],
    slow_peak: Callable[[Made], int],
    first: int | None = None,
    tries: int = FIT_POOL_TRIES,
) -> tuple[Made, int | None, int | None]:
    """The plan ``plan_in(first)`` (a slow budget; None: unbounded) and, while its
    ``excess`` over the host is positive, the plan made again inside a slow budget of its
    ``slow_peak`` less that excess, at most ``tries`` times (a budget of nothing, or one
    nothing plans in, ends it: the last plan is kept). The one rule by which
    ``compile_step`` and the step search fit a plan to the host's memory. Returns the
    plan, the slow budget it was made in and the excess that made it (None: the first).
    ``plan_in(first)`` raising is the caller's to handle."""
    made, slow, over = plan_in(first), first, None
    for _ in range(tries):
        bytes_over = excess(made)
        smaller = slow_peak(made) - bytes_over
        if bytes_over <= 0 or smaller <= 0:
            break
        try:
            made = plan_in(smaller)
        except PlanningError:  # no plan inside it: keep the last that planned
            break
        slow, over = smaller, bytes_over
    return made, slow, over


def _fit_pool(
    plan_and_place: Callable[[int | None], Placement],
    limits: list[tuple[int, str]],
    first: int | None = None,
) -> tuple[Placement, int | None, str | None]:
    """Without a given slow budget the plan's slow memory is unbounded (or ``first``, the
    step search's); where its pool would not fit the tightest of ``limits`` (the host, on
    CUDA), plan again inside a slow budget that leaves room for the pool's excess over the
    slow peak (a slice per object, ``fit_slow_budget``), so the run fits the host instead
    of being refused. Returns the placement, the slow budget it was made in (None:
    unbounded) and a note saying why. What still does not fit is refused when the engine
    loads (``TrainingRun.check_backing``). A ``first`` nothing plans in is dropped."""
    limit, what = min(limits) if limits else (None, "")

    def excess(placement: Placement) -> int:
        return 0 if limit is None else slow_pool_bytes(placement) - limit

    def slow_peak(placement: Placement) -> int:
        return placement.plan.sim.slow_peak_bytes

    try:
        placement, backing, over = fit_slow_budget(plan_and_place, excess, slow_peak, first)
    except PlanningError:
        if first is None:
            raise
        placement, backing, over = fit_slow_budget(plan_and_place, excess, slow_peak)
    note = None
    if over is not None:
        note = (
            f"a slow pool of {format_size(over + limit)} would not fit the {format_size(limit)} "
            f"allowed ({what}): planned inside a slow budget of {format_size(backing)}"
        )
    elif backing is not None:
        note = (
            f"planned inside the step search's slow budget of {format_size(backing)}: the "
            "host's memory holds no plan without one"
        )
    return placement, backing, note


def running_step(lowered: Lowered, rewriter: Rewriter | None, program: Any) -> Lowered:
    """The step whose program is ``program`` (a plan of ``lowered`` or of one of its
    recompute candidates): that program with the layout of the candidate the planner
    chose (the lowered step's own where its tasks are the lowered ones)."""
    if rewriter is None and [t.id for t in program.tasks] == [t.id for t in lowered.program.tasks]:
        return lowered.with_program(program)  # no search, no rec tasks: the lowered layout
    return (rewriter or Rewriter(lowered)).step_of(program)
