"""The key map: how a family's state keys become HF tensor names, and back.

A family declares a table of ``KeyRule``s, one per kind of tensor, with ``{placeholder}``
fields (``"{layer}.ln_1.weight"`` <-> ``"transformer.h.{layer}.ln_1.weight"``). Expanded
against the family's expected state (key -> shape), the table gives one ``Entry`` per state
key: the concrete HF names it is stored as, their shapes, and how to convert. An entry is
one HF tensor, several concatenated (``hf=(gate, up)``, fused projections), one per index of
a stacked leading dimension (``stack="expert"``: per-expert HF tensors, one stacked family
tensor), or both. Pure bookkeeping: ``hf.py`` does the file I/O.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from functools import cache

import attrs
import torch

Shape = tuple[int, ...]


def _same_shape(shape: Shape) -> Shape:
    return shape


@attrs.frozen
class Conversion:
    """A per-tensor change of layout or value between the family and HF.

    ``from_hf`` and ``to_hf`` may compute in any dtype: the kit casts their result to the
    dtype asked for (import) or to the state tensor's dtype (export). ``hf_shape`` maps a
    family shape to the HF shape it is stored as."""

    name: str
    from_hf: Callable[[torch.Tensor], torch.Tensor]
    to_hf: Callable[[torch.Tensor], torch.Tensor]
    hf_shape: Callable[[Shape], Shape] = _same_shape


def _swap_last_two(shape: Shape) -> Shape:
    if len(shape) < 2:
        raise ValueError(f"a transpose needs at least 2 dimensions, the tensor has {shape}")
    return (*shape[:-2], shape[-1], shape[-2])


IDENTITY = Conversion("identity", lambda tensor: tensor, lambda tensor: tensor)

#: The last two dimensions swapped both ways (GPT-2's ``Conv1D`` stores ``(in, out)``).
TRANSPOSE = Conversion(
    "transpose", lambda tensor: tensor.mT, lambda tensor: tensor.mT, _swap_last_two
)


def offset(delta: float) -> Conversion:
    """Family tensor = HF tensor + ``delta``, computed in float32 (Qwen 3.5 stores its
    RMSNorm scale as ``w`` for a norm that multiplies by ``1 + w``: ``offset(1.0)`` gives the
    plain scale). Exact both ways in float32; a bf16 round trip may differ in the last bit."""
    return Conversion(
        f"hf + {delta}",
        lambda tensor: tensor.float() + delta,
        lambda tensor: tensor.float() - delta,
    )


@cache
def _fields(pattern: str) -> tuple[str, ...]:
    """The ``{placeholder}`` names of ``pattern``, in order."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(pattern):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"key pattern {pattern!r}: {{{name}}} is not a plain placeholder")
        names.append(name)
    return tuple(names)


