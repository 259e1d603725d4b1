"""The qwen3_5_moe family object: the kit's ``MoEFamily`` with Qwen 3.5 MoE's presets and
the ``config.json`` of ``Qwen3_5MoeForCausalLM``: the hybrid stack's fields and the
published checkpoints' layout (``HybridFamily``), the routed experts' (``MoEFamily``),
and the shared expert's width.

Import reads the text model of a published ``Qwen3_5MoeForConditionalGeneration``
checkpoint too (the nested ``text_config``, tensors under ``model.language_model``); its
multi-token-prediction (``mtp.*``) and vision (``model.visual.*``) tensors are dropped
with one line saying how many, and export writes a ``Qwen3_5MoeForCausalLM`` folder
without them. Each expert's HF tensors (``mlp.experts.{e}.gate_proj.weight``, ...) are
stacked into the family's ``mlp.experts.gate_up_proj`` and ``down_proj``, and written
back per expert (transformers stacks them on load).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit import (
    CheckpointError,
    HybridFamily,
    MoEFamily,
    moe_active_parameter_count,
    moe_parameter_count,
)

from dataflow_family_qwen3_5_moe.config import Qwen3_5MoeConfig
from dataflow_family_qwen3_5_moe.presets import HF_NAMES, PRESETS

#: the shared expert's width in ``config.json``
SHARED_WIDTH = "shared_expert_intermediate_size"

#: HF ``Qwen3_5MoeTextConfig`` defaults, for fields a config.json leaves out (as
#: transformers does); its router always renormalises the chosen probabilities
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "moe_intermediate_size": 512,
    SHARED_WIDTH: 512,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}


class Qwen3_5MoeFamily(HybridFamily, MoEFamily):
    """Qwen 3.5 MoE: three Gated DeltaNet layers to one gated full-attention layer, every
    layer's FFN 256 routed SwiGLU experts (top 8, renormalised) and a sigmoid-gated shared
    expert, RMSNorms scaling by ``1 + w``."""

    name = "qwen3_5_moe"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Qwen3_5MoeConfig
    hf_class = "Qwen3_5MoeForCausalLM"
    hf_model_type = "qwen3_5_moe_text"
    hf_defaults = _HF_DEFAULTS
    hf_expert_width = "moe_intermediate_size"

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Dense layers and top-k weights as they are (not renormalised) are refused by
        name: ``Qwen3_5MoeForCausalLM`` has neither."""
        refused = {
            "mlp_only_layers": (bool(hf.get("mlp_only_layers")), "dense layers are"),
            "decoder_sparse_step": (hf.get("decoder_sparse_step", 1) != 1, "dense layers are"),
            "norm_topk_prob": (
                hf.get("norm_topk_prob", True) is not True,
                "top-k weights not renormalised are",
            ),
        }
        for field, (bad, what) in refused.items():
            if bad:
                raise CheckpointError(
                    f"{source}: {field} = {hf[field]!r}: {what} not implemented by the "
                    f"{self.name} family"
                )

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().hf_fields(hf, source)
        return fields | {SHARED_WIDTH: hf.get(SHARED_WIDTH, self.hf_defaults[SHARED_WIDTH])}

    def config_to_hf(self, config: Qwen3_5MoeConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of a ``Qwen3_5MoeForCausalLM`` of ``config`` (no
        ``norm_topk_prob``: its router always renormalises)."""
        fields = super().config_to_hf(config, dtype)
        del fields["norm_topk_prob"]
        return fields | {SHARED_WIDTH: config.shared_expert_intermediate_size}

    def preset_table(self) -> str:
        """The presets as a Markdown table, every number computed from the configs."""
        lines = [
            "| preset | layers (linear + full) | hidden | heads (kv) | head_dim "
            "| DeltaNet heads k (v) x dim | experts (top-k) | expert MLP | shared MLP "
            "| vocab | context | tied | parameters | active |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|",
        ]
        for name, c in self.presets.items():
            full = c.layer_types.count("full_attention")
            lines.append(
                f"| `{name}` | {c.num_hidden_layers} ({c.num_hidden_layers - full} + {full}) "
                f"| {c.hidden_size:,} | {c.num_attention_heads} ({c.num_key_value_heads}) "
                f"| {c.head_dim} | {c.linear_num_key_heads} ({c.linear_num_value_heads}) x "
                f"{c.linear_key_head_dim} | {c.num_experts} ({c.num_experts_per_tok}) "
                f"| {c.intermediate_size:,} | {c.shared_expert_intermediate_size:,} "
                f"| {c.vocab_size:,} | {c.max_position_embeddings:,} "
                f"| {'yes' if c.tie_word_embeddings else 'no'} | {moe_parameter_count(c):,} "
                f"| {moe_active_parameter_count(c):,} |"
            )
        return "\n".join(lines) + "\n"
