"""``OlmoeConfig``: the kit's MoE decoder (``dataflow_training.kit.moe``) with OLMoE's
choices: q and k RMSNorm over the whole projection (one weight per channel, before the
heads are split and rotated), multi-head attention, softmax routing whose top-k weights are
NOT renormalised (``norm_topk_prob = False``), the load-balancing term (0.01) and the
router z-loss. Fields are named as in HF's ``OlmoeConfig``."""

from __future__ import annotations

from typing import ClassVar

import attrs
from dataflow_training.kit import Block, Decoder, MoEConfig, QKNorm, RoutedExperts, SelfAttention


@attrs.frozen
class OlmoeConfig(MoEConfig):
    """Sizes of an OLMoE model."""

    architecture: ClassVar[Decoder] = Decoder(
        {"moe": Block(SelfAttention(qk_norm=QKNorm("projection")), RoutedExperts())}
    )
