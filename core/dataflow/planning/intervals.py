"""Residency intervals: a bare chain lowered to what PressureFit reasons about.

Every object has a sorted list of *uses* (task indices at which it must be resident). Two
virtual uses make the chain's ends explicit: an object that starts in fast memory is used
at task 0 (it is resident while task 0 runs, and dirty: it has no slow copy, unless it is
a persistent object no task changes, ``Program.read_only_ids``, whose slow copy holds its
one value once it is dropped: ``Program.backed_ids``), and an object whose final location
is ``fast`` is used at index ``n`` (the end of the run, a pseudo-task with no cost). Between two consecutive uses ``a < b`` lies a *gap*; a kept gap holds the
object resident during tasks ``a+1 .. b-1``; a cut gap drops it after ``a`` (a release if
clean, an offload if dirty) and prefetches it before ``b``. An object that starts in slow
memory needs a *head* prefetch before its first use (issued by the prologue, "task -1",
when no task ends early enough).

``base_bytes[t]`` is what task ``t`` holds no matter what: its workspace and every object
it uses. Pure Python, integer indices, plain tuples: the planner's inner loops read these.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

import attrs

from dataflow.schema import Link, Location, Program


class Origin(enum.StrEnum):
    """Where an object comes from: present at the start (fast or slow), or created by a task."""

    FAST = "fast"
    SLOW = "slow"
    CREATED = "created"


class PlanningError(ValueError):
    """A chain that cannot be planned, or a plan that does not run."""


@attrs.frozen
class ObjectLife:
    """One object's uses, in task order (virtual uses included), and how it starts and ends.

    ``dirties[k]`` is True when use ``k`` leaves the object without a current slow copy
    (it creates or mutates the object, or it is the virtual start use of a fast object
    that is not read-only).
    """

    index: int
    obj_id: str
    size_bytes: int
    origin: Origin
    final: Location | None
    uses: tuple[int, ...]
    dirties: tuple[bool, ...]


@attrs.frozen
class Chain:
    """A bare program, indexed for planning. Task ``n`` is the end of the run (no cost)."""

    program: Program
    task_ids: tuple[str, ...]
    cost_us: tuple[float, ...]
    #: ideal start time of each task when nothing stalls; ``start_us[n]`` is total compute
    start_us: tuple[float, ...]
    #: per task (0..n): workspace + size of every object it uses, virtual uses included
    base_bytes: tuple[int, ...]
    #: per real task: inputs + mutates + outputs + workspace (``validate``'s footprint)
    footprint_bytes: tuple[int, ...]
    objects: tuple[ObjectLife, ...]
    h2d: Link
    d2h: Link
    #: per object: its transfer time over ``h2d`` and over ``d2h`` (the sweeps read these)
    load_us: tuple[float, ...] = ()
    write_us: tuple[float, ...] = ()

    @property
    def n_tasks(self) -> int:
        return len(self.task_ids)

    def task_at_or_before(self, time_us: float) -> int:
        """The last task index ``t`` (0..n) whose ideal start is at or before ``time_us``;
        -1 when ``time_us`` is before the start."""
        return bisect.bisect_right(self.start_us, time_us) - 1

    def h2d_us(self, size_bytes: int) -> float:
        return self.h2d.transfer_us(size_bytes)

    def d2h_us(self, size_bytes: int) -> float:
        return self.d2h.transfer_us(size_bytes)


@attrs.frozen
class Gaps:
    """Every gap of every object, as parallel tuples indexed by gap id, in (object, use)
    order. ``first_gap[o]`` is object ``o``'s first gap id; its gaps are consecutive."""

    obj: tuple[int, ...]
    a: tuple[int, ...]
    b: tuple[int, ...]
    size_bytes: tuple[int, ...]
    first_gap: tuple[int, ...]


