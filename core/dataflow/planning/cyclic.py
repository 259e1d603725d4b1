"""Steady-state plans: one iteration of a loop, planned so that it repeats.

A program's ``persistent`` objects (weights, optimizer state) outlive an iteration. Each
gets a *home* between iterations: ``fast`` (resident at the boundary: kept from its last
use to its first use in the next iteration, or written back and fetched again by the
iteration's last tasks, so the next iteration finds it in place) or ``slow`` (written
back if dirty after its last use, fetched again for its first use, by the prologue if
nothing earlier can). The planned program writes the homes in: a persistent object's
``location`` and final location are its home, so each iteration starts where the last
one ended. The engine loads the first iteration's values into those homes.

Homes are chosen from a few candidate sets: none fast, and the persistent objects whose
wrap (from the end of their last use to their first use in the next iteration, in the
stall-free timeline) is shortest, filled into half of, and all of, the room the boundary
leaves under the budget. Each set is planned by PressureFit's search; each plan is checked
over two consecutive iterations (``cycle.check_cycle``), and the one whose steady-state
iteration is shortest wins (``steady_state``). What to do when none is found, the
smallest budget that works, is ``api.py``'s (``plan_cyclic``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dataflow.planning.cycle import check_cycle
from dataflow.planning.intervals import Chain, PlanningError, build_chain
from dataflow.planning.pressurefit import monotone_capacities, search
from dataflow.schema import Location, Program

#: Shares of the boundary's room filled with fast homes, besides none.
FILLS = (0.5, 1.0)


def with_homes(program: Program, fast: frozenset[str]) -> Program:
    """``program`` with each persistent object starting and ending at its home."""
    persistent = set(program.persistent)
    objects = tuple(
        attrs.evolve(obj, location=Location.FAST if obj.id in fast else Location.SLOW)
        if obj.id in persistent
        else obj
        for obj in program.objects
    )
    finals = dict(program.final_locations)
    for obj in program.persistent:
        finals[obj] = Location.FAST if obj in fast else Location.SLOW
    return attrs.evolve(program, objects=objects, final_locations=finals)


def home_sets(chain: Chain, persistent: tuple[str, ...], budget_bytes: int) -> list[frozenset]:
    """Candidate sets of fast homes for ``chain`` (every persistent object homed slow)."""
    n = chain.n_tasks
    start = chain.start_us
    lives = {life.obj_id: life for life in chain.objects}
    wrapping = []
    for obj in dict.fromkeys(persistent):
        life = lives[obj]
        if not life.uses:
            continue
        first, last = life.uses[0], min(life.uses[-1], n - 1)
        wrap_us = (start[n] - start[last + 1]) + start[first]
        wrapping.append((wrap_us, -life.size_bytes, life.index, obj))
    wrapping.sort()
    room = budget_bytes - max(chain.base_bytes[0], chain.base_bytes[n])
    sets = [frozenset()]
    for share in FILLS:
        chosen, taken = [], 0
        for _, negative_size, _, obj in wrapping:
            if taken - negative_size <= share * room:
                chosen.append(obj)
                taken -= negative_size
        if chosen and frozenset(chosen) not in sets:
            sets.append(frozenset(chosen))
    return sets


def fast_homes(program: Program) -> frozenset[str]:
    """The persistent objects a steady-state plan homes in fast memory."""
    objects = program.objects_by_id
    return frozenset(o for o in program.persistent if objects[o].location is Location.FAST)


def dropped_homes(program: Program) -> frozenset[str]:
    """The fast-homed persistent objects of a planned ``program`` that leave fast memory
    within the iteration (a directive drops them): placement must bring each back to its
    home's offset (``placement.wrap_pairs``), which packing cannot always do."""
    homes = fast_homes(program)
    if not homes:
        return frozenset()
    dropped = {
        obj
        for issuer in (program.prologue, *program.tasks)
        for obj in (*issuer.releases, *issuer.offloads)
    }
    return homes & dropped


def steady_state(
    bare: Program,
    chain: Chain,
    budget_bytes: int,
    slow_budget_bytes: int | None = None,
    homes: Sequence[frozenset[str]] | None = None,
    *,
    packable: bool = False,
) -> Program | None:
    """The steady-state plan of ``bare`` (one iteration, its persistent objects homed) at
    ``budget_bytes``, or None when no home set's plan is found there that repeats.

    ``packable`` (a re-plan after a packing failed on fragmentation) ranks first the plans
    that drop no read-only fast home within the iteration (``dropped_homes``): each such
    drop ties two residencies to one offset, and as a read-only home is dropped for free
    (no write-back), the fastest plan drops them more often than placement can pack
    (llama3_tiny with its embedding and block 0 frozen, at 700,000 bytes: no packing
    without it). Plans of programs without read-only objects rank as before.

    ``chain`` is that of ``bare`` with every persistent object homed slow
    (``with_homes(bare, frozenset())``). ``homes``: the sets of fast homes to try instead
    of ``home_sets``' (e.g. the one an earlier plan of a similar program chose,
    ``fast_homes``: the training plugin's recompute planner plans many candidates of one
    step, whose persistent objects and boundary are the same)."""
    if homes is None:
        homes = home_sets(chain, bare.persistent, budget_bytes)
    else:
        homes = [frozenset(fast) for fast in homes]
        unknown = sorted(set().union(*homes) - set(bare.persistent))
        if unknown:
            raise PlanningError(
                f"homes names objects that are not persistent in {bare.name!r}: "
                + ", ".join(map(repr, unknown[:5]))
            )
    best, best_rank = None, None
    for fast in homes:
        homed = with_homes(bare, fast)
        homed_chain = chain if not fast else build_chain(homed)
        found = search(
            homed,
            budget_bytes,
            slow_budget_bytes=slow_budget_bytes,
            chain=homed_chain,
            below=monotone_capacities(homed_chain),
        )
        if found.best is None:
            continue
        cycle = check_cycle(found.best.program, budget_bytes, slow_budget_bytes, one=found.best.sim)
        if not cycle.valid:
            continue
        rank = (
            packable and bool(dropped_homes(found.best.program) & bare.read_only_ids),
            cycle.iteration_us,
            found.best.sim.h2d.bytes + found.best.sim.d2h.bytes,
        )
        if best_rank is None or rank < best_rank:
            best, best_rank = found.best.program, rank
    return best
