"""Values in and out of a lowered step: packed start values from a model state, per-round
data, and the model state read back from the engine.

A model state is ``{"<layer>.<param>": tensor}`` (the reference model's ``state_dict``
keys). Parameter objects are filled from it, optimizer state and Aux start at zero, and
each round's tokens and targets come from ``data(step, round_) -> (tokens, targets)``;
a step with segments (``TrainConfig.segments``) takes ``(tokens, targets, segments)``,
the segments stacked (``Segments.stacked``).

This is where a vocabulary table stored padded (``TensorSpec.rows``) meets the state: the
state holds the real rows, the object more; filling one copies the rows in over zeros,
reading it back takes them out. The optimizer state leaves the step the same way: its raw
bytes laid out for the state's shapes (``state_layouts``), so a checkpoint's is the same
whatever the step pads (and one written before the padding resumes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dataflow_training.step.family import state_rows, stored_pieces
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import Lowered
from dataflow_training.step.packing import Layout

Data = Callable[[int, int], tuple[torch.Tensor, ...]]

#: where each data role sits in what ``Data`` returns
DATA_INDEX = {"tokens": 0, "targets": 1, "segments": 2}


def data_values(
    data_objects: Mapping[str, tuple[int, str]], data: Data, step: int = 0
) -> dict[str, torch.Tensor]:
    """``step``'s tokens and targets (and segments) from ``data``, by object
    (``StepLayout.data_objects``)."""
    rounds: dict[int, tuple[torch.Tensor, ...]] = {}
    values = {}
    for obj_id, (round_, role) in data_objects.items():
        if round_ not in rounds:
            rounds[round_] = data(step, round_)
        values[obj_id] = rounds[round_][DATA_INDEX[role]]
    return values


def packed_buffer(
    layout: StepLayout,
    obj_id: str,
    state: Mapping[str, torch.Tensor] | None = None,
    rows: Mapping[str, int] | None = None,
    pieces: Mapping[tuple[str, str, str], slice] | None = None,
) -> torch.Tensor:
    """A packed object's bytes: zeros, with each entry copied from ``state`` (a ``W``
    object's parameters by ``<layer>.<name>``) when given; an entry of ``rows``
    (``state_rows``) takes the state's tensor into its first rows, the rest staying zero;
    an entry of ``pieces`` (``state_pieces``) its rows of the state's tensor."""
    packed = layout.packed[obj_id]
    buffer = torch.zeros(packed.layout.size_bytes, dtype=torch.uint8)
    if state is not None:
        rows = rows or {}
        for name, view in packed.layout.views(buffer).items():
            key = f"{packed.layer}.{name}"
            if key not in state:
                raise KeyError(f"the model state has no {key!r} (needed by {obj_id})")
            view[: rows.get(key, view.shape[0])].copy_(
                state[key][piece_rows(pieces or {}, packed, name)]
            )
    return buffer


def state_pieces(layers: Any) -> dict[tuple[str, str, str], slice]:
    """``{(layer, group, param): rows}`` of every parameter the step stores a piece of
    (``step.family.stored_pieces``)."""
    return {key: p.state_slice for key, p in stored_pieces(layers).items()}


def piece_rows(pieces: Mapping[tuple[str, str, str], slice], packed: Any, name: str) -> slice:
    """The rows of the state's tensor entry ``name`` of ``packed`` (a ``W`` or ``dW``
    object) stores: all of them, or a piece's share (``state_pieces``)."""
    return pieces.get((packed.layer, packed.group, name), slice(None))


def stored_state(layers: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each padded table (``state_rows``) as the step stores it: its rows
    over zeros up to ``TensorSpec.shape``; every other tensor as it is."""
    shapes = {f"{layer.name}.{p.name}": p.shape for layer in layers for p in layer.params}
    out = dict(state)
    for key, rows in state_rows(layers).items():
        if key in out:
            tensor = out[key]
            out[key] = tensor.new_zeros(shapes[key])
            out[key][:rows] = tensor
    return out


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
        self._rows = state_rows(lowered.layers)
        self._pieces = state_pieces(lowered.layers)
        self._data = self.layout.data_objects()
        self.given = dict(given or {})
        self._taken: dict[str, int] = {}  # rows of each sharded state tensor taken
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
            return self.data(self.step, round_)[DATA_INDEX[role]]
        packed = self.layout.packed[obj_id]
        if packed.kind != "W":
            return packed_buffer(self.layout, obj_id)
        value = packed_buffer(self.layout, obj_id, self.state, self._rows, self._pieces)
        if self.consume:  # the engine holds the bytes now: the host copy may go
            for name, view in packed.layout.views(value).items():
                key = f"{packed.layer}.{name}"
                if piece_rows(self._pieces, packed, name) != slice(
                    None
                ):  # a shard: once all are taken
                    self._taken[key] = self._taken.get(key, 0) + view.shape[0]
                    if self._taken[key] < self.state[key].shape[0]:
                        continue
                self.state.pop(key, None)
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
    step's program leaves in slow memory, read through ``fetch(obj_id)``; a padded table
    its real rows (``state_rows``)."""
    program, layout = lowered.program, lowered.layout
    rows, pieces_of = state_rows(lowered.layers), state_pieces(lowered.layers)
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}  # expert shards' pieces, joined
    for packed in layout.of_kind(kind):
        if packed.id not in program.final_locations:
            continue
        for name, view in packed.layout.views(fetch(packed.id)).items():
            key = f"{packed.layer}.{name}"
            where = piece_rows(pieces_of, packed, name)
            if where != slice(None):
                pieces.setdefault(key, []).append((where.start, view.clone()))
                continue
            out[key] = view[: rows.get(key, view.shape[0])].clone()
    for key, parts in pieces.items():
        out[key] = torch.cat([part for _, part in sorted(parts, key=lambda p: p[0])])
    return out