def build_chain(program: Program) -> Chain:
    """Lower ``program`` (its directives are ignored: the planner plans the bare chain).

    An object that starts in slow memory and is needed by task 0 is fetched by the
    prologue (directives that fire at program start).
    """
    tasks = program.tasks
    n = len(tasks)
    index = {obj.id: position for position, obj in enumerate(program.objects)}
    uses: list[list[int]] = [[] for _ in program.objects]
    dirties: list[list[bool]] = [[] for _ in program.objects]
    base = [0] * (n + 1)
    footprint = [0] * n
    produced = program.producers
    origins = []
    for obj in program.objects:
        if obj.id in produced:
            origins.append(Origin.CREATED)
        else:
            origins.append(Origin.FAST if obj.location is Location.FAST else Origin.SLOW)
    read_only = program.read_only_ids
    for position, origin in enumerate(origins):
        if origin is Origin.FAST:
            uses[position].append(0)
            dirties[position].append(program.objects[position].id not in read_only)
    sizes = [obj.size_bytes for obj in program.objects]
    named_by = [-1] * len(sizes)  # the last task that named each object
    for t, task in enumerate(tasks):
        held = task.workspace_bytes
        for changes, named in ((False, task.inputs), (True, task.mutates), (True, task.outputs)):
            for obj_id in named:
                position = index[obj_id]
                at = uses[position]
                if named_by[position] == t or (at and at[-1] == t):
                    # named twice by this task, or the virtual start use at task 0
                    if named_by[position] != t:
                        held += sizes[position]
                        named_by[position] = t
                    if changes:
                        dirties[position][-1] = True
                    continue
                named_by[position] = t
                held += sizes[position]
                at.append(t)
                dirties[position].append(changes)
        footprint[t] = held
    final = program.final_locations
    for position, obj in enumerate(program.objects):
        if final.get(obj.id) is Location.FAST:
            uses[position].append(n)
            dirties[position].append(False)
    lives = []
    for position, obj in enumerate(program.objects):
        life_uses = tuple(uses[position])
        for t in life_uses:
            base[t] += obj.size_bytes
        lives.append(
            ObjectLife(
                index=position,
                obj_id=obj.id,
                size_bytes=obj.size_bytes,
                origin=origins[position],
                final=final.get(obj.id),
                uses=life_uses,
                dirties=tuple(dirties[position]),
            )
        )
    for t, task in enumerate(tasks):
        base[t] += task.workspace_bytes
    cost = tuple(float(task.cost_us) for task in tasks)
    start = [0.0]
    for c in cost:
        start.append(start[-1] + c)
    return Chain(
        program=program,
        task_ids=tuple(task.id for task in tasks),
        cost_us=cost,
        start_us=tuple(start),
        base_bytes=tuple(base),
        footprint_bytes=tuple(footprint),
        objects=tuple(lives),
        h2d=program.links.h2d,
        d2h=program.links.d2h,
        load_us=tuple(map(program.links.h2d.transfer_us, sizes)),
        write_us=tuple(map(program.links.d2h.transfer_us, sizes)),
    )


def build_gaps(chain: Chain) -> Gaps:
    """Every gap between consecutive uses (including gaps of length 1, which hold nothing)."""
    obj, a_list, b_list, sizes, first = [], [], [], [], []
    for life in chain.objects:
        first.append(len(obj))
        for a, b in zip(life.uses, life.uses[1:], strict=False):
            obj.append(life.index)
            a_list.append(a)
            b_list.append(b)
            sizes.append(life.size_bytes)
    return Gaps(tuple(obj), tuple(a_list), tuple(b_list), tuple(sizes), tuple(first))


def kept_profile(chain: Chain, gaps: Gaps, cut: Sequence[bool] | None = None) -> list[int]:
    """Bytes held at each task 0..n by the gaps that are kept (all of them when ``cut`` is
    None), not counting the uses themselves."""
    n = chain.n_tasks
    diff = [0] * (n + 2)
    for g, size in enumerate(gaps.size_bytes):
        a, b = gaps.a[g], gaps.b[g]
        if b - a >= 2 and (cut is None or not cut[g]):
            diff[a + 1] += size
            diff[b] -= size
    profile, acc = [], 0
    for t in range(n + 1):
        acc += diff[t]
        profile.append(acc)
    return profile


def no_offload_peak_bytes(chain: Chain) -> int:
    """Peak fast memory when nothing is ever dropped before its last use (heads excluded:
    a slow object arrives just in time)."""
    kept = kept_profile(chain, build_gaps(chain))
    return max((base + held for base, held in zip(chain.base_bytes, kept, strict=True)), default=0)
