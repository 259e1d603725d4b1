"""The recompute planner: per block and round, keep ``A`` from forward, re-derive it just
before backward, or (where the block kind offers a partial save) keep part of it and
re-derive the rest, whichever makes the planned step faster or makes it fit at all.

Registered as the planner ``recompute`` (``RECOMPUTE``). For a program lowered by
``dataflow_training.step.lowering`` it plans candidate steps with PressureFit and keeps the
best; any other program goes to PressureFit unchanged.

A **unit** is one block in one accumulation round. Its mode: ``keep``; ``full``
(recomputed: ``A`` leaves the forward task's outputs and the lowering's ``rec`` task runs
right before the backward, ``lower(recompute=[(round, block)])``; a block whose experts
run apart saves nothing then, its ``rec`` before the shards' ``ebwd`` tasks, which make
their rows' ``gate_up`` again, so its ``efwd`` and ``ebwd`` change too); or the name of the
partial save its kind offers first (``A`` holds only what that keeps, and a ``rec`` task
re-derives the rest into ``A_...<name>``, ``lower(partial={(round, block): name})``).
Candidates are spliced from one lowering per mode with every unit in it, so each is
exactly what ``lower`` makes of its units; a candidate keeps every task's cost and
workspace from the program it started from, and prices a new ``rec`` task as its forward
scaled by the declared work of that ``rec`` over forward (or by ``price``, which re-prices
a whole candidate, e.g. from the profile cache).

The search, at most ``max_candidates`` plans (each planned by PressureFit and simulated;
one tried already is not planned again):

1. the program as given. If it fits and no unit could pay for itself (its step is no
   longer than its compute plus the cheapest ``rec`` task), that is the answer;
2. when it does not fit: every unit recomputed; if even that does not fit, the budget is
   infeasible (the error names the smallest budget found with every unit recomputed).
   Then the fewest blocks (in chain order, every round) that still fit, by bisection
   (a candidate with one task larger than the budget is never planned);
3. the partial ladder (where partial saves are on offer): the recomputed units saved
   partially instead, all of them, else by bisection the most blocks, from the last;
4. then, greedily: the units whose ``A`` the best plan so far moves over the link
   (offloaded), all at once, then halves of them, each saved partially first where it
   can be, else recomputed; then the ladder again; last, every unit saved partially
   (then the greedy step again), and every unit recomputed (then the ladder again).

A candidate is accepted only if its simulated step is shorter (for a cyclic plan, its
steady-state iteration), and one whose compute alone cannot beat the best is never
planned. So the answer is never slower than the program as given, whenever that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from dataflow import (
    PRESSUREFIT,
    Plan,
    PlannerSpec,
    PlanningError,
    Program,
    Task,
    fast_homes,
    minimal_budget,
    plan,
)
from dataflow_training.step.family import partial_saves
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import Lowered, lower

#: The most candidate plans one search makes (each is a PressureFit plan and a simulation).
MAX_CANDIDATES = 10
#: How many more it may make where the step's blocks offer partial saves.
PARTIAL_CANDIDATES = 6

Unit = tuple[int, int]  # (round, block index)


def _quick_pressurefit(program: Program, budget_bytes: int, **options: Any) -> Program:
    """PressureFit that fails at once when it finds no plan (``explain=False``)."""
    return PRESSUREFIT.plan(program, budget_bytes, explain=False, **options)


#: PressureFit that fails at once where it finds no plan (the step search's, and the
#: recompute search's for its candidates)
QUICK = PlannerSpec("pressurefit", _quick_pressurefit)


def _quick_within(homes: frozenset[str]) -> PlannerSpec:
    """``QUICK`` for a steady-state plan that tries only ``homes`` as its fast homes."""

    def quick(program: Program, budget_bytes: int, **options: Any) -> Program:
        return _quick_pressurefit(program, budget_bytes, homes=[homes], **options)

    return PlannerSpec("pressurefit", quick)


#: re-prices a candidate step: its program with every task's cost and workspace set
Price = Callable[[Lowered], Program]


@attrs.frozen
class Choice:
    """What the search settled on: the fully recomputed ``units``, the ``partial`` units
    (saved partially, the rest re-derived), the plan, how many candidates it planned, and
    the step it runs."""

    units: frozenset[Unit]
    plan: Plan
    candidates: int
    partial: frozenset[Unit]
    #: the chosen candidate as planned: ``plan.program`` with its step layout
    step: Lowered

    @property
    def step_us(self) -> float:
        return _step_us(self.plan)


def _step_us(planned: Plan) -> float:
    return planned.cycle.iteration_us if planned.cycle is not None else planned.makespan_us


#: a unit's mode: ``A`` kept whole, recomputed whole, or the name of a partial save
KEEP, FULL = "keep", "full"


Relower = Callable[[frozenset[Unit], Mapping[Unit, str]], Lowered]

#: the kinds of a unit's tasks (``efwd`` and ``ebwd``: the shards of a block whose experts
#: run apart)
UNIT_TASKS = ("fwd", "efwd", "rec", "ebwd", "bwd")


def relowering(step: Lowered) -> Relower:
    """``step``'s family object lowering the same step again with ``recompute`` units
    re-derived whole and ``partial`` units (each mapped to its partial save) saved in
    part: the recompute planner's candidates are made of these."""
    layout = step.layout

    def relower(recompute: frozenset[Unit], partial: Mapping[Unit, str]) -> Lowered:
        return lower(
            step.family,
            layout.preset,
            layout.train,
            overrides=layout.overrides,
            step=layout.step,
            recompute=sorted(recompute),
            partial=dict(partial),
        )

    return relower


