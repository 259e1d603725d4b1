"""``Qwen3Config``: the kit's decoder config with Qwen 3's fields and parts: per-head q/k
RMSNorm (one ``head_dim`` weight each for queries and keys, before the rotation), plain
RoPE (``rope_theta`` 1,000,000 on the released models), GQA, SwiGLU, a ``head_dim`` set
apart from ``hidden_size // num_attention_heads`` (128 at every released size), and
layers of full or sliding-window attention (``sliding_window``, ``layer_types``; HF's
``use_sliding_window`` and ``max_window_layers`` are read into them). Fields are named as
in HF's ``Qwen3Config``; see ``dataflow_training.kit.decoder``."""

from __future__ import annotations

from typing import ClassVar

import attrs
from dataflow_training.kit import (
    Block,
    Decoder,
    DecoderConfig,
    QKNorm,
    SelfAttention,
    layer_types_field,
    sliding_window_field,
)


@attrs.frozen
class Qwen3Config(DecoderConfig):
    """Sizes of a Qwen 3 dense model, and its window and layer types."""

    sliding_window: int | None = sliding_window_field()
    layer_types: tuple[str, ...] | None = layer_types_field()
    architecture: ClassVar[Decoder] = Decoder(
        {
            "block": Block(SelfAttention(qk_norm=QKNorm("head"))),
            "sliding_block": Block(SelfAttention(qk_norm=QKNorm("head"), window="sliding_window")),
        },
        layer_types={"full_attention": "block", "sliding_attention": "sliding_block"},
    )