@cache
def _matcher(pattern: str) -> re.Pattern[str]:
    """A regex matching concrete keys of ``pattern``; each placeholder is one dot-free part."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(pattern):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(f"(?P<{name}>[^.]+)")
    return re.compile("".join(parts))


def _tuple_of_str(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class Entry:
    """One family state tensor and the HF tensors that store it.

    ``names[row][part]``: one row per index of the stacked leading dimension (a single row
    when nothing is stacked), one column per part concatenated along ``cat_dim``;
    ``part_shapes[part]`` is that part's family-side shape (the stacked dimension left out).
    ``tied`` are HF names that, when a checkpoint holds them, must equal this tensor."""

    key: str
    shape: Shape
    names: tuple[tuple[str, ...], ...]
    part_shapes: tuple[Shape, ...]
    convert: Conversion
    cat_dim: int
    stacked: bool
    tied: tuple[str, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for row in self.names for name in row)

    def hf_shapes(self) -> dict[str, Shape]:
        """HF name -> the shape the checkpoint must store it with."""
        hf = [self.convert.hf_shape(shape) for shape in self.part_shapes]
        return {name: hf[part] for row in self.names for part, name in enumerate(row)}

    def from_hf(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The family tensor from its HF tensors (as stored), in ``dtype`` or theirs."""

        def piece(name: str) -> torch.Tensor:
            stored = tensors[name]
            return self.convert.from_hf(stored).to(dtype or stored.dtype)

        rows = [
            torch.cat([piece(name) for name in row], self.cat_dim)
            if len(row) > 1
            else piece(row[0])
            for row in self.names
        ]
        return torch.stack(rows) if self.stacked else rows[0].contiguous()

    def to_hf(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF name -> tensor (contiguous, ``tensor``'s dtype) of a family tensor of
        ``self.shape``; tied names are not written."""
        rows = tensor.unbind(0) if self.stacked else (tensor,)
        sizes = [shape[self.cat_dim] for shape in self.part_shapes]
        out = {}
        for row, piece in zip(self.names, rows, strict=True):
            parts = piece.split(sizes, self.cat_dim) if len(row) > 1 else (piece,)
            for name, part in zip(row, parts, strict=True):
                out[name] = self.convert.to_hf(part).to(tensor.dtype).contiguous()
        return out


@attrs.frozen
class KeyRule:
    """How one kind of family tensor is stored in HF checkpoints.

    ``key``: the family key pattern (``"{layer}.attn.c_attn.weight"``). ``hf``: the HF name
    pattern, or several whose tensors are concatenated along ``cat_dim`` (sizes ``split``,
    equal parts by default) into the family tensor. ``stack``: a placeholder that only the
    HF names carry (``"expert"``); the family tensor's dimension 0 stacks one per index
    ``0 .. shape[0] - 1``. ``convert`` applies to each HF tensor. ``tied``: HF names (same
    placeholders as ``key``) that duplicate this tensor: optional on import, where present
    they must equal it, and never written (GPT-2's ``lm_head.weight``)."""

    key: str
    hf: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    convert: Conversion = IDENTITY
    stack: str | None = None
    cat_dim: int = 0
    split: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    tied: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)

    def __attrs_post_init__(self) -> None:
        own = set(_fields(self.key))
        if len(own) != len(_fields(self.key)):
            raise ValueError(f"key rule {self.key!r}: a placeholder appears twice")
        if not self.hf:
            raise ValueError(f"key rule {self.key!r}: no HF name")
        if self.stack is not None and self.stack in own:
            raise ValueError(f"key rule {self.key!r}: stack placeholder {self.stack!r} is in key")
        wanted = own | ({self.stack} if self.stack else set())
        for pattern in self.hf:
            if set(_fields(pattern)) != wanted:
                raise ValueError(
                    f"key rule {self.key!r}: HF name {pattern!r} must have exactly the "
                    f"placeholders {sorted(wanted)}"
                )
        for pattern in self.tied:
            if set(_fields(pattern)) != own:
                raise ValueError(
                    f"key rule {self.key!r}: tied name {pattern!r} must have exactly the "
                    f"placeholders {sorted(own)}"
                )
        if self.tied and (self.stack or len(self.hf) > 1):
            raise ValueError(f"key rule {self.key!r}: only a one-to-one rule can be tied")
        if self.split is not None and len(self.split) != len(self.hf):
            raise ValueError(
                f"key rule {self.key!r}: split {self.split} has {len(self.split)} sizes for "
                f"{len(self.hf)} HF names"
            )

    def match(self, key: str) -> dict[str, str] | None:
        """The placeholder values if ``key`` is an instance of this rule's pattern."""
        found = _matcher(self.key).fullmatch(key)
        return None if found is None else found.groupdict()

    def entry(self, key: str, shape: Shape, values: Mapping[str, str]) -> Entry:
        """The concrete entry of ``key`` (matched by this rule) for a family ``shape``."""
        where = f"key {key!r} (rule {self.key!r}, shape {shape})"
        piece = shape[1:] if self.stack else shape
        if self.stack and not shape:
            raise ValueError(f"{where}: a stacked tensor needs a leading dimension")
        rows = range(shape[0]) if self.stack else (None,)
        names = tuple(
            tuple(p.format(**values, **({self.stack: i} if self.stack else {})) for p in self.hf)
            for i in rows
        )
        dim = self.cat_dim % len(piece) if piece else 0
        if len(self.hf) == 1:
            part_shapes: tuple[Shape, ...] = (piece,)
        else:
            if not piece:
                raise ValueError(f"{where}: cannot concatenate 0-dimensional parts")
            sizes = self.split or self._equal_parts(piece[dim], where)
            if sum(sizes) != piece[dim]:
                raise ValueError(f"{where}: split {sizes} does not sum to {piece[dim]}")
            part_shapes = tuple((*piece[:dim], size, *piece[dim + 1 :]) for size in sizes)
        for part in part_shapes:
            try:
                self.convert.hf_shape(part)
            except ValueError as error:
                raise ValueError(f"{where}: {self.convert.name}: {error}") from None
        tied = tuple(p.format(**values) for p in self.tied)
        return Entry(key, shape, names, part_shapes, self.convert, dim, bool(self.stack), tied)

    def _equal_parts(self, size: int, where: str) -> tuple[int, ...]:
        if size % len(self.hf):
            raise ValueError(f"{where}: {size} does not split into {len(self.hf)} equal parts")
        return (size // len(self.hf),) * len(self.hf)


@attrs.frozen
class KeyMap:
    """A family's whole HF table.

    ``rules``: tried in order, the first whose ``key`` pattern matches a state key wins.
    ``skip``: regexes of HF names a checkpoint may hold that import ignores (GPT-2's mask
    buffers, multi-token-prediction layers, a vision tower). ``aliases``: ``(regex,
    replacement)`` pairs that rewrite a stored name to the name the rules use before
    anything else looks at it (old files without a prefix); the first that matches the
    whole name wins. ``skip`` and ``tied`` names are matched after aliasing."""

    family: str
    rules: tuple[KeyRule, ...] = attrs.field(converter=tuple)
    skip: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    aliases: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=lambda pairs: tuple(tuple(pair) for pair in pairs)
    )

    def expand(self, expected: Mapping[str, Sequence[int]]) -> tuple[Entry, ...]:
        """One entry per expected state key (key -> family shape), in order. A key no rule
        matches, or two keys stored under one HF name, is an error naming them."""
        entries = []
        owner: dict[str, str] = {}
        for key, shape in expected.items():
            for rule in self.rules:
                values = rule.match(key)
                if values is not None:
                    break
            else:
                raise ValueError(f"{self.family} key map: no rule maps state key {key!r}")
            entry = rule.entry(key, tuple(shape), values)
            for name in (*entry.hf_names, *entry.tied):
                if name in owner:
                    raise ValueError(
                        f"{self.family} key map: state keys {owner[name]!r} and {key!r} "
                        f"both map to HF tensor {name!r}"
                    )
                owner[name] = key
            entries.append(entry)
        return tuple(entries)

    def canonical(self, name: str) -> str:
        """``name`` as the rules spell it (after the first alias that matches it whole)."""
        for pattern, replacement in self.aliases:
            found = re.fullmatch(pattern, name)
            if found:
                return found.expand(replacement)
        return name

    def skipped(self, name: str) -> bool:
        """Whether import ignores the HF tensor ``name`` (a canonical name)."""
        return any(re.fullmatch(pattern, name) for pattern in self.skip)
