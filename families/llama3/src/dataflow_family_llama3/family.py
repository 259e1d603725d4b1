"""The llama3 family object: the kit's ``DecoderFamily`` with Llama 3's presets and the
``config.json`` of ``LlamaForCausalLM``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit import CheckpointError, DecoderFamily

from dataflow_family_llama3.config import Llama3Config
from dataflow_family_llama3.presets import HF_NAMES, PRESETS


class Llama3Family(DecoderFamily):
    """Llama 3: RMSNorm, RoPE with Llama 3 scaling, GQA, SwiGLU, tied or untied head."""

    name = "llama3"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Llama3Config
    hf_class = "LlamaForCausalLM"
    hf_model_type = "llama"

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        if hf.get("pretraining_tp", 1) != 1:
            raise CheckpointError(
                f"{source}: pretraining_tp = {hf['pretraining_tp']!r}: only 1 is implemented"
            )

    def config_to_hf(self, config: Llama3Config, dtype: torch.dtype) -> dict[str, Any]:
        released = config.vocab_size == 128256
        return super().config_to_hf(config, dtype) | {
            "mlp_bias": False,
            "pretraining_tp": 1,
            "bos_token_id": 128000 if released else None,
            "eos_token_id": 128001 if released else None,
        }
