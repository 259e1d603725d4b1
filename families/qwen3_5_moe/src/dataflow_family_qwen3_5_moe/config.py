"""``Qwen3_5MoeConfig``: the kit's hybrid decoder (``dataflow_training.kit.hybrid``: Gated
DeltaNet and gated full-attention layers by HF's ``layer_types``, RMSNorms scaling by ``1
+ w``) with the kit's routed experts (``dataflow_training.kit.moe``) as every layer's FFN:
``num_experts`` SwiGLU experts of width ``intermediate_size`` (HF's
``moe_intermediate_size``), ``num_experts_per_tok`` of them per token, their softmax
probabilities renormalised over the chosen (HF's router always renormalises:
``norm_topk_prob`` is True and may not be changed), plus one SwiGLU ``SharedExpert`` of
width ``shared_expert_intermediate_size`` that every token goes through, scaled by
``sigmoid(shared_expert_gate(h))``.

Two block kinds: ``linear_moe`` (``linear_attention`` layers) and ``full_moe``
(``full_attention`` layers). Each layer's experts are a parameter group of their own
(``W_<layer>.experts``), so a plan streams them apart from the attention, the router and
the shared expert; the routing is AuxTemp (made by forward, read verbatim by recompute
and backward), the expert loads one Aux object pooled over the layers (``Aux_moe``).
Fields are named as in HF's ``Qwen3_5MoeTextConfig``, but for ``intermediate_size``."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from dataflow_training.kit import (
    GATED_ATTENTION,
    ZERO_CENTRED,
    Block,
    Decoder,
    GatedDeltaNet,
    HybridConfig,
    MoEFields,
    RoutedExperts,
    SharedExpert,
)

#: every layer's FFN: the routed experts and the gated shared expert
EXPERTS = RoutedExperts(shared=SharedExpert("shared_expert_intermediate_size"))


def _width(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive int, got {value!r}"
        )


@attrs.frozen
class Qwen3_5MoeConfig(MoEFields, HybridConfig):
    """Sizes of a Qwen 3.5 MoE model: the hybrid stack's, the routed experts' and the
    shared expert's width."""

    shared_expert_intermediate_size: int = attrs.field(default=512, kw_only=True, validator=_width)
    norm_topk_prob: bool = attrs.field(default=True, kw_only=True)
    architecture: ClassVar[Decoder] = Decoder(
        {
            "linear_moe": Block(GatedDeltaNet(), EXPERTS, ZERO_CENTRED),
            "full_moe": Block(GATED_ATTENTION, EXPERTS, ZERO_CENTRED),
        },
        layer_types={"linear_attention": "linear_moe", "full_attention": "full_moe"},
        norm=ZERO_CENTRED,
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.norm_topk_prob is not True:
            raise ValueError(
                f"{type(self).__name__}.norm_topk_prob must be True (Qwen 3.5 MoE renormalises "
                f"the chosen experts' probabilities), got {self.norm_topk_prob!r}"
            )
