"""DeepSeek V3's and V3.2's configs. V3: the kit's decoder sizes, MLA's fields (``kit.mla.MLAFields``), the
sigmoid-routed experts' (``kit.sigmoid_moe.SigmoidMoEFields``) and
``first_k_dense_replace``; its architecture two block kinds, ``dense`` (MLA and the dense
SwiGLU of ``intermediate_size``) for the first ``first_k_dense_replace`` layers and
``moe`` (MLA and ``SigmoidExperts``) for the rest (``DenseThenMoE``).

``head_dim`` is HF's: ``qk_rope_head_dim`` (the rotated width), which the attention part
does not read; its heads' widths are MLA's own fields. ``num_key_value_heads`` is kept
as HF keeps it (every head has its key and value: MLA makes them from one latent).

DeepSeek V3.2 (``DeepseekV32Config``) is V3 with DeepSeek Sparse Attention in every layer:
the kit's ``IndexedBlock`` of ``IndexedAttention`` (MLA over a lightning indexer's top-K,
``kit.dsa``) and V3's FFNs, and the indexer's fields (``DSAFields``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import attrs
from dataflow_training.kit import (
    Block,
    Decoder,
    DecoderConfig,
    DSAFields,
    IndexedAttention,
    IndexedBlock,
    LatentAttention,
    MLAFields,
    SigmoidExperts,
    SigmoidMoEFields,
    SwiGLUFFN,
)


@dataclasses.dataclass(frozen=True)
class DenseThenMoE(Decoder):
    """A decoder whose first ``first_k_dense_replace`` layers are its first block kind and
    the rest its second (HF's ``DeepseekV3DecoderLayer``: ``layer_idx >=
    first_k_dense_replace`` is MoE)."""

    def kinds(self, config: Any) -> list[str]:
        dense, moe = list(self.blocks)
        first = min(config.first_k_dense_replace, config.num_hidden_layers)
        return [dense] * first + [moe] * (config.num_hidden_layers - first)


def _not_negative(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be an int >= 0, got {value!r}"
        )


@attrs.frozen
class DeepseekV3Config(SigmoidMoEFields, MLAFields, DecoderConfig):
    """Sizes of a DeepSeek V3-architecture model (module docstring)."""

    first_k_dense_replace: int = attrs.field(default=3, kw_only=True, validator=_not_negative)
    architecture: ClassVar[Decoder] = DenseThenMoE(
        {
            "dense": Block(LatentAttention(), SwiGLUFFN()),
            "moe": Block(LatentAttention(), SigmoidExperts()),
        }
    )


@attrs.frozen
class DeepseekV32Config(DSAFields, DeepseekV3Config):
    """Sizes of a DeepSeek V3.2-architecture model: DeepSeek V3's, and the lightning
    indexer's (``kit.dsa.DSAFields``); every layer's attention is MLA over the indexer's
    top-K (``IndexedAttention``), dense then MoE as V3."""

    architecture: ClassVar[Decoder] = DenseThenMoE(
        {
            "dense": IndexedBlock(IndexedAttention(), SwiGLUFFN()),
            "moe": IndexedBlock(IndexedAttention(), SigmoidExperts()),
        }
    )
