"""The olmoe family object: the kit's ``MoEFamily`` with OLMoE's presets and the
``config.json`` of ``OlmoeForCausalLM``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit import CheckpointError, MoEFamily

from dataflow_family_olmoe.config import OlmoeConfig
from dataflow_family_olmoe.presets import HF_NAMES, PRESETS

#: HF ``OlmoeConfig`` defaults, for fields a config.json leaves out (as transformers does)
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.01,
}


class OlmoeFamily(MoEFamily):
    """OLMoE: RMSNorm, q/k RMSNorm over the projections, RoPE, MHA, 64 routed experts."""

    name = "olmoe"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = OlmoeConfig
    hf_class = "OlmoeForCausalLM"
    hf_model_type = "olmoe"
    hf_defaults = _HF_DEFAULTS

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Clipping q, k and v (``clip_qkv``) is not implemented: refused by name."""
        if hf.get("clip_qkv") is not None:
            raise CheckpointError(
                f"{source}: clip_qkv = {hf['clip_qkv']!r}: clipping q, k and v is not "
                "implemented by the olmoe family"
            )

    def config_to_hf(self, config: OlmoeConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of an ``OlmoeForCausalLM`` of ``config``."""
        released = config.vocab_size == 50304
        return super().config_to_hf(config, dtype) | {
            "clip_qkv": None,
            "pad_token_id": 1 if released else None,
            "bos_token_id": None,
            "eos_token_id": 50279 if released else None,
        }