def state_layouts(lowered: Lowered) -> dict[str, Layout]:
    """Each ``O`` object's layout for the model state's shapes: an entry
    (``<param>/<field>``) of a padded table (``state_rows``) holds its real rows only;
    an object with none is laid out as the step lays it out."""
    rows = state_rows(lowered.layers)
    out = {}
    for packed in lowered.layout.of_kind("O"):
        entries = packed.layout.entries
        real = [rows.get(f"{packed.layer}.{e.name.rsplit('/', 1)[0]}") for e in entries]
        if not any(real):
            out[packed.id] = packed.layout
            continue
        out[packed.id] = Layout.pack(
            (e.name, e.shape if r is None else (r, *e.shape[1:]), e.dtype)
            for e, r in zip(entries, real, strict=True)
        )
    return out


def opt_for_state(lowered: Lowered, opt: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``O`` objects' raw bytes as the step stores them -> laid out for the state
    (``state_layouts``: a padded table's real rows)."""
    layouts = state_layouts(lowered)
    return {
        obj_id: _repack(raw, lowered.layout.packed[obj_id].layout, layouts[obj_id])
        for obj_id, raw in opt.items()
    }


def opt_for_step(lowered: Lowered, opt: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``opt_for_state`` undone: the padded rows zero."""
    layouts = state_layouts(lowered)
    return {
        obj_id: _repack(raw, layouts[obj_id], lowered.layout.packed[obj_id].layout)
        for obj_id, raw in opt.items()
    }


def recut_opt(
    old: Lowered, new: Lowered, opt: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``opt`` (the ``O`` objects of ``old``'s step, laid out for the state:
    ``opt_for_state``) for ``new``'s step, which cuts the same parameters in other pieces
    (``TrainConfig.vocab_pieces``, ``expert_shards``): an object laid out alike in both is
    kept; every entry of the others (``<param>/<field>``) is joined from ``old``'s pieces
    along its rows, in piece order, and cut again into ``new``'s. An entry whose rows are
    not its parameter's piece rows (a state not shaped like its parameter: 8-bit AdamW's
    block scales, Adafactor's factors) is a ValueError naming it."""
    old_layouts, new_layouts = state_layouts(old), state_layouts(new)
    out = {k: v for k, v in opt.items() if new_layouts.get(k) == old_layouts.get(k)}
    old_pieces, new_pieces = stored_pieces(old.layers), stored_pieces(new.layers)
    parts: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for obj_id, raw in opt.items():
        if obj_id in out:
            continue
        packed = old.layout.packed[obj_id]
        for name, view in old_layouts[obj_id].views(raw).items():
            index, _count = _entry_piece(old_pieces, packed, name, view)
            parts.setdefault((packed.layer, name), []).append((index, view))
    for obj_id, layout in new_layouts.items():
        if obj_id in out:
            continue
        packed = new.layout.packed[obj_id]
        buffer = torch.zeros(layout.size_bytes, dtype=torch.uint8)
        for name, view in layout.views(buffer).items():
            found = sorted(parts.get((packed.layer, name), []), key=lambda p: p[0])
            if not found:
                raise ValueError(f"the optimizer state has no {packed.layer}.{name} for {obj_id}")
            whole = torch.cat([part for _, part in found])
            index, count = _entry_piece(new_pieces, packed, name, view)
            rows = view.shape[0]
            if whole.shape[0] != rows * count or whole.shape[1:] != view.shape[1:]:
                raise ValueError(
                    f"the optimizer state's {packed.layer}.{name} joins to "
                    f"{tuple(whole.shape)}, which {count} pieces of {tuple(view.shape)} do "
                    "not make: it cannot be cut into other pieces"
                )
            view.copy_(whole[index * rows : (index + 1) * rows])
        out[obj_id] = buffer
    return out


def _entry_piece(
    pieces: Mapping[tuple[str, str, str], Any], packed: Any, name: str, view: torch.Tensor
) -> tuple[int, int]:
    """``(index, count)`` of the piece of its parameter the optimizer state entry ``name``
    (``<param>/<field>``, ``view``) of ``packed`` holds (``pieces``: the step's
    ``stored_pieces``; ``(0, 1)``: whole); a piece's entry not shaped like the piece is a
    ValueError (it cannot be cut by rows)."""
    param = name.rsplit("/", 1)[0]
    spec = pieces.get((packed.layer, packed.group, param))
    if spec is None:
        return 0, 1
    if tuple(view.shape) != tuple(spec.shape):
        raise ValueError(
            f"the optimizer state's {name} is shaped {tuple(view.shape)}, not like its "
            f"parameter's piece {tuple(spec.shape)}: it cannot be cut into other pieces"
        )
    return spec.piece


def _repack(raw: torch.Tensor, source: Layout, target: Layout) -> torch.Tensor:
    """``raw`` (laid out by ``source``) laid out by ``target``: each entry's leading rows
    that both have, zeros elsewhere; ``raw`` itself when the layouts are one."""
    if source == target:
        return raw
    out = torch.zeros(target.size_bytes, dtype=torch.uint8)
    have = source.views(raw)
    for name, view in target.views(out).items():
        rows = min(view.shape[0], have[name].shape[0])
        view[:rows].copy_(have[name][:rows])
    return out
