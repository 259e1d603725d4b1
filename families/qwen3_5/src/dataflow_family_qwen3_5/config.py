"""``Qwen3_5Config``: the kit's hybrid decoder config (``dataflow_training.kit.hybrid``)
with Qwen 3.5 dense's blocks. Two block kinds, chosen layer by layer by ``layer_types``
(HF's names): ``linear_attention``, the ``linear_block`` (Gated DeltaNet:
``dataflow_training.kit.linear_attention``), and ``full_attention``, the ``full_block``
(grouped-query attention with a sigmoid output gate, per-head q/k RMSNorm, RoPE on a
quarter of each head). Both have the dense SwiGLU and RMSNorms that scale by ``1 + w``
(the head's final norm too); the gated norm inside Gated DeltaNet scales by ``w``. Every
epsilon is ``rms_norm_eps`` but the q/k L2 norms' (1e-6, as HF's). Fields are named as in
HF's ``Qwen3_5TextConfig``.

``layer_types`` defaults to HF's pattern, layer ``i`` full attention iff ``(i + 1) % 4 ==
0``, and follows ``num_hidden_layers`` when that is overridden alone."""

from __future__ import annotations

from typing import ClassVar

import attrs
from dataflow_training.kit import (
    GATED_ATTENTION,
    ZERO_CENTRED,
    Block,
    Decoder,
    GatedDeltaNet,
    HybridConfig,
    SwiGLUFFN,
)


@attrs.frozen
class Qwen3_5Config(HybridConfig):
    """Sizes of a Qwen 3.5 dense model, its Gated DeltaNet sizes and its layer types."""

    architecture: ClassVar[Decoder] = Decoder(
        {
            "linear_block": Block(GatedDeltaNet(), SwiGLUFFN(), ZERO_CENTRED),
            "full_block": Block(GATED_ATTENTION, SwiGLUFFN(), ZERO_CENTRED),
        },
        layer_types={"linear_attention": "linear_block", "full_attention": "full_block"},
        norm=ZERO_CENTRED,
    )
