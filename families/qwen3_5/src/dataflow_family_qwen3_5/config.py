"""``Qwen3_5Config``: the kit's decoder config with Qwen 3.5's fields and parts. Two block
kinds, chosen layer by layer by ``layer_types`` (HF's names): ``linear_attention``, the
``linear_block`` (Gated DeltaNet: ``dataflow_training.kit.linear_attention``), and
``full_attention``, the ``full_block`` (grouped-query attention with a sigmoid output
gate, per-head q/k RMSNorm, RoPE on a quarter of each head). Both have the dense SwiGLU
and RMSNorms that scale by ``1 + w`` (the head's final norm too); the gated norm inside
Gated DeltaNet scales by ``w``. Every epsilon is ``rms_norm_eps`` but the q/k L2 norms'
(1e-6, as HF's). Fields are named as in HF's ``Qwen3_5TextConfig``.

``layer_types`` defaults to HF's pattern, layer ``i`` full attention iff ``(i + 1) % 4 ==
0``, and follows ``num_hidden_layers`` when that is overridden alone."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from dataflow_training.kit import (
    Block,
    Decoder,
    GatedDeltaNet,
    LinearAttentionConfig,
    Norm,
    OutputGate,
    QKNorm,
    Rope,
    SelfAttention,
    SwiGLUFFN,
    layer_types_field,
)

#: every ``full_attention_interval``-th layer is full attention (HF's default, 4)
FULL_ATTENTION_INTERVAL = 4
#: RMSNorm stored as ``w``, scaling by ``1 + w`` (``Qwen3_5RMSNorm``)
ZERO_CENTRED = Norm(offset=1.0)
FULL_ATTENTION = SelfAttention(
    qk_norm=QKNorm("head", ZERO_CENTRED), positions=Rope(0.25), gate=OutputGate()
)


def hybrid_layer_types(layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> tuple[str, ...]:
    """HF's layer types of ``layers`` layers: full attention every ``interval``-th."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


def _default_layer_types(config: Any) -> tuple[str, ...]:
    return hybrid_layer_types(config.num_hidden_layers)


@attrs.frozen
class Qwen3_5Config(LinearAttentionConfig):
    """Sizes of a Qwen 3.5 dense model, its Gated DeltaNet sizes and its layer types."""

    layer_types: tuple[str, ...] | None = layer_types_field(
        attrs.Factory(_default_layer_types, takes_self=True)
    )
    architecture: ClassVar[Decoder] = Decoder(
        {
            "linear_block": Block(GatedDeltaNet(), SwiGLUFFN(), ZERO_CENTRED),
            "full_block": Block(FULL_ATTENTION, SwiGLUFFN(), ZERO_CENTRED),
        },
        layer_types={"linear_attention": "linear_block", "full_attention": "full_block"},
        norm=ZERO_CENTRED,
    )

    def with_overrides(self, **overrides: Any) -> Qwen3_5Config:
        """As ``DecoderConfig.with_overrides``; a new layer count alone brings HF's pattern
        of layer types for it."""
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            layers = overrides["num_hidden_layers"]
            if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
                overrides["layer_types"] = hybrid_layer_types(layers)
        return super().with_overrides(**overrides)
