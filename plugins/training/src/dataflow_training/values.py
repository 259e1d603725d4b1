"""Values in and out of a lowered step: packed start values from a model state, per-round
data, and the model state read back from the engine.

A model state is ``{"<layer>.<param>": tensor}`` (the reference model's ``state_dict``
keys). Parameter objects are filled from it, optimizer state and Aux start at zero, and
each round's tokens and targets come from ``data(step, round_) -> (tokens, targets)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dataflow.schema import Program
from dataflow_training.step import StepLayout

Data = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def _round_of(obj_id: str) -> int:
    return int(obj_id.split("_")[2])


def packed_buffer(
    layout: StepLayout, obj_id: str, state: Mapping[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """A packed object's bytes: zeros, with each entry copied from ``state`` (a ``W``
    object's parameters by ``<layer>.<name>``) when given."""
    packed = layout.packed[obj_id]
    buffer = torch.zeros(packed.layout.size_bytes, dtype=torch.uint8)
    if state is not None:
        for name, view in packed.layout.views(buffer).items():
            key = f"{packed.layer}.{name}"
            if key not in state:
                raise KeyError(f"the model state has no {key!r} (needed by {obj_id})")
            view.copy_(state[key])
    return buffer


def start_values(
    program: Program,
    state: Mapping[str, torch.Tensor],
    data: Data,
    *,
    step: int = 0,
    data_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Every object that exists at the program's start: parameters from ``state``, zero
    optimizer state and Aux, and ``step``'s tokens and targets from ``data``. With
    ``data_only``, just the tokens and targets (the feed of a later step)."""
    layout = None if data_only else StepLayout.of(program)  # parsing it costs host time
    values: dict[str, torch.Tensor] = {}
    for obj in program.objects:
        if not program.exists_at_start(obj.id):
            continue
        if obj.role == "data":
            tokens, targets = data(step, _round_of(obj.id))
            values[obj.id] = tokens if obj.id.startswith("x_") else targets
        elif layout is not None:
            packed = layout.packed[obj.id]
            values[obj.id] = packed_buffer(layout, obj.id, state if packed.kind == "W" else None)
    return values


def read_state(
    program: Program, fetch: Callable[[str], Any], kind: str = "W"
) -> dict[str, torch.Tensor]:
    """``{"<layer>.<name>": tensor}`` of every ``kind`` object (``W``, ``dW``) that the
    program leaves in slow memory, read through ``fetch(obj_id)``."""
    layout = StepLayout.of(program)
    out = {}
    for packed in layout.of_kind(kind):
        if packed.id not in program.final_locations:
            continue
        for name, view in packed.layout.views(fetch(packed.id)).items():
            out[f"{packed.layer}.{name}"] = view.clone()
    return out