class Rewriter:
    """Candidate steps of one lowered step (module docstring). ``relower`` lowers the
    step again with units in another mode (default: ``relowering(step)``); ``price``
    re-prices a candidate's program."""

    def __init__(
        self,
        step: Lowered,
        price: Price | None = None,
        relower: Relower | None = None,
        lowerings: dict[str, Lowered] | None = None,
    ) -> None:
        self.step, self.program, self.price = step, step.program, price
        self.relower = relower or relowering(step)
        #: the step lowered with every unit in one mode, by mode (shared by ``rebased``)
        self._lowerings = {} if lowerings is None else lowerings
        self.layout = step.layout
        names = [layer.name for layer in self.layout.layers]
        self.blocks = {name: i for i, name in enumerate(names[1:-1])}
        rounds = self.layout.train.rounds
        # a block with no backward (a frozen bottom: ``step.freezing``) saves nothing; one
        # whose experts run apart (``efwd`` tasks) is re-derived whole or not at all (its
        # routing task's saves and the experts' input; each shard's backward makes its
        # rows' ``gate_up`` again)
        apart = {slot.layer for slot in self.layout.tasks.values() if slot.kind == "efwd"}
        backward = {slot.layer for slot in self.layout.tasks.values() if slot.kind == "bwd"}
        self.all = frozenset(
            (r, i) for r in range(rounds) for name, i in self.blocks.items() if name in backward
        )
        self.given_mode = self._modes_of(self.program)
        self.given = frozenset(u for u, mode in self.given_mode.items() if mode == FULL)
        family, config, train = step.family, step.config, self.layout.train
        # the partial save each block kind offers first, where it offers one
        offered = {}
        for layer in self.layout.layers[1:-1]:
            if layer.kind not in offered:
                math = family.math(layer.kind)
                saved = math.saved(config, train.batch, train.seq_len)
                offered[layer.kind] = next(iter(partial_saves(math, config, saved)), None)
        self.partial_of = {
            (r, i): offered[self.layout.layer(name).kind]
            for name, i in self.blocks.items()
            for r in range(rounds)
            if offered[self.layout.layer(name).kind] is not None
            and name in backward
            and name not in apart
        }
        self.partial_units = frozenset(self.partial_of)
        # the kept lowering where the given one is not it, or where an apart block's
        # shard backward is priced by its ratio between two modes
        kept = bool(self.given_mode or apart)
        modes = {FULL, *self.partial_of.values(), *((KEEP,) if kept else ())}
        # mode -> (tasks by id, step layout, each unit's A objects) of its lowering
        self.sources: dict[str, tuple[dict[str, Task], StepLayout, dict[Unit, list]]] = {}
        for mode in modes:
            if mode not in self._lowerings:
                self._lowerings[mode] = self.relower(
                    self.all if mode == FULL else frozenset(),
                    {u: m for u, m in self.partial_of.items() if m == mode},
                )
            source = self._lowerings[mode]
            saved: dict[Unit, list] = {}
            units_of = self._saved_units(source.layout)
            for obj in source.program.objects:
                if obj.id in units_of:
                    saved.setdefault(units_of[obj.id], []).append(obj)
            self.sources[mode] = (source.program.tasks_by_id, source.layout, saved)
        plain = {t.id: t for t in self.program.tasks}
        # a rec task's price: its forward's, scaled by the declared work of the two
        self.rec_cost: dict[tuple[Unit, str], Task] = {}
        for mode, (source, layout, _) in self.sources.items():
            for slot in layout.tasks.values():
                if slot.kind != "rec":
                    continue
                unit = (slot.round_, self.blocks[slot.layer])
                fwd_id = layout.task_of("fwd", slot.layer, slot.round_).id
                rec, fwd_fresh, fwd_given = source[slot.id], source[fwd_id], plain[fwd_id]
                if self.given_mode.get(unit) == mode:
                    self.rec_cost[unit, mode] = plain[slot.id]
                    continue
                ratio = rec.cost_us / fwd_fresh.cost_us if fwd_fresh.cost_us > 0 else 1.0
                self.rec_cost[unit, mode] = attrs.evolve(
                    rec,
                    cost_us=fwd_given.cost_us * ratio,
                    workspace_bytes=fwd_given.workspace_bytes,
                )
        self.base_us = sum(t.cost_us for t in self.program.tasks if t.kind != "rec")

    def _modes_of(self, program: Program) -> dict[Unit, str]:
        """The mode of every unit that ``program`` (this step or a candidate of it)
        re-derives, read from its ``rec`` tasks' params."""
        modes = {}
        for task in program.tasks:
            if task.kind == "rec":
                unit = (task.params["round"], self.blocks[task.params["layer"]])
                modes[unit] = task.params.get("partial", FULL)
        return modes

    def _saved_units(self, layout: StepLayout) -> dict[str, Unit]:
        """Each saved-context object of ``layout`` with its unit."""
        return {
            obj_id: (slot.round_, self.blocks[slot.layer])
            for obj_id, slot in layout.saved_by().items()
        }

    def step_of(self, program: Program) -> Lowered:
        """``program``, a candidate of this step (as planned: with directives), as a
        step with its own layout, read from which units its ``rec`` tasks re-derive."""
        modes = self._modes_of(program)
        full = frozenset(u for u, m in modes.items() if m == FULL)
        partial = frozenset(u for u, m in modes.items() if m != FULL)
        if modes == self.given_mode:
            return self.step.with_program(program)
        found = self._candidate(full, partial)
        if {t.id for t in found.program.tasks} != {t.id for t in program.tasks}:
            raise ValueError(f"program {program.name!r} is not a recompute candidate of this step")
        return self.step.with_program(program, found.layout)

    def rebased(self, step: Lowered) -> Rewriter:
        """A rewriter of ``step`` (a candidate of this one) sharing this one's lowerings
        of each mode and its pricing."""
        return Rewriter(step, self.price, self.relower, self._lowerings)

    def unit_of(self, task_id: str) -> Unit | None:
        slot = self.layout.tasks.get(task_id)
        if slot is None or slot.kind not in UNIT_TASKS or slot.layer not in self.blocks:
            return None
        return slot.round_, self.blocks[slot.layer]

    def modes(self, units: Iterable[Unit] = (), partial: Iterable[Unit] = ()) -> dict[Unit, str]:
        """Every unit's mode in the candidate with ``units`` recomputed and ``partial``
        saved partially, on top of the given program's (full recompute wins)."""
        full = frozenset(units) | self.given
        modes = {u: m for u, m in self.given_mode.items() if m != FULL}
        modes |= {u: self.partial_of[u] for u in partial if u in self.partial_of}
        return {u: FULL if u in full else modes.get(u, KEEP) for u in self.all}

    def candidate(self, units: Iterable[Unit] = (), partial: Iterable[Unit] = ()) -> Lowered:
        """The step with ``units`` recomputed and ``partial`` saved partially (on top of
        those it recomputes already), its program priced by ``price``."""
        found = self._candidate(units, partial)
        return found if self.price is None else found.with_program(self.price(found))

    def _candidate(self, units: Iterable[Unit] = (), partial: Iterable[Unit] = ()) -> Lowered:
        changed = {
            u: m for u, m in self.modes(units, partial).items() if m != self.given_mode.get(u, KEEP)
        }
        if not changed:
            return self.step
        tasks: list[Task] = []
        slots = dict(self.layout.tasks)
        backward: set[Unit] = set()  # the units whose first backward task has come
        for task in self.program.tasks:
            unit = self.unit_of(task.id)
            mode = changed.get(unit)
            if mode is None:
                tasks.append(task)
                continue
            source, layout, _ = self.sources[mode]
            if task.kind == "rec":
                del slots[task.id]
                continue
            fresh = source[task.id]
            if task.kind == "fwd":
                task = attrs.evolve(task, outputs=fresh.outputs, params=fresh.params)
            if task.kind in ("ebwd", "bwd") and unit not in backward:
                backward.add(unit)  # the rec task goes before the unit's first backward
                if mode != KEEP:
                    rec = self.rec_cost[unit, mode]
                    tasks.append(rec)
                    slots[rec.id] = layout.tasks[rec.id]
            if task.kind == "efwd":  # reads or writes the experts' object by the mode
                task = attrs.evolve(task, inputs=fresh.inputs, mutates=fresh.mutates)
            if task.kind == "ebwd":  # its price scaled as its mode's lowering has it
                was = self.sources[self.given_mode.get(unit, KEEP)][0][task.id]
                ratio = fresh.cost_us / was.cost_us if was.cost_us > 0 else 1.0
                task = attrs.evolve(task, cost_us=task.cost_us * ratio)
            if task.kind in ("ebwd", "bwd"):
                task = attrs.evolve(task, inputs=fresh.inputs)
            slots[task.id] = layout.tasks[task.id]
            tasks.append(task)
        objects, packed = self._saved_objects(changed)
        layout = attrs.evolve(self.layout, tasks=slots, packed=packed)
        metadata = {**self.program.metadata, **layout.to_metadata()}  # written out with it
        program = attrs.evolve(self.program, tasks=tuple(tasks), objects=objects, metadata=metadata)
        return self.step.with_program(program, layout)

    def _saved_objects(self, changed: dict[Unit, str]) -> tuple[tuple[Any, ...], dict]:
        """The program's objects and packed objects with every changed unit's ``A`` (and
        a partial save's rest) as its new mode's lowering has them, in place."""
        packed, objects, done = dict(self.layout.packed), [], set()
        made = {}  # added after every old one is gone: a unit may save several (apart)
        units_of = self._saved_units(self.layout)
        for obj in self.program.objects:
            unit = units_of.get(obj.id)
            if unit not in changed:
                objects.append(obj)
                continue
            del packed[obj.id]
            if unit in done:
                continue
            done.add(unit)
            _, layout, saved = self.sources[changed[unit]]
            for fresh in saved[unit]:
                objects.append(fresh)
                made[fresh.id] = layout.packed[fresh.id]
        return tuple(objects), packed | made

    def compute_us(self, units: Iterable[Unit] = (), partial: Iterable[Unit] = ()) -> float:
        """The candidate's compute: the given tasks but the rec ones, plus its rec tasks."""
        return self.base_us + sum(
            self.rec_cost[u, m].cost_us for u, m in self.modes(units, partial).items() if m != KEEP
        )

    def offloaded(self, planned: Plan) -> list[Unit]:
        """Units (not yet recomputed) whose ``A`` the plan writes back to slow memory."""
        units_of = self._saved_units(self.layout)
        found = {
            units_of[obj_id]
            for task in planned.program.tasks
            for obj_id in task.offloads
            if obj_id in units_of
        }
        return sorted(found - self.given, key=_chain_order)


