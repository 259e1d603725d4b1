"""PressureFit: write a bare chain's directives so it runs within a fast-memory budget.

It reads only task order, object sizes, lifetimes, task costs and link speeds. For each
strategy of a small portfolio (a cut score x a prefetch rule):

1. select cuts with one sweep over the chain (``cuts.select_cuts``);
2. place the prefetches those cuts need (``prefetch.place_prefetches``);
3. write the directives (``emit``) and simulate the candidate, and again with each
   task's final write-backs largest first where that changes them (``emit.largest_first``),
   and with the windows fitted into the least memory the cuts need where that is less;
4. a candidate the simulator rejects is repaired by sweeping again at a smaller capacity
   (more room for what the sweep's estimates miss), at most ``REPAIRS`` times. (A safety
   net: the sweep keeps every task within the budget with its prefetch windows, so no
   benchmark candidate has needed it.)

The best valid candidate wins (shortest makespan, then fewest bytes moved, then portfolio
order); the search stops as soon as one reaches the lower bound. Deterministic: every
choice is ordered by task and object position, never by hashing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from dataflow.planning.cuts import SCORES, CutSelection, select_cuts
from dataflow.planning.emit import Directives, annotate, directives, largest_first
from dataflow.planning.intervals import (
    Chain,
    Gaps,
    Origin,
    build_chain,
    no_offload_peak_bytes,
)
from dataflow.planning.lower_bound import ChainBounds, LowerBound
from dataflow.planning.peaks import select_cuts_peak
from dataflow.planning.prefetch import RULES, PrefetchWindows
from dataflow.schema import Budget, Location, Program
from dataflow.sim import SimResult
from dataflow.sim.compiled import CompiledProgram, compile_program
from dataflow.sim.loop import D2H, H2D, Outcome, run
from dataflow.sim.simulate import _result as sim_result

#: Orders in which cuts are chosen: ``sweep`` (``cuts``: the first task over the capacity,
#: in chain order) or ``peak`` (``peaks``: the task most over it first).
ORDERS = ("sweep", "peak")


@attrs.frozen
class Strategy:
    """One member of the portfolio: a cut score (``cuts.SCORES``), a prefetch rule
    (``prefetch.RULES``) and the order cuts are chosen in (``ORDERS``)."""

    score: str = attrs.field(validator=attrs.validators.in_(sorted(SCORES)))
    rule: str = attrs.field(validator=attrs.validators.in_(RULES))
    order: str = attrs.field(default="sweep", validator=attrs.validators.in_(ORDERS))
    #: time write-backs on a FIFO d2h link (``cuts.select_cuts(queue=True)``); sweep only
    queue: bool = False
    #: cut the gaps of this many of the largest objects only once no prefetch window can
    #: be delayed instead (sweep only)
    pin: int = 0
    #: delay prefetch windows before cutting any gap (every object pinned; sweep only)
    windows_first: bool = False

    def __str__(self) -> str:
        suffix = "" if self.order == "sweep" else f"/{self.order}"
        suffix += "/queued" if self.queue else ""
        suffix += f"/pin{self.pin}" if self.pin else ""
        suffix += "/windows-first" if self.windows_first else ""
        return f"{self.score}/{self.rule}{suffix}"

    def select(
        self, chain: Chain, gaps: Gaps, capacity_bytes: int, slow_capacity_bytes: int | None
    ) -> CutSelection:
        if self.order == "peak":
            return select_cuts_peak(chain, gaps, capacity_bytes, self.score, slow_capacity_bytes)
        return select_cuts(
            chain,
            gaps,
            capacity_bytes,
            self.score,
            slow_capacity_bytes,
            queue=self.queue,
            pinned=largest_objects(
                chain, gaps, len(chain.objects) if self.windows_first else self.pin
            ),
        )


def largest_objects(chain: Chain, gaps: Gaps, count: int) -> frozenset[int]:
    """The ``count`` largest objects that have a gap to cut (ties: first in the chain)."""
    if count <= 0:
        return frozenset()
    with_gaps = sorted(set(gaps.obj), key=lambda o: (-chain.objects[o].size_bytes, o))
    return frozenset(with_gaps[:count])


#: The default portfolio, chosen with ``benchmarks/planning.py --ablation``
#: (docs/planning.md): ``farthest/jit`` alone ties the old four-member portfolio on every
#: shape but tied-embedding chains, where ``farthest/jit/queued/windows-first`` beats
#: ``farthest/jit/queued`` (median 1.12 against 1.40 of the bound: a prefetch delayed a
#: little costs less than a huge embedding fetched again) and ties it elsewhere;
#: ``benefit`` and ``clean`` changed the mean by under 0.1 %. Two members, because every
#: plan also sweeps each rung of the monotone ladder with the whole portfolio.
PORTFOLIO: tuple[Strategy, ...] = (
    Strategy("farthest", "jit"),
    Strategy("farthest", "jit", queue=True, windows_first=True),
)
#: Measured and left out (see above; the most-over-budget-first order costs seconds on a
#: 2,000-task chain). Kept so the ablation can be re-run.
ALTERNATIVES: tuple[Strategy, ...] = (
    Strategy("farthest", "jit", queue=True),
    Strategy("farthest", "jit", queue=True, pin=2),
    Strategy("farthest", "jit", windows_first=True),
    Strategy("benefit", "jit"),
    Strategy("clean", "jit"),
    Strategy("benefit", "jit", queue=True),
    Strategy("clean", "jit", queue=True),
    Strategy("large", "jit"),
    Strategy("farthest", "margin"),
    Strategy("farthest", "early"),
    Strategy("farthest", "jit", "peak"),
    Strategy("benefit", "jit", "peak"),
)

#: Every candidate is simulated twice where that differs: with each task's final
#: write-backs in object order, and largest first (``emit.largest_first``; the same cuts
#: and prefetches). Largest first frees the room a large prefetch waits for sooner (a
#: link-bound optimizer phase at a tight budget); object order lets a small object needed
#: next come back sooner. Where its cuts need less memory than the windows were fitted
#: into, a third run has the windows fitted into that least memory
#: (``PrefetchWindows.need_bytes``, object order): windows fitted into more room are issued
#: earlier and can crowd what the placement does not count (write-backs still in flight),
#: so a larger budget that makes the same cuts as a smaller one could run them slower;
#: with it both budgets try the same tight candidate.
#: Re-sweeps at a smaller capacity allowed per strategy when a candidate fails to simulate.
REPAIRS = 2
#: Rungs of the fixed capacity ladder every plan also sweeps at (``monotone_capacities``),
#: evenly spaced from the floor to the no-offload peak. With 5, 6 or 7 the benchmark's
#: random chains (16 seeds x 16 budgets) had 1, 4 and 4 monotonicity violations (up to
#: +0.86 %), with 8 none, at the same medians and p90s; fewer rungs sweep less below a
#: mid-range budget (docs/planning.md, Monotone in the budget).
MONOTONE_RUNGS = 8


@attrs.frozen
class Candidate:
    """The winning candidate plan: its annotated program and its simulation."""

    strategy: Strategy
    capacity_bytes: int
    program: Program
    sim: SimResult


@attrs.frozen
class Priced:
    """One candidate's directives and the simulator's run of them (``Pricer``)."""

    strategy: Strategy
    capacity_bytes: int
    found: Directives
    outcome: Outcome

    @property
    def makespan_us(self) -> float:
        return self.outcome.makespan_us

    @property
    def rank(self) -> tuple[float, int, int]:
        moved = self.outcome.link_bytes[H2D] + self.outcome.link_bytes[D2H]
        return (self.outcome.makespan_us, moved, self.outcome.fast_peak_bytes)


class Pricer:
    """Runs candidate directives through the simulator's event loop without writing them
    into a Program: the bare chain is compiled once, and each candidate only swaps in its
    directives (index tuples, as ``compile_program`` makes them from the annotated
    program). ``search`` annotates only the winner (``plan`` simulates what it returns
    again; a test checks that the two runs agree)."""

    def __init__(self, chain: Chain, budget_bytes: int, slow_budget_bytes: int | None):
        self.bare: CompiledProgram = compile_program(chain.program)
        self.links = chain.program.links
        self.budget_bytes = budget_bytes
        self.slow_budget_bytes = slow_budget_bytes
        #: read-only objects that start fast: backed (clean from the start) once a
        #: candidate drops them (``Program.backed_ids``, which the bare chain cannot tell)
        self.read_only_fast = frozenset(
            life.index
            for life in chain.objects
            if life.origin is Origin.FAST and not life.dirties[0]
        )

    def run(self, found: Directives) -> Outcome:
        backed = self.bare.initial_backed
        if self.read_only_fast:
            dropped = self.read_only_fast.intersection(
                itertools.chain.from_iterable((*found.releases, *found.offloads))
            )
            if dropped:
                backed = tuple(sorted(dropped.union(backed)))
        compiled = attrs.evolve(
            self.bare,
            has_prologue=bool(found.prefetches[-1]),
            initial_backed=backed,
            releases=(*found.releases, ()),
            offloads=(*found.offloads, ()),
            prefetches=found.prefetches,
        )
        return run(compiled, self.links, self.budget_bytes, self.slow_budget_bytes, False)


@attrs.frozen
class SearchResult:
    """What a search found: ``best`` (None when no candidate was valid), how many
    candidates were simulated, the lower bound, and the first task no sweep could fit."""

    best: Candidate | None
    simulated: int
    lower_bound: LowerBound
    unfit_task: int | None
    unfit_bytes: int
    #: the chain's bounds at any budget (``ChainBounds``), for callers that bound it again
    bounds: ChainBounds | None = attrs.field(default=None, eq=False, repr=False)


def search(
    program: Program,
    budget_bytes: int,
    *,
    slow_budget_bytes: int | None = None,
    portfolio: Sequence[Strategy] = PORTFOLIO,
    repairs: int = REPAIRS,
    first_valid: bool = False,
    chain: Chain | None = None,
    below: Sequence[int] = (),
    capacity_bytes: int | None = None,
    bounds: ChainBounds | None = None,
) -> SearchResult:
    """Try every strategy of ``portfolio`` on ``program``'s bare chain at ``budget_bytes``;
    with ``first_valid`` stop at the first valid candidate (feasibility checks).

    ``below`` are smaller capacities to sweep at too (every strategy), each candidate
    simulated at ``budget_bytes``: a plan made for less memory runs within more,
    so the best of them is never slower than what those capacities give (``monotone``).
    ``capacity_bytes`` (default: the budget) is what the portfolio sweeps at: less than the
    budget leaves room that the plan does not use (for placement's fragmentation).
    ``bounds`` are ``chain``'s (``ChainBounds``) when the caller has them already (they do
    not depend on the budget)."""
    chain = chain or build_chain(program.bare())
    if bounds is None or bounds.chain is not chain:
        bounds = ChainBounds(chain)
    gaps = bounds.gaps
    bound = bounds.at(budget_bytes, rooms=False)  # the room bound, if need be, at the end
    target_us = bound.best_us * (1 + 1e-9)
    pricer = Pricer(chain, budget_bytes, slow_budget_bytes)
    best: Priced | None = None
    seen: dict[tuple[tuple[tuple[int, ...], ...], ...], bool] = {}
    simulated = 0
    unfit: CutSelection | None = None

    views = (chain, *written_view(chain))

    def attempt(strategy: Strategy, capacity: int, place_at: int, view: Chain) -> bool | None:
        """Sweep ``view`` at ``capacity``, fit prefetches into ``place_at``; True: valid,
        False: invalid, None: the sweep failed."""
        nonlocal unfit
        selection = strategy.select(view, gaps, capacity, slow_budget_bytes)
        if selection.failed_task is not None:
            unfit = unfit or selection
            return None
        if best is not None and transfers_floor_us(chain, gaps, selection.cut) > best.makespan_us:
            return None  # these cuts move too much to beat the best: no need to place them
        windows = PrefetchWindows(chain, gaps, selection.cut, strategy.rule)
        found = directives(chain, gaps, selection.cut, windows.fit(place_at))
        valid = try_candidate(strategy, capacity, found)
        if best is not None and best.makespan_us <= target_us:
            return valid  # at the lower bound: nothing to gain from another order
        reordered, tasks = largest_first(chain, found)
        if tasks:
            valid = try_candidate(strategy, capacity, reordered) or valid
        if windows.need_bytes < place_at and (best is None or best.makespan_us > target_us):
            # The same cuts with their windows fitted into the least memory the cuts need
            # (``PrefetchWindows.need_bytes``; object order only): see ``monotone``.
            tight = directives(chain, gaps, selection.cut, windows.fit(windows.need_bytes))
            valid = try_candidate(strategy, capacity, tight) or valid
        return valid

    def try_candidate(strategy: Strategy, capacity: int, found: Directives) -> bool:
        """Simulate ``found`` (once per set of directives); keep it if it is the best."""
        nonlocal best, simulated
        key = (found.releases, found.offloads, found.prefetches)
        valid = seen.get(key)
        if valid is None:
            outcome = pricer.run(found)
            valid = seen[key] = outcome.error is None
            simulated += 1
            if valid:
                candidate = Priced(strategy, capacity, found, outcome)
                if best is None or candidate.rank < best.rank:
                    best = candidate
        return valid

    def sweep(capacity: int, place_at: int) -> bool:
        """Every strategy at ``capacity`` (each repaired as needed) on every view of the
        chain (``written_view``); True: stop searching."""
        for view in views:
            for strategy in portfolio:
                swept = capacity
                for _ in range(repairs + 1):
                    if attempt(strategy, swept, place_at, view) is not False:
                        break
                    swept = _smaller(chain, swept)  # repair: sweep again with more room
                if best is not None and (first_valid or best.makespan_us <= target_us):
                    return True
        return False

    top = budget_bytes if capacity_bytes is None else min(capacity_bytes, budget_bytes)
    if not sweep(top, budget_bytes):
        # Each rung as a plan at that budget would make it (the same candidates), so this
        # plan is never slower than the plan at any rung below it.
        for rung in sorted(set(below), reverse=True):
            if rung >= top:
                continue
            if best is not None and best.makespan_us <= _rung_bound_us(bounds, rung):
                # A plan within ``rung`` is never faster than its bound, nor one within a
                # smaller rung (the bounds only grow as the budget shrinks): done.
                break
            if sweep(rung, rung):
                break
    unfit_task = unfit.failed_task if unfit is not None and best is None else None
    unfit_bytes = unfit.over_bytes if unfit is not None and best is None else 0
    winner = (
        None if best is None else _annotated(chain, best, pricer, budget_bytes, slow_budget_bytes)
    )
    if best is not None and best.makespan_us > target_us:
        bound = bounds.at(budget_bytes)  # with the room bound: only a plan above the rest
    return SearchResult(winner, simulated, bound, unfit_task, unfit_bytes, bounds)


def written_view(chain: Chain) -> tuple[Chain, ...]:
    """``chain`` with its read-only objects that start fast (``Program.read_only_ids``)
    swept as if written at the start, so that the sweep prices dropping them as a
    write-back; no chain when it has none. The candidates are emitted from ``chain`` itself
    (a drop of a read-only object stays a release) and simulated as they run. Told that
    dropping a read-only weight is free, the greedy sweep streams weights used again soon
    in place of what it would have cut else, and their reloads can cost more than the
    write-backs saved (LoRA on llama3_tiny, seq_len 64, batch 4, at 70 % of its peak: a
    steady-state step of 175 us against the written view's 113 us); the search keeps the
    faster of both views' plans."""
    objects = tuple(
        attrs.evolve(life, dirties=(True, *life.dirties[1:]))
        if life.origin is Origin.FAST and not life.dirties[0]
        else life
        for life in chain.objects
    )
    if objects == chain.objects:
        return ()
    return (attrs.evolve(chain, objects=objects),)


def _annotated(
    chain: Chain, priced: Priced, pricer: Pricer, budget_bytes: int, slow_budget_bytes: int | None
) -> Candidate:
    """The winner written into the program, with its SimResult made from the pricer's run
    (``plan`` simulates the program it returns again, recording the timeline)."""
    planned = annotate(chain, priced.found, budget_bytes, slow_budget_bytes)
    bare = pricer.bare
    sim = sim_result(
        planned,
        bare.task_ids,
        bare.obj_ids,
        bare.size_bytes,
        priced.outcome,
        budget_bytes,
        slow_budget_bytes,
        False,
    )
    return Candidate(priced.strategy, priced.capacity_bytes, planned, sim)


def transfers_floor_us(chain: Chain, gaps: Gaps, cut: Sequence[bool]) -> float:
    """A lower bound on the makespan of any plan with these cuts, from the transfers they
    need (the link bound of ``lower_bound``, for one set of cuts): every object that starts
    slow and every cut gap comes back over ``h2d`` (one transfer at a time, from program
    start on) before the task that needs it starts; a cut gap that is dirty (created,
    mutated, or started fast since it last came back) is written back over ``d2h`` after
    the task before it ends, as is every dirty object whose final location is slow after
    its last use. So task ``t`` starts no sooner than the loads due by then, and the run
    ends no sooner than the end of task ``t`` plus every write-back issued from there on.
    Cheap next to placing the prefetches and simulating: rungs of the monotone ladder,
    which cut far more than the budget needs, are skipped with it."""
    n = chain.n_tasks
    due_us = [0.0] * (n + 1)  # by the task that needs it back
    written_us = [0.0] * (n + 1)  # by the task whose end issues it
    for life in chain.objects:
        if not life.uses:
            continue
        load_us, write_us = chain.load_us[life.index], chain.write_us[life.index]
        if life.origin is Origin.SLOW:
            due_us[life.uses[0]] += load_us
        first_gap, last = gaps.first_gap[life.index], len(life.uses) - 1
        dirty = False
        for k, (use, dirties) in enumerate(zip(life.uses, life.dirties, strict=True)):
            dirty = dirty or dirties
            if k < last and cut[first_gap + k]:
                due_us[life.uses[k + 1]] += load_us
                if dirty:
                    written_us[use] += write_us
                dirty = False
            elif k == last and dirty and life.final is Location.SLOW:
                written_us[use] += write_us
    cost = chain.cost_us
    ends = []
    start_us = loaded_us = 0.0
    for t in range(n):
        loaded_us += due_us[t]
        start_us = max(start_us, loaded_us) + cost[t]
        ends.append(start_us)
    floor_us = max(start_us, loaded_us + due_us[n])
    after_us = 0.0
    for t in range(n - 1, -1, -1):
        after_us += written_us[t]
        if after_us:
            floor_us = max(floor_us, ends[t] + after_us)
    return floor_us


def _rung_bound_us(bounds: ChainBounds, rung_bytes: int) -> float:
    """The best lower bound at ``rung_bytes``, a hair under (float rounding)."""
    return bounds.at(rung_bytes, rooms=False).best_us * (1 - 1e-9)


def monotone_capacities(
    chain: Chain, rungs: int = MONOTONE_RUNGS, peak_bytes: int | None = None
) -> tuple[int, ...]:
    """The fixed ladder of capacities every plan also sweeps at (those below its budget):
    ``rungs`` from the largest base up to the no-offload peak (``peak_bytes`` when the
    caller knows it), so a plan at a larger budget has tried every rung a smaller one did."""
    floor = max(chain.base_bytes, default=0)
    if peak_bytes is None:
        peak_bytes = no_offload_peak_bytes(chain)
    peak = max(floor, peak_bytes)
    if rungs < 2 or peak == floor:
        return (floor,)
    return tuple(sorted({floor + (peak - floor) * k // (rungs - 1) for k in range(rungs)}))


def _smaller(chain: Chain, capacity_bytes: int) -> int:
    """A capacity halfway down to the least any task needs (a small step tends to give
    the same cuts again)."""
    floor = max(chain.base_bytes, default=0)
    return max(floor, capacity_bytes - max(1, (capacity_bytes - floor) // 2))


def best_plan(
    chain: Chain,
    budget_bytes: int,
    slow_budget_bytes: int | None,
    bounds: ChainBounds | None = None,
    *,
    ladder: bool = True,
) -> Program | None:
    """PressureFit's plan of ``chain`` at ``budget_bytes`` (the search, with the monotone
    ladder below it unless ``ladder`` is False), or None when it finds none; never searches
    for a minimal budget. ``bounds`` are ``chain``'s when the caller has them (else the
    search makes them)."""
    if chain.n_tasks == 0 and not any(life.uses for life in chain.objects):
        return attrs.evolve(chain.program, budget=Budget(budget_bytes, slow_budget_bytes))
    below: Sequence[int] = ()
    if ladder:
        peak = None if bounds is None else bounds.peak_held
        below = monotone_capacities(chain, peak_bytes=peak)
    found = search(
        chain.program,
        budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        chain=chain,
        below=below,
        bounds=bounds,
    )
    return found.best.program if found.best is not None else None


def finds_plan(
    chain: Chain,
    budget_bytes: int,
    slow_budget_bytes: int | None,
    bounds: ChainBounds | None = None,
) -> bool:
    """Whether the search finds a plan of ``chain`` at ``budget_bytes``, stopping at its
    first valid candidate (what the minimal-budget search asks; ``bounds``: the chain's,
    when the caller tries several budgets)."""
    if budget_bytes < max(chain.base_bytes, default=0):
        return False
    found = search(
        chain.program,
        budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        first_valid=True,
        chain=chain,
        bounds=bounds,
    )
    return found.best is not None
