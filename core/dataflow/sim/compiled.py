"""A Program lowered to integer-indexed lists: what the simulator's hot loop reads.

Object ids become indices into ``obj_ids``; every per-task list (``needs``, ``outputs``,
directives) holds those indices, so the event loop never hashes a string.

The prologue is compiled as one more entry, at index ``n_tasks``, of every per-task list:
a pseudo-task of no cost and no uses that "completes" at time 0 (its directives fire then,
in the first pass, before task 0 can be dispatched), so it goes through exactly the code
of a task's completion. ``task_ids[n_tasks]`` is ``PROLOGUE``.

A collective task is compiled like any task (its needs, reservations and directives) and
flagged in ``collective``; ``collective_bytes`` is what it reduces on the collective link.
"""

from __future__ import annotations

from operator import add, attrgetter

import attrs

from dataflow.schema import PROLOGUE, Location, Program


@attrs.frozen
class CompiledProgram:
    """Per-object and per-task facts of one Program, as plain lists indexed by position."""

    #: the number of real tasks (per-task lists have one entry more: the prologue)
    n_tasks: int
    #: whether the prologue has any directive (else the loop skips it)
    has_prologue: bool
    obj_ids: tuple[str, ...]
    size_bytes: tuple[int, ...]
    #: objects present at the start: no task creates them, and where they start
    initial_fast: tuple[int, ...]
    initial_slow: tuple[int, ...]
    #: of ``initial_fast``, those whose slow copy is current too (``Program.backed_ids``)
    initial_backed: tuple[int, ...]
    task_ids: tuple[str, ...]
    cost_us: tuple[float, ...]
    #: inputs + mutates: what must be resident (and not leaving) for the task to start
    needs: tuple[tuple[int, ...], ...]
    mutates: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    workspace_bytes: tuple[int, ...]
    #: size(outputs) + workspace: what the task reserves when it starts
    reserve_bytes: tuple[int, ...]
    #: size(inputs + mutates + outputs) + workspace: all of it must fit at once
    footprint_bytes: tuple[int, ...]
    releases: tuple[tuple[int, ...], ...]
    offloads: tuple[tuple[int, ...], ...]
    prefetches: tuple[tuple[int, ...], ...]
    final_fast: tuple[int, ...]
    final_slow: tuple[int, ...]
    #: per task: whether it runs on the collective link (the prologue: False), and the
    #: bytes it reduces there (its mutates; 0 for a compute task)
    collective: tuple[bool, ...] = ()
    collective_bytes: tuple[int, ...] = ()

    @property
    def has_collectives(self) -> bool:
        return any(self.collective)


def compile_program(program: Program) -> CompiledProgram:
    """Lower a structurally valid ``program`` (see ``dataflow.schema.validate``)."""
    objects, tasks = program.objects, program.tasks
    prologue = program.prologue
    obj_ids = tuple(obj.id for obj in objects)
    index = {obj_id: position for position, obj_id in enumerate(obj_ids)}
    size_bytes = tuple(obj.size_bytes for obj in objects)
    position_of = index.__getitem__
    size_of = size_bytes.__getitem__

    def ids(field: str, with_prologue: bool = False) -> tuple[tuple[int, ...], ...]:
        listed = tuple(
            tuple(map(position_of, names)) if names else ()
            for names in map(attrgetter(field), tasks)
        )
        if not with_prologue:
            return (*listed, ())
        return (*listed, tuple(map(position_of, getattr(prologue, field))))

    inputs, mutates, outputs = ids("inputs"), ids("mutates"), ids("outputs")
    needs = tuple(map(add, inputs, mutates))
    workspace = (*(task.workspace_bytes for task in tasks), 0)
    reserve_bytes = tuple(
        space + sum(map(size_of, made)) for space, made in zip(workspace, outputs, strict=True)
    )
    footprint_bytes = tuple(
        reserve + sum(map(size_of, used))
        for reserve, used in zip(reserve_bytes, needs, strict=True)
    )
    created = {obj for made in outputs for obj in made}
    initial_fast, initial_slow = [], []
    for position, obj in enumerate(objects):
        if position not in created:
            (initial_fast if obj.location is Location.FAST else initial_slow).append(position)
    finals = program.final_locations.items()
    collective = (*(task.collective for task in tasks), False)
    collective_bytes = tuple(
        sum(map(size_of, changed)) if on_link else 0
        for on_link, changed in zip(collective, mutates, strict=True)
    )
    return CompiledProgram(
        n_tasks=len(tasks),
        has_prologue=bool(prologue),
        obj_ids=obj_ids,
        size_bytes=size_bytes,
        initial_fast=tuple(initial_fast),
        initial_slow=tuple(initial_slow),
        initial_backed=tuple(sorted(map(position_of, program.backed_ids))),
        task_ids=(*(task.id for task in tasks), PROLOGUE),
        cost_us=(*(float(task.cost_us) for task in tasks), 0.0),
        needs=needs,
        mutates=mutates,
        outputs=outputs,
        workspace_bytes=workspace,
        reserve_bytes=reserve_bytes,
        footprint_bytes=footprint_bytes,
        releases=ids("releases", True),
        offloads=ids("offloads", True),
        prefetches=ids("prefetches", True),
        final_fast=tuple(index[obj] for obj, where in finals if where is Location.FAST),
        final_slow=tuple(index[obj] for obj, where in finals if where is Location.SLOW),
        collective=collective,
        collective_bytes=collective_bytes,
    )