def _chain_order(unit: Unit) -> tuple[int, int]:
    """Rounds in order, each round's blocks first to last (its A lives longest)."""
    return unit


def search(
    rewriter: Rewriter,
    budget_bytes: int,
    *,
    max_candidates: int | None = None,
    explain: bool = True,
    **options: Any,
) -> Choice:
    """The best recompute choice for the rewriter's step within ``budget_bytes`` (module
    docstring). ``options`` go to every PressureFit plan (``slow_budget_bytes``,
    ``cyclic``); ``max_candidates`` defaults to ``MAX_CANDIDATES``, plus
    ``PARTIAL_CANDIDATES`` where the step's blocks offer partial saves. Raises
    ``InfeasibleBudget`` when no candidate fits, or with ``explain=False`` a plain
    ``PlanningError`` at once (the smallest budget that works not searched for: a step
    search over many shapes needs only whether each fits, and that search took minutes
    of Llama 3 8B's)."""
    if max_candidates is None:
        max_candidates = MAX_CANDIDATES + (PARTIAL_CANDIDATES if rewriter.partial_of else 0)
    planned = 0
    tried: dict[tuple[frozenset[Unit], ...], Plan | None] = {}
    # A steady-state plan tries a few sets of fast homes, each a whole PressureFit search.
    # The candidates differ only in their activations, which never cross the step
    # boundary, so after the first plan that fits they try the set it chose (``quick``);
    # the winner is planned again with every set (``narrowed``: the candidates planned so).
    quick = QUICK
    narrowed: set[tuple[frozenset[Unit], ...]] = set()

    def planned_with(candidate: Program, planner: PlannerSpec) -> Plan | None:
        try:
            return plan(candidate, budget_bytes, planner=planner, **options)
        except PlanningError:
            return None

    def evaluate(units: frozenset[Unit], partial: frozenset[Unit] = frozenset()) -> Plan | None:
        """The candidate's plan, or None when it does not fit (found without asking
        PressureFit for the smallest budget that works, which can take far longer);
        a candidate tried before is not planned again."""
        key = (frozenset(units), frozenset(partial) - frozenset(units))
        if key not in tried:
            tried[key] = _evaluate(*key)
        return tried[key]

    def _evaluate(units: frozenset[Unit], partial: frozenset[Unit]) -> Plan | None:
        nonlocal planned, quick
        candidate = rewriter.candidate(units, partial).program
        if _floor_bytes(candidate) > budget_bytes:
            return None
        planned += 1
        found = planned_with(candidate, quick)
        if found is None:
            return None
        if quick is not QUICK:
            narrowed.add((units, partial))
        elif found.cycle is not None:
            quick = _quick_within(fast_homes(found.program))
        return found

    units, partial = rewriter.given, frozenset()
    first = evaluate(units)
    if first is None:
        units, first = _make_it_fit(rewriter, evaluate, budget_bytes, options, explain)
    best = first
    cheapest = min((t.cost_us for t in rewriter.rec_cost.values()), default=0.0)
    if _step_us(best) <= rewriter.compute_us(units) + cheapest:
        return _choice(rewriter, units, best, planned, frozenset())

    def accept(trial: tuple[frozenset[Unit], frozenset[Unit]]) -> bool:
        """Plan ``trial`` (full, partial) unless its compute alone cannot beat the best;
        take it when its step is shorter."""
        nonlocal units, partial, best
        if planned >= max_candidates or rewriter.compute_us(*trial) >= _step_us(best):
            return False
        candidate = evaluate(*trial)
        if candidate is None or _step_us(candidate) >= _step_us(best):
            return False
        (units, partial), best = trial, candidate
        return True

    def offloaded_units() -> None:
        """The units whose ``A`` the best plan moves over the link, all at once, then
        halves of them: saved partially first where they can be, else recomputed."""
        pool = rewriter.offloaded(best)
        while pool and planned < max_candidates:
            cheaper = frozenset(pool) & rewriter.partial_units - partial - units
            if cheaper and accept((units, partial | cheaper)):
                pool = rewriter.offloaded(best)
            elif accept((units | frozenset(pool), partial - frozenset(pool))):
                pool = rewriter.offloaded(best)
            else:
                pool = pool[: len(pool) // 2]

    def now() -> tuple[frozenset[Unit], frozenset[Unit]]:
        return units, partial

    _partial_ladder(rewriter, accept, now)
    offloaded_units()
    _partial_ladder(rewriter, accept, now)
    everything = rewriter.all | rewriter.given
    if units != everything and rewriter.partial_units - units - partial:
        if accept((everything - rewriter.partial_units, rewriter.partial_units)):
            offloaded_units()
    if units != everything and accept((everything, frozenset())):
        _partial_ladder(rewriter, accept, now)
    if (units, partial - units) in narrowed:  # the winner, with every set of fast homes
        planned += 1
        again = planned_with(rewriter.candidate(units, partial).program, QUICK)
        if again is not None and _step_us(again) < _step_us(best):
            best = again
    return _choice(rewriter, units, best, planned, partial)


def _choice(
    rewriter: Rewriter,
    units: frozenset[Unit],
    best: Plan,
    planned: int,
    partial: frozenset[Unit],
) -> Choice:
    step = rewriter.candidate(units, partial).with_program(best.program)
    return Choice(units, best, planned, partial, step)


def _partial_ladder(rewriter: Rewriter, accept: Callable, current: Callable) -> None:
    """The fully recomputed units saved partially instead, block by block from the last
    (every round of a block at once): all of them, else by bisection the most blocks whose
    candidate is accepted (fewer when one does not fit or is slower: more kept bytes
    mean more movement)."""
    units, partial = current()
    movable = units & rewriter.partial_units - rewriter.given
    blocks = sorted({i for _, i in movable}, reverse=True)

    def trial(count: int) -> tuple[frozenset[Unit], frozenset[Unit]]:
        chosen = frozenset(u for u in movable if u[1] in blocks[:count])
        return units - chosen, partial | chosen

    if not blocks or accept(trial(len(blocks))):
        return
    low, high = 0, len(blocks)  # trial(low) is the best so far; trial(high) is not
    while high - low > 1:
        middle = (low + high) // 2
        if accept(trial(middle)):
            low = middle
        else:
            high = middle


def _floor_bytes(program: Program) -> int:
    """The largest fast footprint of one task: what it reads, changes, makes, and its
    workspace (no plan fits a budget below it)."""
    sizes = {o.id: o.size_bytes for o in program.objects}
    return max(
        (sum(sizes[o] for o in task.uses) + task.workspace_bytes for task in program.tasks),
        default=0,
    )


def _make_it_fit(
    rewriter: Rewriter,
    evaluate: Callable,
    budget_bytes: int,
    options: dict[str, Any],
    explain: bool = True,
) -> tuple[frozenset[Unit], Plan]:
    """Every unit recomputed, then the fewest blocks (every round) that still fit, by
    bisection. When even every unit recomputed does not fit, PressureFit's own error for
    that candidate (the smallest budget that works, and what forces it), or with
    ``explain=False`` a plain ``PlanningError``."""
    everything = rewriter.all | rewriter.given
    fitted = evaluate(everything)
    if fitted is None and not explain:
        raise PlanningError(
            f"no plan of {rewriter.program.name!r} fits {budget_bytes} bytes, even with every "
            "block recomputed (the smallest budget that works was not searched for)"
        )
    if fitted is None:
        plan(rewriter.candidate(everything).program, budget_bytes, planner=PRESSUREFIT, **options)
        raise PlanningError(  # PressureFit's quick search missed a plan its full one finds
            f"the recompute planner found no plan of {rewriter.program.name!r} within "
            f"{budget_bytes} bytes"
        )
    rounds = rewriter.layout.train.rounds

    def first_blocks(count: int) -> frozenset[Unit]:
        return rewriter.given | {(r, i) for r in range(rounds) for i in range(count)}

    best_units, best = everything, fitted
    low, high = 0, len(rewriter.blocks)  # first_blocks(low) does not fit, (high) does
    while high - low > 1:
        middle = (low + high) // 2
        trial = evaluate(first_blocks(middle))
        if trial is not None:
            high = middle
            if _step_us(trial) <= _step_us(best):
                best_units, best = first_blocks(middle), trial
        else:
            low = middle
    return best_units, best


def minimal_recompute_budget(rewriter: Rewriter, **options: Any) -> int:
    """The smaller of the minimal budgets of the rewriter's step as given and with every
    unit recomputed."""
    given = minimal_budget(rewriter.program, **options)
    return min(given, minimal_budget(rewriter.candidate(rewriter.all).program, **options))


RECOMPUTE_DESCRIPTION = (
    "training steps: re-derive saved activations per block and round where that makes the "
    "step faster or fit, then PressureFit (other programs: PressureFit)"
)


def step_planner(
    rewriter: Rewriter, max_candidates: int | None = None, *, explain: bool = True
) -> PlannerSpec:
    """The ``recompute`` planner of one lowered step: it plans the rewriter's step, or a
    candidate of it (a placement re-planning the chosen one), by ``search`` (``explain``:
    as ``search`` takes it)."""

    def rewriter_of(program: Program) -> Rewriter:
        step = rewriter.step_of(program)
        return rewriter if step.program is rewriter.program else rewriter.rebased(step)

    def plan_step(program: Program, budget_bytes: int, **options: Any) -> Program:
        found = search(
            rewriter_of(program),
            budget_bytes,
            max_candidates=max_candidates,
            explain=explain,
            **options,
        )
        return found.plan.program

    def minimal(program: Program, **options: Any) -> int:
        return minimal_recompute_budget(rewriter_of(program), **options)

    return PlannerSpec("recompute", plan_step, RECOMPUTE_DESCRIPTION, minimal_budget=minimal)


def recompute_planner(
    price: Price | None = None, max_candidates: int = MAX_CANDIDATES, family: Any = None
) -> PlannerSpec:
    """The ``recompute`` planner of programs read from files (``dataflow plan FILE.json``:
    the planner registered by name). A lowered step's program is read as its step
    (``Lowered.read``, with ``family`` if given, else the registered family its layout
    names) and planned by ``search``, its candidates priced by ``price`` (default: their
    costs as lowered); any other program goes to PressureFit as is."""

    def rewriter_of(program: Program) -> Rewriter:
        return Rewriter(Lowered.read(program, family), price)

    def plan_recompute(program: Program, budget_bytes: int, **options: Any) -> Program:
        if StepLayout.METADATA_KEY not in program.metadata:
            return PRESSUREFIT.plan(program, budget_bytes, **options)
        found = search(rewriter_of(program), budget_bytes, max_candidates=max_candidates, **options)
        return found.plan.program

    def minimal(program: Program, **options: Any) -> int:
        if StepLayout.METADATA_KEY not in program.metadata:
            return minimal_budget(program, **options)
        return minimal_recompute_budget(rewriter_of(program), **options)

    return PlannerSpec("recompute", plan_recompute, RECOMPUTE_DESCRIPTION, minimal_budget=minimal)


#: The planner the training plugin registers (``dataflow_planners``).
RECOMPUTE = recompute_planner()


def measured_rewriter(
    step: Lowered,
    profile: Callable[[Lowered], dict],
    known: dict | None = None,
) -> Rewriter:
    """A rewriter of ``step`` whose candidates are priced by the profiling pass:
    ``profile(step)`` returns the measured profiles of a step's task signatures
    (``dataflow_training.plan.profile.profile_program``); it is called for ``step``, for the
    step with every unit recomputed and (where partial saves are on offer) with every
    unit saved partially, which between them hold every signature any candidate has (a
    unit's tasks depend only on its own mode); ``known``: profiles of ``step`` measured
    already."""
    from dataflow_training.plan.profile import apply_profile  # imports torch: only when measured

    rewriter = Rewriter(step)
    profiles = dict(known) if known is not None else profile(step)
    profiles |= profile(rewriter.candidate(rewriter.all))
    if rewriter.partial_units:  # the partial saves' forward, rec and backward tasks
        profiles |= profile(rewriter.candidate((), rewriter.partial_units))
    return Rewriter(
        step, lambda p: apply_profile(p, profiles), rewriter.relower, rewriter._lowerings
    )
