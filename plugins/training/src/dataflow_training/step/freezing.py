"""Freezing: which parameters of a model do not train (``TrainConfig.freeze``).

A freeze pattern names parameters by layer and by name. A model's parameters are called
``<layer>.<param>``: the layer is ``emb``, a block index ``0`` .. ``L-1`` or ``head``; the
param is the name its family gives it inside the layer, the Hugging Face one for the kit's
families (``self_attn.q_proj.weight``, ``mlp.down_proj.weight``, ``input_layernorm.weight``).
A pattern is one of:

- ``embed`` or ``head``: every parameter of that layer;
- ``layers`` (every block), ``layers.N`` or ``layers.A-B`` (blocks A to B, both ends
  in), optionally followed by ``.GLOB`` over the param names of those blocks
  (``layers.0-3.self_attn.*``, ``layers.mlp.*``); the Hugging Face prefix
  ``model.layers`` is taken for ``layers``;
- anything else: a shell glob (``fnmatch``) over the full names ``<layer>.<param>``
  (``*.mlp.*``, ``head.*``, ``3.self_attn.q_proj.weight``).

A pattern that names no parameter of the model is an error naming it, so a typo never
trains what was meant to stay frozen. A frozen tensor gets no gradient and no optimizer
state (``TensorSpec.trainable``); a tied weight frozen is frozen in both its uses.
``freeze_layers`` applies patterns to a family's layers, the one place the lowering and
a program read back from a file both go through.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

import attrs

from dataflow_training.step.family import LayerSpec
from dataflow_training.step.lora import SCALE_SUFFIX

#: The forms a freeze pattern takes, for help texts and errors.
PATTERN_FORMS = "embed, head, layers[.N|.A-B][.GLOB] or a glob over LAYER.PARAM names"

_LAYERS = re.compile(r"^(?:model\.)?layers(?:\.(\d+)(?:-(\d+))?)?(?:\.(.+))?$")


class FreezeError(ValueError):
    """A freeze pattern that is malformed or names no parameter of the model."""


def matches(pattern: str, layer: LayerSpec, block: int | None, param: str) -> bool:
    """Whether ``pattern`` names parameter ``param`` of ``layer`` (``block``: the layer's
    block index, None for the embedding and the head)."""
    if pattern in ("embed", "head"):
        return layer.kind == pattern
    ranged = _LAYERS.match(pattern)
    if ranged is not None:
        first, last, glob = ranged.groups()
        if first is None:  # every block
            return block is not None and fnmatch.fnmatchcase(param, glob or "*")
        low, high = int(first), int(last if last is not None else first)
        if high < low:
            raise FreezeError(f"--freeze {pattern}: the range {low}-{high} runs backwards")
        return (
            block is not None and low <= block <= high and fnmatch.fnmatchcase(param, glob or "*")
        )
    return fnmatch.fnmatchcase(f"{layer.name}.{param}", pattern)


def frozen_names(layers: Sequence[LayerSpec], patterns: Iterable[str]) -> set[str]:
    """The ``<layer>.<param>`` names ``patterns`` freeze in ``layers`` (embed, blocks...,
    head); a pattern that names none is a ``FreezeError`` naming it."""
    found: set[str] = set()
    for pattern in patterns:
        named = {
            f"{layer.name}.{p.name}"
            for index, layer in enumerate(layers)
            for p in layer.params
            if matches(pattern, layer, _block(layers, index), p.name)
        }
        if not named:
            raise FreezeError(
                f"--freeze {pattern}: names no parameter of the model ({len(layers) - 2} "
                f"blocks; patterns are {PATTERN_FORMS}, e.g. embed, layers.0-1, "
                f"*.self_attn.*, {layers[1].name}.{layers[1].params[0].name})"
            )
        found |= named
    return found


def freeze_layers(layers: Sequence[LayerSpec], patterns: Iterable[str]) -> tuple[LayerSpec, ...]:
    """``layers`` with the parameters ``patterns`` name made untrainable."""
    patterns = tuple(patterns)
    if not patterns:
        return tuple(layers)
    frozen = frozen_names(layers, patterns)
    if len(frozen) == sum(len(layer.params) for layer in layers):
        raise FreezeError(
            f"--freeze {' '.join(patterns)}: freezes every parameter of the model; "
            "nothing would train"
        )
    out = []
    for layer in layers:
        groups = tuple(
            attrs.evolve(
                group,
                params=tuple(
                    attrs.evolve(p, trainable=False) if f"{layer.name}.{p.name}" in frozen else p
                    for p in group.params
                ),
            )
            for group in layer.groups
        )
        out.append(attrs.evolve(layer, groups=groups))
    return tuple(out)


def trains(layer: LayerSpec) -> bool:
    """Whether any parameter of ``layer`` trains."""
    return any(p.trainable for p in layer.params)


def parameter_counts(layers: Iterable[LayerSpec]) -> tuple[int, int]:
    """(every parameter, the trainable ones) of ``layers``, in elements; a padded table
    counts the rows the model holds (``TensorSpec.rows``), a quantized LoRA base weight
    the weights it stands for (nf4: two a byte) and its scales none (``step.lora``)."""
    total = trainable = 0
    for layer in layers:
        quantized = {p.name: p.dtype for p in layer.params if p.dtype in ("int8", "uint8")}
        for p in layer.params:
            if p.name.endswith(SCALE_SUFFIX) and p.name.removesuffix(SCALE_SUFFIX) in quantized:
                continue
            count = _elements(p.shape, p.rows) * (2 if quantized.get(p.name) == "uint8" else 1)
            total += count
            trainable += count if p.trainable else 0
    return total, trainable


def _elements(shape: tuple[int, ...], rows: int | None) -> int:
    count = rows if rows is not None else (shape[0] if shape else 1)
    for size in shape[1:]:
        count *= size
    return count


def _block(layers: Sequence[LayerSpec], index: int) -> int | None:
    return index - 1 if 0 < index < len(layers) - 1 else None
