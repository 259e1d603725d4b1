"""The qwen3_moe family object: the kit's ``MoEFamily`` with Qwen 3 MoE's presets and the
``config.json`` of ``Qwen3MoeForCausalLM``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit import (
    CheckpointError,
    MoEFamily,
    check_full_attention,
    full_attention_fields,
)

from dataflow_family_qwen3_moe.config import Qwen3MoeConfig
from dataflow_family_qwen3_moe.presets import HF_NAMES, PRESETS

#: HF ``Qwen3MoeConfig`` defaults, for fields a config.json leaves out (as transformers does)
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}


class Qwen3MoeFamily(MoEFamily):
    """Qwen 3 MoE: RMSNorm, per-head q/k RMSNorm, RoPE, GQA, 128 routed experts."""

    name = "qwen3_moe"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Qwen3MoeConfig
    hf_class = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    hf_defaults = _HF_DEFAULTS
    hf_expert_width = "moe_intermediate_size"

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Sliding windows, dense layers and non-full attention layers are refused by name."""
        refused = {
            "use_sliding_window": (hf.get("use_sliding_window", False), "sliding-window attention"),
            "decoder_sparse_step": (hf.get("decoder_sparse_step", 1) != 1, "dense layers"),
            "mlp_only_layers": (bool(hf.get("mlp_only_layers")), "dense layers"),
        }
        for field, (bad, what) in refused.items():
            if bad:
                raise CheckpointError(
                    f"{source}: {field} = {hf[field]!r}: {what} are not implemented by the "
                    "qwen3_moe family"
                )
        check_full_attention(hf, source, self.name)

    def config_to_hf(self, config: Qwen3MoeConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of a ``Qwen3MoeForCausalLM`` of ``config``."""
        released = config.vocab_size == 151936
        return super().config_to_hf(config, dtype) | {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            **full_attention_fields(config.num_hidden_layers),
            "bos_token_id": 151643 if released else None,
            "eos_token_id": 151645 if released else None,
        }
