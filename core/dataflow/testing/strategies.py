"""Hypothesis strategies of random Programs, for property tests here and in plugins.

This is the only module of ``dataflow`` that imports hypothesis; import it from tests only.

- ``bare_chains()``: structurally valid chains without directives (what a planner takes).
- ``annotated_chains()``: the same, with coherent directives: every object a task uses is
  made resident in time (prefetched a random number of tasks ahead after it left), and
  between uses objects randomly stay, or leave by offload (dirty) or release (clean). No
  directive is an error by itself, so runs fail only for lack of memory (a deadlock or a
  footprint over the budget) when ``budgets`` draws a tight one.

Every drawn program passes ``dataflow.schema.validate`` (tests check this).
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from dataflow.schema import Budget, Link, Links, Location, Obj, Program, Role, Task
from dataflow.testing.chains import stream_all

_ROLES = [Role.PARAM, Role.OPT_STATE, Role.DATA, Role.AUX]


@st.composite
def links(draw: st.DrawFn) -> Links:
    """Random links with whole-number bandwidths and latencies (exact float sums)."""

    def link() -> Link:
        return Link(float(draw(st.integers(1, 64))), float(draw(st.integers(0, 8))))

    return Links(h2d=link(), d2h=link())


@st.composite
def bare_chains(
    draw: st.DrawFn,
    *,
    min_tasks: int = 1,
    max_tasks: int = 12,
    max_initial_objects: int = 6,
    max_size_bytes: int = 400,
    max_cost_us: int = 50,
    first_task_fast: bool = True,
) -> Program:
    """A random chain: objects that exist at the start (some fast, some slow), tasks that
    read and mutate 1-3 existing objects and create 0-2 new ones. No budget, no
    directives; with ``first_task_fast`` the objects the first task uses start fast (else
    they may start slow: a planner fetches them from the prologue)."""
    sizes = st.integers(1, max_size_bytes)
    count = draw(st.integers(1, max_initial_objects))
    objects = [
        Obj(
            f"o{k}",
            draw(sizes),
            draw(st.sampled_from(_ROLES)),
            draw(st.sampled_from([Location.FAST, Location.SLOW])),
        )
        for k in range(count)
    ]
    existing = [obj.id for obj in objects]
    tasks = []
    for index in range(draw(st.integers(min_tasks, max_tasks))):
        uses = draw(st.lists(st.sampled_from(existing), min_size=1, max_size=3, unique=True))
        mutated = draw(st.integers(0, len(uses)))
        outputs = [f"t{index}_out{k}" for k in range(draw(st.integers(0, 2)))]
        objects += [Obj(out, draw(sizes), Role.ACTIVATION) for out in outputs]
        existing += outputs
        tasks.append(
            Task(
                f"t{index}",
                draw(st.sampled_from(["fwd", "bwd", "opt"])),
                "k",
                inputs=uses[mutated:],
                mutates=uses[:mutated],
                outputs=outputs,
                workspace_bytes=draw(st.sampled_from([0, 0, draw(sizes)])),
                cost_us=float(draw(st.integers(0, max_cost_us))),
            )
        )
    first = set(tasks[0].uses) if first_task_fast else set()
    objects = [
        attrs.evolve(obj, location=Location.FAST) if obj.id in first else obj for obj in objects
    ]
    return Program(name="random-chain", objects=objects, tasks=tasks, links=draw(links()))


@st.composite
def annotated_chains(
    draw: st.DrawFn,
    *,
    min_tasks: int = 1,
    max_tasks: int = 12,
    max_initial_objects: int = 6,
    max_size_bytes: int = 400,
    budgets: bool = True,
    final_locations: bool = True,
) -> Program:
    """A random chain with coherent directives (see the module docstring).

    With ``budgets``, half the programs get a fast budget between the largest task
    footprint and the total size of all objects (so some runs wait, some deadlock); with
    ``final_locations``, some objects are given a final location, which the directives
    honour.
    """
    program = draw(
        bare_chains(
            min_tasks=min_tasks,
            max_tasks=max_tasks,
            max_initial_objects=max_initial_objects,
            max_size_bytes=max_size_bytes,
        )
    )
    if final_locations:
        used = {obj for task in program.tasks for obj in task.uses}
        chosen = draw(st.lists(st.sampled_from(sorted(used)), max_size=3, unique=True))
        finals = {obj: draw(st.sampled_from([Location.FAST, Location.SLOW])) for obj in chosen}
        program = attrs.evolve(program, final_locations=finals)
    program = stream_all(
        program,
        lookahead_tasks=draw(st.integers(1, 4)),
        min_gap_tasks=draw(st.integers(2, 3)),
        evict=lambda obj, use, next_use: draw(st.booleans()),
    )
    if budgets and draw(st.booleans()):
        sizes = {obj.id: obj.size_bytes for obj in program.objects}
        floor = max(
            task.workspace_bytes + sum(sizes[obj] for obj in task.uses) for task in program.tasks
        )
        start = sum(obj.size_bytes for obj in program.objects if obj.location is Location.FAST)
        kept = sum(sizes[obj] for obj, at in program.final_locations.items() if at is Location.FAST)
        floor = max(floor, start, kept)
        program = attrs.evolve(
            program, budget=Budget(draw(st.integers(floor, floor + sum(sizes.values()))))
        )
    return program
