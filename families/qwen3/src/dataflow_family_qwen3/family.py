"""The qwen3 family object: the kit's ``DecoderFamily`` with Qwen 3's presets and the
``config.json`` of ``Qwen3ForCausalLM`` (its window fields included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit import DecoderFamily, window_fields_from_hf, window_fields_to_hf

from dataflow_family_qwen3.config import Qwen3Config
from dataflow_family_qwen3.presets import HF_NAMES, PRESETS

#: HF ``Qwen3Config`` defaults, for sizes a config.json leaves out (as transformers does)
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


class Qwen3Family(DecoderFamily):
    """Qwen 3 dense: RMSNorm, per-head q/k RMSNorm, RoPE, GQA, SwiGLU, tied small sizes,
    full or sliding-window attention layer by layer."""

    name = "qwen3"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Qwen3Config
    hf_class = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    hf_defaults = _HF_DEFAULTS

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        return super().hf_fields(hf, source) | window_fields_from_hf(hf, source)

    def config_to_hf(self, config: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
        released = config.vocab_size == 151936
        return super().config_to_hf(config, dtype) | {
            **window_fields_to_hf(config),
            "bos_token_id": 151643 if released else None,
            "eos_token_id": 151645 if released else None,
        }
