"""``Qwen3MoeConfig``: the kit's MoE decoder (``dataflow_training.kit.moe``) with Qwen 3
MoE's choices: per-head q/k RMSNorm (one ``head_dim`` weight each, before the rotation, as
dense Qwen 3), grouped-query attention, ``head_dim`` 128, top-k routing weights
renormalised to sum to one (``norm_topk_prob = True``), no shared expert, every layer
sparse. ``intermediate_size`` is the experts' width (HF's ``moe_intermediate_size``; the
dense ``intermediate_size`` of HF's config is only used by ``mlp_only_layers``, which the
family refuses). Fields are otherwise named as in HF's ``Qwen3MoeConfig``."""

from __future__ import annotations

import attrs
from dataflow_training.kit import MoEConfig


@attrs.frozen
class Qwen3MoeConfig(MoEConfig):
    """Sizes of a Qwen 3 MoE model (per-head q/k norm; the presets renormalise top-k)."""
