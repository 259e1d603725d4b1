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

from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import Lowered

Data = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def data_values(
    data_objects: Mapping[str, tuple[int, str]], data: Data, step: int = 0
) -> dict[str, torch.Tensor]:
    """``step``'s tokens and targets from ``data``, by object (``StepLayout.data_objects``)."""
    rounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    values = {}
    for obj_id, (round_, role) in data_objects.items():
        if round_ not in rounds:
            rounds[round_] = data(step, round_)
        values[obj_id] = rounds[round_][0 if role == "tokens" else 1]
    return values


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


class StartValues(Mapping[str, torch.Tensor]):
    """``start_values`` built one object at a time, as the engine asks for each (a 30B
    model's zero optimizer state alone would take tens of GB if built at once, beside
    the pinned pool the engine copies it into). ``given`` replaces an object's value
    (optimizer state carried over); every other value is made afresh on each lookup and
    kept by nobody here. With ``consume``, a parameter object's entries are removed from
    ``state`` (a dict) once its packed value is made: an 8B model's host copy of the
    weights goes as the engine takes each object."""

    def __init__(
        self,
        lowered: Lowered,
        state: Mapping[str, torch.Tensor],
        data: Data,
        *,
        step: int = 0,
        given: Mapping[str, torch.Tensor] | None = None,
        consume: bool = False,
    ) -> None:
        self.consume = consume
        program = lowered.program
        self.program, self.state, self.data, self.step = program, state, data, step
        self.layout = lowered.layout
        self._data = self.layout.data_objects()
        self.given = dict(given or {})
        self._ids = [o.id for o in program.objects if program.exists_at_start(o.id)]
        self._roles = {o.id: o.role for o in program.objects if o.id in set(self._ids)}
        unknown = sorted(set(self.given) - set(self._ids))
        if unknown:
            raise KeyError(f"start values given for objects that do not start: {unknown}")

    def __getitem__(self, obj_id: str) -> torch.Tensor:
        if obj_id not in self._roles:
            raise KeyError(obj_id)
        if obj_id in self.given:
            return self.given[obj_id]
        if self._roles[obj_id] == "data":
            round_, role = self._data[obj_id]
            tokens, targets = self.data(self.step, round_)
            return tokens if role == "tokens" else targets
        packed = self.layout.packed[obj_id]
        if packed.kind != "W":
            return packed_buffer(self.layout, obj_id)
        value = packed_buffer(self.layout, obj_id, self.state)
        if self.consume:  # the engine holds the bytes now: the host copy may go
            for name in packed.layout.views(value):
                self.state.pop(f"{packed.layer}.{name}", None)
        return value

    def __contains__(self, obj_id: object) -> bool:  # without building the value
        return obj_id in self._roles

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def start_values(
    lowered: Lowered,
    state: Mapping[str, torch.Tensor],
    data: Data,
    *,
    step: int = 0,
    data_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Every object that exists at the program's start: parameters from ``state``, zero
    optimizer state and Aux, and ``step``'s tokens and targets from ``data``. With
    ``data_only``, just the tokens and targets (the feed of a later step)."""
    if not data_only:
        return dict(StartValues(lowered, state, data, step=step))
    return data_values(lowered.layout.data_objects(), data, step)


def read_state(
    lowered: Lowered, fetch: Callable[[str], Any], kind: str = "W"
) -> dict[str, torch.Tensor]:
    """``{"<layer>.<name>": tensor}`` of every ``kind`` object (``W``, ``dW``) that the
    step's program leaves in slow memory, read through ``fetch(obj_id)``."""
    program, layout = lowered.program, lowered.layout
    out = {}
    for packed in layout.of_kind(kind):
        if packed.id not in program.final_locations:
            continue
        for name, view in packed.layout.views(fetch(packed.id)).items():
            out[f"{packed.layer}.{name}"] = view.clone()
    return out
