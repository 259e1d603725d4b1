"""A Program lowered to integer-indexed lists: what the simulator's hot loop reads.

Object ids become indices into ``obj_ids``; every per-task list (``needs``, ``outputs``,
directives) holds those indices, so the event loop never hashes a string.
"""

from __future__ import annotations

from operator import add, attrgetter

import attrs

from dataflow.schema import Location, Program


@attrs.frozen
class CompiledProgram:
    """Per-object and per-task facts of one Program, as plain lists indexed by position."""

    obj_ids: tuple[str, ...]
    size_bytes: tuple[int, ...]
    #: objects present at the start: no task creates them, and where they start
    initial_fast: tuple[int, ...]
    initial_slow: tuple[int, ...]
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


def compile_program(program: Program) -> CompiledProgram:
    """Lower a structurally valid ``program`` (see ``dataflow.schema.validate``)."""
    objects, tasks = program.objects, program.tasks
    obj_ids = tuple(obj.id for obj in objects)
    index = {obj_id: position for position, obj_id in enumerate(obj_ids)}
    size_bytes = tuple(obj.size_bytes for obj in objects)
    position_of = index.__getitem__
    size_of = size_bytes.__getitem__

    def ids(field: str) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(map(position_of, names)) if names else ()
            for names in map(attrgetter(field), tasks)
        )

    inputs, mutates, outputs = ids("inputs"), ids("mutates"), ids("outputs")
    needs = tuple(map(add, inputs, mutates))
    reserve_bytes = tuple(
        task.workspace_bytes + sum(map(size_of, made))
        for task, made in zip(tasks, outputs, strict=True)
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
    return CompiledProgram(
        obj_ids=obj_ids,
        size_bytes=size_bytes,
        initial_fast=tuple(initial_fast),
        initial_slow=tuple(initial_slow),
        task_ids=tuple(task.id for task in tasks),
        cost_us=tuple(float(task.cost_us) for task in tasks),
        needs=needs,
        mutates=mutates,
        outputs=outputs,
        workspace_bytes=tuple(task.workspace_bytes for task in tasks),
        reserve_bytes=reserve_bytes,
        footprint_bytes=footprint_bytes,
        releases=ids("releases"),
        offloads=ids("offloads"),
        prefetches=ids("prefetches"),
        final_fast=tuple(index[obj] for obj, where in finals if where is Location.FAST),
        final_slow=tuple(index[obj] for obj, where in finals if where is Location.SLOW),
    )
