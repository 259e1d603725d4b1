"""GLM 5's config: DeepSeek V3.2's (``DeepseekV32Config``: MLA, the sigmoid-routed
experts, the lightning indexer) and ``indexer_types``, one a layer (transformers'
``GlmMoeDsaConfig``): a ``"full"`` layer runs its own indexer, a ``"shared"`` one attends
to the selection of the nearest earlier ``"full"`` layer, its leader (``kit.dsa``'s index
sharing). None: every layer ``"full"`` (transformers' default).

Four block kinds: ``dense`` and ``moe`` (an ``IndexedBlock`` of ``IndexedAttention``, V3.2's)
for the full layers, ``dense_shared`` and ``moe_shared`` (of ``SharedIndexAttention``: no
indexer, no AuxTemp of its own) for the shared ones; the first ``first_k_dense_replace``
layers are dense.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import attrs
from dataflow_family_deepseek.config import DeepseekV32Config, DenseThenMoE
from dataflow_training.kit import (
    Decoder,
    IndexedAttention,
    IndexedBlock,
    SharedIndexAttention,
    SigmoidExperts,
    SwiGLUFFN,
    flag,
)

#: ``indexer_types`` values
INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class SharedIndexDecoder(DenseThenMoE):
    """Dense then MoE (``DenseThenMoE``), each layer of its indexed kind or, where
    ``indexer_types`` says ``"shared"``, of the kind's ``_shared`` twin; a shared layer
    leads from the nearest earlier full one."""

    def kinds(self, config: Any) -> list[str]:
        first = min(config.first_k_dense_replace, config.num_hidden_layers)
        return [
            ("dense" if layer < first else "moe") + ("" if t == "full" else "_shared")
            for layer, t in enumerate(_types(config))
        ]

    def leaders(self, config: Any) -> list[int | None]:
        out: list[int | None] = []
        leader = None
        for layer, t in enumerate(_types(config)):
            out.append(leader if t == "shared" else None)
            if t == "full":
                leader = layer
        return out

    def check(self, config: Any) -> None:
        types = config.indexer_types
        if types is None:
            return
        if len(types) != config.num_hidden_layers:
            raise ValueError(
                f"{type(config).__name__}.indexer_types has {len(types)} entries; "
                f"num_hidden_layers is {config.num_hidden_layers}"
            )
        unknown = sorted(set(types) - set(INDEXER_TYPES))
        if unknown:
            raise ValueError(
                f"{type(config).__name__}.indexer_types has {unknown}: known are "
                f"{', '.join(INDEXER_TYPES)}"
            )
        if types and types[0] != "full":
            raise ValueError(
                f"{type(config).__name__}.indexer_types[0] is {types[0]!r}: a shared layer "
                "reads an earlier full layer's selection"
            )


def _types(config: Any) -> tuple[str, ...]:
    types = config.indexer_types
    return ("full",) * config.num_hidden_layers if types is None else tuple(types)


def _types_converter(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class Glm5Config(DeepseekV32Config):
    """Sizes of a GLM 5-architecture model: DeepSeek V3.2's and ``indexer_types``
    (module docstring). The indexer's rope pairs are interleaved."""

    indexer_types: tuple[str, ...] | None = attrs.field(
        default=None, kw_only=True, converter=_types_converter
    )
    index_rope_interleave: bool = attrs.field(default=True, kw_only=True, validator=flag)
    architecture: ClassVar[Decoder] = SharedIndexDecoder(
        {
            "dense": IndexedBlock(IndexedAttention(), SwiGLUFFN()),
            "moe": IndexedBlock(IndexedAttention(), SigmoidExperts()),
            "dense_shared": IndexedBlock(SharedIndexAttention(), SwiGLUFFN()),
            "moe_shared": IndexedBlock(SharedIndexAttention(), SigmoidExperts()),
        }
    )
