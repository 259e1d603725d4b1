"""A Program lowered to integer-indexed lists: what the simulator's hot loop reads.

Object ids become indices into ``obj_ids``; every per-task list (``needs``, ``outputs``,
directives) holds those indices, so the event loop never hashes a string.
"""

from __future__ import annotations

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
    obj_ids = tuple(obj.id for obj in program.objects)
    index = {obj_id: position for position, obj_id in enumerate(obj_ids)}
    size_bytes = tuple(obj.size_bytes for obj in program.objects)
    created = program.producers
    initial_fast = tuple(
        index[obj.id]
        for obj in program.objects
        if obj.id not in created and obj.location is Location.FAST
    )
    initial_slow = tuple(
        index[obj.id]
        for obj in program.objects
        if obj.id not in created and obj.location is Location.SLOW
    )

    position_of = index.__getitem__
    size_of = size_bytes.__getitem__

    def ids(names: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(map(position_of, names)) if names else ()

    needs, mutates, outputs, releases, offloads, prefetches = [], [], [], [], [], []
    reserve_bytes, footprint_bytes = [], []
    for task in program.tasks:
        task_mutates = ids(task.mutates)
        task_needs = ids(task.inputs) + task_mutates
        task_outputs = ids(task.outputs)
        reserve = task.workspace_bytes + sum(map(size_of, task_outputs))
        needs.append(task_needs)
        mutates.append(task_mutates)
        outputs.append(task_outputs)
        releases.append(ids(task.releases))
        offloads.append(ids(task.offloads))
        prefetches.append(ids(task.prefetches))
        reserve_bytes.append(reserve)
        footprint_bytes.append(reserve + sum(map(size_of, task_needs)))
    finals = program.final_locations.items()
    return CompiledProgram(
        obj_ids=obj_ids,
        size_bytes=size_bytes,
        initial_fast=initial_fast,
        initial_slow=initial_slow,
        task_ids=tuple(task.id for task in program.tasks),
        cost_us=tuple(float(task.cost_us) for task in program.tasks),
        needs=tuple(needs),
        mutates=tuple(mutates),
        outputs=tuple(outputs),
        workspace_bytes=tuple(task.workspace_bytes for task in program.tasks),
        reserve_bytes=tuple(reserve_bytes),
        footprint_bytes=tuple(footprint_bytes),
        releases=tuple(releases),
        offloads=tuple(offloads),
        prefetches=tuple(prefetches),
        final_fast=tuple(index[obj] for obj, where in finals if where is Location.FAST),
        final_slow=tuple(index[obj] for obj, where in finals if where is Location.SLOW),
    )
