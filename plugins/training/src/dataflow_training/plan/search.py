"""The step search: the fastest shape of a training step the simulator finds for a preset,
a fast budget, a device and the host's memory.

A **shape** is what ``dataflow train`` can choose without changing what is learnt per
token: the tokens per optimizer step split into ``batch`` x ``rounds`` micro-batches,
the task order (``round``, ``layer``, ``layer:K``), where the updates run (``early``,
``end``), whether the head's weight gradient is made by vocabulary tiles, the pieces the
largest tables are cut in (``PIECES``) and the resolver that runs the tasks. The
recompute assignment is searched inside each plan by the recompute planner, as
``compile_step`` plans any step.

Each candidate is lowered and priced as ``compile_step`` prices a step
(``pricing.price_as_compiled``: the profiling pass through its cache, or a cost model
the caller gave off CUDA), then
bounded: a steady-state iteration can be no shorter than its tasks' compute, nor than
the time the link needs to bring in the persistent objects (weights, gradients,
optimizer state) that do not fit the budget. Candidates are planned best bound first;
one whose bound cannot beat the best plan so far by more than ``TIE`` is not planned
(branch and bound: the search is exact up to ``TIE``, and deterministic). A planned
candidate whose host memory (the engine's slow pool, the starting weights' host copy,
on a CPU the fast arena, and ``HOST_RESERVE_BYTES`` on CUDA) exceeds the host's
available memory is planned again inside a slow budget that leaves the pool room
(``compiled_step.fit_slow_budget``, as ``compile_step`` fits its plan); one that still
exceeds it is not chosen, and no shape holding as many sequences' saved context at once
(``Shape.live_sequences``) is planned after it. Once a plan has needed a slow budget,
later candidates are planned straight inside the one the host leaves
(``Searcher.host_slow_budget``), then fitted the same way: the unbounded plan, which
the host would not hold either, is not made first. The chosen candidate carries the
slow budget of its plan (``Tried.slow_budget_bytes``), so that ``compile_step`` plans
there first and finds every plan the search made of it (``keep_plan``, ``plan_memo``).

The pieces (``PIECES``: the vocabulary tables' rows, ``TrainConfig.vocab_pieces``, and
each layer's routed experts, the model override ``expert_shards``) are chosen apart from
the rest, since more of them only pays where a table's update is what the budget cannot
hold (Qwen 3.5's 248,320-row head: its update holds 8.1 GB; docs/throughput.md: at
16 GiB four pieces priced 1.7 % slower than one, at 8 GiB only pieces plan). Every
candidate has the fewest pieces (doubling whichever of the two lowers the one-round
step's largest task more: ``Searcher.finer``) whose largest task fits the arena, doubled
only while that lowers the largest task and the step allows them. The chosen shape then
tries finer pieces, again while that lowers its largest task, and takes them while they
plan faster by more than ``TIE`` (room to stream beside the update: a tie keeps the
fewer); where no shape plans, the search runs again with finer pieces, on the same
terms.

Without a given number of tokens per step the search takes the smallest whose best
shape reaches ``GOOD_ENOUGH`` of the best throughput found, up to the preset's
published batch (``published_tokens``): larger steps amortize the weights' and
optimizer state's streaming over more tokens, smaller ones train better per token.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from typing import Any

import attrs

from dataflow import PRESSUREFIT, InfeasibleBudget, PlanningError, format_size, plan
from dataflow_training.plan.compiled_step import (
    FIT_POOL_TRIES,
    HOST_RESERVE_BYTES,
    UNBOUNDED_BYTES,
    fit_slow_budget,
)
from dataflow_training.plan.plan_memo import plan_key, plan_options, remember
from dataflow_training.plan.pricing import PricedStep, price_as_compiled
from dataflow_training.plan.recompute import MAX_CANDIDATES, QUICK, step_planner
from dataflow_training.plan.search_jobs import Ahead, search_jobs
from dataflow_training.plan.shapes import (
    Pins,
    Shape,
    resolver_options,
    same_tasks,
    shapes,
    token_options,
)
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.lowering import Lowered, lower

#: A candidate whose bound is within this fraction of the best plan found is not planned:
#: it could be at most that much faster (a plan of everything in the budget is within a
#: fraction of a percent of its compute bound, so ties would otherwise all be planned)
TIE = 0.005

#: Plans made, at most, for a runner-up where the bounds pruned every other shape (the
#: search line names one)
RUNNER_UP_PLANS = 2

#: The smallest tokens per step whose best shape reaches this fraction of the best
#: throughput found is the default (issue 44: "97 % of the best")
GOOD_ENOUGH = 0.97

#: The most plans one search makes, best bound first (a deterministic cut: the search
#: ends in seconds for a small model and stays bounded for a large one)
MAX_PLANS = 8

#: The pieces a step's largest tasks can be cut in (``Shape`` fields): the vocabulary
#: tables' rows and each layer's routed experts
PIECES = ("vocab_pieces", "expert_shards")

#: Plans made for each smaller number of tokens per step (``GOOD_ENOUGH``)
SMALLER_PLANS = 2


@attrs.frozen
class Pricing:
    """How candidates are priced: as ``compile_step`` prices a step on ``device``
    (``price_as_compiled``), or, with ``measure`` (a step -> task profiles function, e.g. a
    profile archive's lookup), from those profiles with ``reserve_bytes`` left for the
    device's libraries; ``cost`` and ``links`` as ``lower`` takes them (a hardware
    entry's roofline, for ``dataflow predict --hw``)."""

    device: str = "cpu"
    graph: bool = True
    recompute: bool = True
    cost: Any = None
    links: Any = None
    measure: Callable[[Lowered], dict] | None = None
    reserve_bytes: int = 0
    #: what ``measure`` prices by (e.g. its profile cache's key), for the search cache
    #: (``search_cache``); None: a search priced by it is not kept
    measured_by: str | None = None

    def identity(self, family: Any, resolver_names: list[str]) -> dict[str, Any] | None:
        """What the prices of ``family``'s steps run by ``resolver_names`` depend on, for
        the search cache's key: a cost model's and its links' values, or the profile
        cache's key for each resolver (the device, the kernels and their code), or
        ``measured_by``; None where that is unknown (the profile cache off)."""
        on_cuda = self.device.startswith("cuda")
        known: dict[str, Any] = {
            "device": self.device,
            "graph": self.graph and on_cuda,
            "recompute": self.recompute,
            "reserve_bytes": self.reserve_bytes,
            "links": repr(self.links),
        }
        if self.measure is not None:
            return None if self.measured_by is None else {**known, "measured": self.measured_by}
        if self.cost is not None and not on_cuda:  # declared: price_as_compiled keeps it
            return {**known, "cost": repr(self.cost)}
        from dataflow_training.plan.profile import ProfileCache  # loads torch

        caches = [
            ProfileCache.for_device(self.device, name, graph=self.graph and on_cuda, family=family)
            for name in resolver_names
        ]
        if any(cache is None for cache in caches):
            return None
        return {**known, "profiles": [cache.context for cache in caches]}

    def priced(self, step: Lowered, resolver: str, rewrite: bool = True) -> PricedStep:
        """``step`` priced, with the recompute rewriter where ``rewrite`` (and
        ``recompute``)."""
        rewrite = rewrite and self.recompute
        if self.measure is None:
            return price_as_compiled(
                step,
                resolver,
                device=self.device,
                graph=self.graph,
                search=rewrite,
                declared=self.cost is not None,
            )
        # torch loads with a profile: the search module reads without it
        from dataflow_training.plan.profile import apply_profile, without_workspace
        from dataflow_training.plan.recompute import measured_rewriter

        largest = [0]

        def measured(candidate: Lowered) -> dict:
            found, most = without_workspace(self.measure(candidate))
            largest[0] = max(largest[0], most)
            return found

        profiles = measured(step)
        step = step.with_program(apply_profile(step, profiles))
        rewriter = measured_rewriter(step, measured, known=profiles) if rewrite else None
        return PricedStep(step, rewriter, self.reserve_bytes, largest[0], "the profiles given")


@attrs.frozen
class Tried:
    """A candidate as the search saw it: its bound (tokens/s no plan beats), and once
    planned its predicted tokens/s and host memory, or why it cannot run."""

    shape: Shape
    bound_tok_s: float
    tok_s: float | None = None
    host_bytes: int | None = None
    reason: str | None = None
    #: the reason is the host's memory (the plan fits the fast budget)
    host_bound: bool = False
    #: where the budget is too small: a budget that is not (or no smaller does)
    least_budget_bytes: int | None = None
    #: the slow budget its plan was made in, where the host's memory called for one
    #: (None: unbounded, or the backing budget given): ``compile_step``'s first
    slow_budget_bytes: int | None = None


@attrs.frozen
class Searched:
    """What the search found: the chosen shape, the runner-up (None where no other
    runs), every candidate tried, the seconds it took, the sequence length and why, and
    where nothing runs, the one line that says what would."""

    seq_len: int
    seq_note: str
    chosen: Tried | None
    runner_up: Tried | None
    tried: tuple[Tried, ...]
    search_s: float
    candidates: int
    tokens_note: str
    nothing_fits: str | None = None
    #: read from the search cache (``search_cache``): ``search_s`` is the search's own
    from_cache: bool = False

    def from_the_cache(self) -> Searched:
        return attrs.evolve(self, from_cache=True)

    def line(self) -> str:
        """``search: batch 8 x 4 rounds (...), ... predicted 12,345 tok/s; runner-up ...``"""
        cached = "; from the search cache" if self.from_cache else ""
        if self.chosen is None:
            return f"search: {self.nothing_fits}{cached}"
        planned = sum(1 for t in self.tried if t.tok_s is not None or t.reason is not None)
        text = (
            f"search: seq {self.seq_len} ({self.seq_note}); {self.chosen.shape.text()}: "
            f"predicted {self.chosen.tok_s:,.0f} tok/s"
        )
        if self.runner_up is not None:
            text += f"; runner-up {self.runner_up.shape.text()}: {self.runner_up.tok_s:,.0f} tok/s"
        return (
            f"{text}; {self.tokens_note}; {planned} of {self.candidates} candidates planned "
            f"in {self.search_s:.1f} s{cached}"
        )


class Searcher:
    """The search over one preset, budget and device (module docstring); ``step`` and
    ``plan_of`` keep what they made, so the chosen shape's step is not lowered again."""

    def __init__(
        self,
        family: Any,
        preset: str,
        base: TrainConfig,
        *,
        budget_bytes: int | None,
        overrides: dict[str, Any] | None = None,
        pricing: Pricing = Pricing(),
        host_bytes: int | None = None,
        backing_bytes: int | None = None,
    ) -> None:
        self.family, self.preset, self.base = family, preset, base
        self.budget = budget_bytes or UNBOUNDED_BYTES
        self.overrides = dict(overrides or {})
        self.pricing, self.host_bytes, self.backing_bytes = pricing, host_bytes, backing_bytes
        self._priced: dict[tuple[Shape, bool], PricedStep] = {}
        #: every plan made of a shape's ``Tried``: (plan options, the plan)
        self._plans: dict[Shape, list[tuple[dict[str, Any], Any]]] = {}

    def lowered(self, shape: Shape, rewrite: bool = True) -> PricedStep:
        """``shape``'s step lowered and priced (kept: each is made once)."""
        key = (shape, rewrite)
        if key not in self._priced:
            lowered = lower(
                self.family,
                self.preset,
                shape.train(self.base),
                overrides=shape.overrides(self.overrides),
                cost=self.pricing.cost,
                links=self.pricing.links,
            )
            self._priced[key] = self.pricing.priced(lowered, shape.resolver, rewrite)
        return self._priced[key]

    def streams(self, shape: Shape) -> bool:
        """Whether ``shape``'s persistent objects (weights, optimizer state) exceed the
        budget, so that some cross the link every step."""
        priced = self.lowered(same_tasks(shape, 1), rewrite=False)
        return self._excess(priced) > 0

    def arena(self, shape: Shape) -> int:
        """The fast bytes a plan of ``shape`` has: the budget less the libraries' reserve
        and the workspace beside the arena."""
        priced = self.lowered(same_tasks(shape, 1), rewrite=False)
        return self.budget - priced.reserve_bytes - priced.workspace_beside_bytes

    def largest_task(self, shape: Shape) -> int | None:
        """The bytes of the largest task of ``shape``'s one-round step (``task_floor_bytes``);
        None where its pieces are refused (``step.pieces``: an optimizer not element by
        element, a padded table, a count that does not divide the rows; an expert shard
        count that does not divide the experts)."""
        try:
            one = self.lowered(same_tasks(shape, 1), rewrite=False)
        except ValueError:
            if shape.vocab_pieces == 1 and shape.expert_shards == 0:
                raise
            return None
        return task_floor_bytes(one.step.program)

    def expert_shards(self, shape: Shape) -> int | None:
        """The shards ``shape``'s step runs each layer's experts in, None for a model
        without routed experts (no ``expert_shards`` in its config)."""
        one = self.lowered(same_tasks(shape, 1), rewrite=False).step
        if not hasattr(one.config, "expert_shards"):
            return None
        shards = [g.shard[1] for layer in one.layers for g in layer.groups if g.shard]
        return max(shards, default=1)

    def finer(self, shape: Shape, free: frozenset[str] = frozenset(PIECES)) -> Shape | None:
        """``shape`` with twice its vocabulary pieces or twice its experts' shards (of
        ``free``), whichever lowers its largest task more (the vocabulary's on a tie),
        where allowed; None where neither lowers it."""
        options = []
        if "vocab_pieces" in free:
            options.append(attrs.evolve(shape, vocab_pieces=shape.vocab_pieces * 2))
        shards = self.expert_shards(shape) if "expert_shards" in free else None
        if shards is not None:
            options.append(attrs.evolve(shape, expert_shards=shards * 2))
        now = self.largest_task(shape)
        lower = [(largest, i) for i, more in enumerate(options)
                 if (largest := self.largest_task(more)) is not None and largest < now]  # fmt: skip
        return options[min(lower)[1]] if lower else None

    def fewest_pieces(self, shape: Shape, free: frozenset[str] = frozenset(PIECES)) -> Shape:
        """``shape`` with the fewest pieces (``finer``, doubling) whose largest task fits
        the arena, or as few as lower it no further."""
        while self.largest_task(shape) > self.arena(shape):
            more = self.finer(shape, free)
            if more is None:
                break
            shape = more
        return shape

    def _excess(self, priced: PricedStep) -> int:
        program = priced.step.program
        sizes = program.objects_by_id
        persistent = sum(sizes[name].size_bytes for name in program.persistent)
        return persistent - (self.budget - priced.reserve_bytes - priced.workspace_beside_bytes)

    def bound(self, shape: Shape) -> float:
        """Tokens/s no plan of ``shape`` beats: the compute of its tasks (recompute only
        adds to it) and the link time of the persistent bytes beyond the budget. The
        compute of ``rounds`` rounds is that of one round times the rounds plus that of
        the step's once-a-step tasks, both read from the steps of one and two rounds of
        the same batch (in round order: the order moves tasks, it adds none), so a
        bound costs two small lowerings per batch, not one per candidate."""
        one, two = (self.lowered(same_tasks(shape, rounds), rewrite=False) for rounds in (1, 2))
        if task_floor_bytes(one.step.program) > self.arena(shape):
            return 0.0  # one of its tasks alone does not fit: never planned
        compute = [sum(task.cost_us for task in s.step.program.tasks) for s in (one, two)]
        per_round = compute[1] - compute[0]
        compute_us = compute[0] + per_round * (shape.rounds - 1)
        link_us = max(0, self._excess(one)) / one.step.program.links.h2d.bw_bytes_per_us
        step_us = max(compute_us, link_us)
        return shape.tokens_step / (step_us / 1e6) if step_us > 0 else math.inf

    def too_small(self, shape: Shape) -> Tried:
        """``shape`` refused for a task that alone exceeds the budget (its 1-round step's:
        every round's tasks are the same)."""
        floor = task_floor_bytes(self.lowered(same_tasks(shape, 1), rewrite=False).step.program)
        arena = self.arena(shape)
        return Tried(
            shape,
            0.0,
            reason=f"one task alone holds {format_size(floor)}, more than the "
            f"{format_size(max(0, arena))} the plan has",
            least_budget_bytes=self.budget - arena + floor,
        )

    def try_shape(self, shape: Shape, bound: float, straight: bool = False) -> Tried:
        """Plan ``shape`` as ``compile_step`` would, and check the host's memory
        (``fit_slow_budget``: planned again inside a slow budget where it exceeds it);
        with ``straight``, planned first inside the slow budget the host leaves
        (``host_slow_budget``): where nothing plans there the host holds no plan of it
        (a plan that fits the host has a slow pool, so a slow peak, inside that budget),
        and its unbounded plan is not made. Where it does not fit the budget, the
        smallest that would is not searched for (``least_budget`` finds it, for the one
        line that says what would). Every plan made is kept (``keep_plan``)."""
        plans: list[tuple[dict[str, Any], Any]] = []
        self._plans[shape] = plans
        step, rewriter, reserve, beside, _ = self.lowered(shape)
        program = step.program
        arena = self.budget - reserve - beside
        if arena < 1:
            return Tried(shape, bound, reason="the libraries' reserve and workspace take it all")
        floor = task_floor_bytes(program)
        if floor > arena:  # no plan at all: not worth the planner's search for the minimum
            return Tried(
                shape,
                bound,
                reason=f"one task alone holds {format_size(floor)}, more than the "
                f"{format_size(arena)} the plan has",
                least_budget_bytes=self.budget - arena + floor,
            )
        planner = (
            step_planner(rewriter, MAX_CANDIDATES, explain=False) if rewriter is not None else QUICK
        )

        def planned_in(slow_budget: int | None) -> Any:
            options = plan_options(slow_budget, cyclic=bool(program.persistent))
            made = plan(program, arena, planner=planner, **options)
            plans.append((options, made))
            return made

        def excess(planned: Any) -> int:
            if self.host_bytes is None:
                return 0
            return self.host_need(step, planned) - self.host_bytes

        def slow_peak(planned: Any) -> int:
            return planned.sim.slow_peak_bytes

        tries = FIT_POOL_TRIES if self.backing_bytes is None else 0
        first = self.host_slow_budget(shape) if straight else None
        try:
            planned, slow, _ = fit_slow_budget(
                planned_in, excess, slow_peak, first or self.backing_bytes, tries
            )
        except PlanningError as exc:
            if first is not None:  # the host holds no plan of it: its slow pool would not fit
                reason = (
                    f"no plan fits the {format_size(first)} of slow memory the host's "
                    f"{format_size(self.host_bytes)} leave ({one_line(str(exc))})"
                )
                return Tried(shape, bound, reason=reason, host_bound=True)
            if isinstance(exc, InfeasibleBudget):
                least = self.budget - arena + exc.minimal_budget_bytes
                return Tried(shape, bound, reason=one_line(str(exc)), least_budget_bytes=least)
            return Tried(shape, bound, reason=one_line(str(exc)))
        need = self.host_need(step, planned)
        slow = None if slow == self.backing_bytes else slow
        step_us = (
            planned.cycle.iteration_us if planned.cycle is not None else planned.sim.makespan_us
        )
        tok_s = shape.tokens_step / (step_us / 1e6)
        if self.host_bytes is not None and need > self.host_bytes:
            reason = (
                f"needs {format_size(need)} of host memory, {format_size(self.host_bytes)} "
                "available"
            )
            return Tried(shape, bound, tok_s, need, reason, True, slow_budget_bytes=slow)
        return Tried(shape, bound, tok_s, need, slow_budget_bytes=slow)

    def host_slow_budget(self, shape: Shape) -> int | None:
        """The slow budget the host leaves a plan of ``shape``: its memory less what
        ``host_need`` counts beside the slow pool (the starting weights' copy, and on
        CUDA ``HOST_RESERVE_BYTES``, on a CPU the whole fast arena). None without a host
        limit, with a backing budget given, or where nothing is left."""
        if self.host_bytes is None or self.backing_bytes is not None:
            return None
        step, _, reserve, beside, _ = self.lowered(shape)
        left = self.host_bytes - self._beside_pool(step, self.budget - reserve - beside)
        return left if left > 0 else None

    def plans_of(self, shape: Shape) -> list[tuple[dict[str, Any], Any]]:
        """Every plan made of ``shape``'s last ``Tried``: (plan options, the plan, or
        from a worker the plan pickled without its planner: ``adopt``)."""
        return self._plans.get(shape, [])

    def adopt(self, shape: Shape, plans: list[tuple[dict[str, Any], Any]]) -> None:
        """Take ``plans`` (``plans_of`` a worker's ``Tried`` of ``shape``: ``search_jobs``)
        as this searcher's own."""
        self._plans[shape] = list(plans)

    def keep_plan(self, shape: Shape) -> None:
        """Leave every plan made of ``shape``'s ``Tried`` for ``compile_step``
        (``plan_memo``): the one its figures are of, and any it was fitted from (one a
        worker made read back, with the planner ``try_shape`` gives it)."""
        step, rewriter, reserve, beside, _ = self.lowered(shape)
        arena = self.budget - reserve - beside
        planner = (
            step_planner(rewriter, MAX_CANDIDATES, explain=False) if rewriter is not None else QUICK
        )
        for options, made in self.plans_of(shape):
            if isinstance(made, bytes):
                made = attrs.evolve(pickle.loads(made), spec=planner)
            remember(plan_key(step.program, arena, planner.name, options), made)

    def least_budget(self, shape: Shape) -> int | None:
        """The smallest budget (the whole, as ``--budget`` takes it) that plans ``shape``,
        as the planner's own search for it finds (None where that fails otherwise): a
        search that can take minutes for a large model, made once where nothing fits."""
        step, rewriter, reserve, beside, _ = self.lowered(shape)
        arena = self.budget - reserve - beside
        planner = step_planner(rewriter, MAX_CANDIDATES) if rewriter is not None else PRESSUREFIT
        try:
            program = step.program
            plan(program, arena, planner=planner, slow_budget_bytes=self.backing_bytes,
                 cyclic=bool(program.persistent))  # fmt: skip
        except InfeasibleBudget as exc:
            return self.budget - arena + exc.minimal_budget_bytes
        except PlanningError:
            return None
        return None  # it plans after all (the quick search missed it): no floor to name

    def host_need(self, step: Lowered, planned: Any) -> int:
        """Host bytes the run holds: the engine's slow pool, the starting weights' host
        copy, on a CPU the fast arena too (both are host memory there), and on CUDA
        ``HOST_RESERVE_BYTES`` (graph capture, staging, Python)."""
        from dataflow import slow_pool_bytes  # loads the torch backend

        return slow_pool_bytes(planned.program) + self._beside_pool(
            step, planned.sim.fast_peak_bytes
        )

    def _beside_pool(self, step: Lowered, fast_peak_bytes: int) -> int:
        """What ``host_need`` counts beside the slow pool (``fast_peak_bytes``: on a CPU
        the fast arena's peak, host memory there too)."""
        weights = sum(p.layout.size_bytes for p in step.layout.of_kind("W"))
        if self.pricing.device.startswith("cuda"):
            return weights + HOST_RESERVE_BYTES
        return weights + fast_peak_bytes


def task_floor_bytes(program: Any) -> int:
    """The most bytes one task holds at once (its inputs, outputs and workspace): no
    fast budget below it can run the step."""
    sizes = program.objects_by_id
    return max(
        (
            sum(sizes[name].size_bytes for name in {*t.inputs, *t.mutates, *t.outputs})
            + t.workspace_bytes
            for t in program.tasks
        ),
        default=0,
    )


def one_line(text: str) -> str:
    return " ".join(text.split())


def search(
    searcher: Searcher,
    seq_len: int,
    seq_note: str,
    pins: Pins,
    *,
    cap: tuple[int, str],
    clip: float | None,
    max_plans: int = MAX_PLANS,
    jobs: int | None = None,
) -> Searched:
    """The fastest shape (module docstring). ``cap``: the default tokens per step's cap
    and its source; ``max_plans`` bounds the plans made (best bound first), so a search
    ends in seconds whatever the space; ``jobs``: processes planning candidates at once
    (``search_jobs``; default ``$DATAFLOW_SEARCH_JOBS``, else the CPUs), the choice the
    same whatever it is."""
    ahead = Ahead(searcher, search_jobs(searcher.pricing.device) if jobs is None else jobs)
    try:
        return _search(
            searcher, seq_len, seq_note, pins, cap=cap, clip=clip, max_plans=max_plans,
            ahead=ahead, free=frozenset(n for n in PIECES if getattr(pins, n) is None),
        )  # fmt: skip
    finally:
        ahead.close()


def _search(
    searcher: Searcher,
    seq_len: int,
    seq_note: str,
    pins: Pins,
    *,
    cap: tuple[int, str],
    clip: float | None,
    max_plans: int,
    ahead: Ahead,
    free: frozenset[str],
) -> Searched:
    """The search of ``search``; ``free``: the pieces (of ``PIECES``) that are the
    search's (``pins``' figures for them, where given, the fewest it tries)."""
    started = time.perf_counter()
    device = searcher.pricing.device
    names = [pins.resolver] if pins.resolver else resolver_options(device)
    config = searcher.family.config(searcher.preset, **searcher.overrides)
    vocab = getattr(config, "vocab_size", 0) or 0
    dim = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0
    # the head's float32 (vocab, dim) table, a quarter of the budget or more: tiles may pay
    # (Llama 3 8B's 2.1 GB at 8 GiB, not at 16; docs/usage.md --head-vocab-tiles)
    tiles = vocab * dim * 4 * 4 >= searcher.budget
    options = token_options(seq_len, pins, cap[0])
    start = Shape(
        seq_len, 1, 1, "round", "end", False, names[0], pins.vocab_pieces or 1,
        pins.expert_shards or 0,
    )  # fmt: skip
    start = searcher.fewest_pieces(start, free)
    streams = searcher.streams(start)
    candidates = shapes(
        seq_len, options, pins, clip=clip, tiles=tiles, resolver_names=names, streams=streams,
        pieces=(start.vocab_pieces, start.expert_shards),
    )  # fmt: skip
    if not candidates:
        raise ValueError(_no_shape(pins, seq_len))
    bounds = {shape: searcher.bound(shape) for shape in candidates}
    tried: dict[Shape, Tried] = {}

    def best_of(pool: list[Shape], floor: float, limit: int) -> Tried | None:
        """The fastest runnable shape of ``pool`` (best bound first, at most ``limit``
        new plans; pruned where the bound cannot beat the best so far, or ``floor``, by
        more than ``TIE``)."""
        best: Tried | None = None
        order = sorted(pool, key=lambda s: (-bounds[s], s))
        for index, shape in enumerate(order):
            if bounds[shape] <= 0:  # a task alone exceeds the budget (``Searcher.bound``)
                if not tried:  # what the nothing-fits line names
                    tried[shape] = searcher.too_small(shape)
                break
            host_bound = [t.shape.live_sequences for t in tried.values() if t.host_bound]
            if host_bound and shape.live_sequences >= min(host_bound):
                continue  # holds as much as one the host's memory could not: not planned
            target = max(floor, best.tok_s if best is not None else 0.0)
            if bounds[shape] <= target * (1 + TIE) and (best is not None or floor > 0):
                break
            if shape not in tried:
                if limit <= 0:
                    break
                limit -= 1
                pruning = best is not None or floor > 0
                later = next_plans(order[index + 1 :], target if pruning else 0.0, limit)
                tried[shape] = ahead.tried(shape, bounds[shape], _host_binds(tried), later)
            found = tried[shape]
            if found.reason is None and (best is None or _faster(found, best)):
                best = found
        return best

    def next_plans(rest: list[Shape], target: float, limit: int) -> list[tuple[Shape, float]]:
        """The shapes of ``rest`` (best bound first) ``best_of`` plans next, at most
        ``limit``, where the plans under way change nothing: what ``ahead`` plans
        meanwhile."""
        host_bound = [t.shape.live_sequences for t in tried.values() if t.host_bound]
        found: list[tuple[Shape, float]] = []
        for shape in rest:
            if len(found) >= limit or bounds[shape] <= max(0.0, target * (1 + TIE)):
                break
            if shape not in tried and not (host_bound and shape.live_sequences >= min(host_bound)):
                found.append((shape, bounds[shape]))
        return found

    best = best_of(candidates, 0.0, max_plans)
    more = searcher.finer(start, free) if best is None else None
    if more is not None:  # nothing plans: the same search with twice the pieces
        finer = attrs.evolve(pins, vocab_pieces=more.vocab_pieces, expert_shards=more.expert_shards)
        return _search(
            searcher, seq_len, seq_note, finer, cap=cap, clip=clip, max_plans=max_plans,
            ahead=ahead, free=free,
        )  # fmt: skip
    if best is None:
        refused = [t for t in tried.values() if t.reason is not None]
        if refused and not any(t.host_bound or t.least_budget_bytes for t in refused):
            first = refused[0]  # the best bound: its floor is what the line names
            least = searcher.least_budget(first.shape)
            tried[first.shape] = attrs.evolve(first, least_budget_bytes=least)
        elapsed = time.perf_counter() - started
        line = nothing_fits(searcher, list(tried.values()), seq_len, pins, free)
        return Searched(
            seq_len, seq_note, None, None, tuple(tried.values()), elapsed, len(candidates),
            "", line,
        )  # fmt: skip
    chosen = best
    tokens_note = f"{best.shape.tokens_step:,} tokens/step" + (
        " (given)" if pins.tokens_step is not None or pins.batch and pins.rounds else f" ({cap[1]})"
    )
    if pins.tokens_step is None and len(options) > 1:
        good = GOOD_ENOUGH * best.tok_s
        for tokens in sorted(options):
            if tokens >= best.shape.tokens_step:
                break
            pool = [s for s in candidates if s.tokens_step == tokens]
            smaller = best_of(pool, good * (1 - TIE), SMALLER_PLANS)
            if smaller is not None and smaller.tok_s >= good:
                chosen = smaller
                break
        tokens_note = (
            f"{chosen.shape.tokens_step:,} tokens/step: the fewest within "
            f"{GOOD_ENOUGH:.0%} of the best found ({best.tok_s:,.0f} tok/s), up to "
            f"{cap[0]:,} ({cap[1]})"
        )
    while free:  # the chosen shape with more pieces, while they plan faster by TIE
        finer = searcher.finer(chosen.shape, free)
        if finer is None:
            break
        if finer not in tried:
            tried[finer] = ahead.tried(finer, searcher.bound(finer), _host_binds(tried))
        if tried[finer].reason is not None or tried[finer].tok_s <= chosen.tok_s * (1 + TIE):
            break
        chosen = tried[finer]
    runnable = [t for t in tried.values() if t.reason is None and t.shape != chosen.shape]
    if not runnable:  # every other bound pruned: the best-bounded of them planned to show
        for shape in sorted(candidates, key=lambda s: (-bounds[s], s))[: RUNNER_UP_PLANS + 1]:
            if shape not in tried and bounds[shape] > 0:
                tried[shape] = ahead.tried(shape, bounds[shape], _host_binds(tried))
                if tried[shape].reason is None:
                    runnable = [tried[shape]]
                    break
    runner_up = min(runnable, key=lambda t: (-t.tok_s, t.shape)) if runnable else None
    return Searched(
        seq_len,
        seq_note,
        chosen,
        runner_up,
        tuple(tried.values()),
        time.perf_counter() - started,
        len(candidates),
        tokens_note,
    )


def _host_binds(tried: dict[Shape, Tried]) -> bool:
    """Whether a plan made so far needed more host memory than the host has (the later
    ones are planned straight inside the slow budget it leaves: ``Searcher.try_shape``)."""
    return any(t.host_bound or t.slow_budget_bytes is not None for t in tried.values())


def _faster(one: Tried, other: Tried) -> bool:
    return (-one.tok_s, one.shape) < (-other.tok_s, other.shape)


def _no_shape(pins: Pins, seq_len: int) -> str:
    given = {k: v for k, v in attrs.asdict(pins).items() if v is not None}
    return (
        f"no step shape has the pinned {given} at --seq-len {seq_len}: --tokens-per-step "
        "must be a multiple of --seq-len x --batch (x --ga-rounds where given)"
    )


def nothing_fits(
    searcher: Searcher,
    tried: list[Tried],
    seq_len: int,
    pins: Pins,
    free: frozenset[str] = frozenset(PIECES),
) -> str:
    """The one line where no candidate runs: why (the host's memory, or the budget) and
    what would: a larger budget, a shorter sequence, layer order, more vocabulary pieces
    (where pinned), smaller optimizer states."""
    host = [t for t in tried if t.host_bound]
    budget = format_size(searcher.budget) if searcher.budget < UNBOUNDED_BYTES else "unbounded"
    would = []
    if host:
        why = (
            f"every step that fits the {budget} budget needs more host memory than the "
            f"{format_size(searcher.host_bytes)} available"
        )
        planned = [t for t in host if t.host_bytes is not None]  # else none plans in it
        if planned:
            least = min(planned, key=lambda t: (t.host_bytes, t.shape))
            why += f" (least: {format_size(least.host_bytes)}, {least.shape.text()})"
        would.append("a larger --budget (less offloaded to the host)")
    else:
        least = [t.least_budget_bytes for t in tried if t.least_budget_bytes is not None]
        why = f"no step fits the {budget} budget"
        would.append(
            f"a --budget of at least {format_size(min(least))}" if least else "a larger --budget"
        )
    if seq_len > 1:
        would.append(f"a shorter --seq-len (e.g. {max(1, seq_len // 2)})")
    if pins.order == "round":  # else the search tried layer orders where weights stream
        would.append("--order layer")
    pinned = frozenset(PIECES) - free
    more = searcher.finer(tried[0].shape, pinned) if pinned and tried else None
    if more is not None:  # pinned pieces the search would have made finer
        if more.vocab_pieces != tried[0].shape.vocab_pieces:
            would.append(f"--vocab-pieces {more.vocab_pieces} (a smaller vocabulary update)")
        else:
            would.append(f"--expert-shards {more.expert_shards} (smaller expert tasks)")
    optimizer = searcher.base.optimizer
    wider = any(dtype == "float32" for dtype in optimizer.state_dtypes.values())
    if optimizer.name == "adamw":  # its moments may be bf16 (if float32) or int8
        would.append(f"--optimizer-states {'bf16 or int8' if wider else 'int8'}")
    elif wider and optimizer.name != "adamw_int8":
        would.append("--optimizer-states bf16")
    return f"nothing fits: {why}; what would: {', '.join(would)}"
