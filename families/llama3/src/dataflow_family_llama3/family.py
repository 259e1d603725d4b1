"""The llama3 family object: what ``FamilySpec("llama3").load()`` returns.

A ``DecoderFamily`` of the training kit (protocol v2: presets, layers, the decoder math,
the reference, HF checkpoints through the kit's key table) plus what is Llama's own: the
``config.json`` of ``LlamaForCausalLM``, both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.decoder_hf import fields_to_hf
from dataflow_training.kit.hf import CheckpointError

from dataflow_family_llama3.config import Llama3Config
from dataflow_family_llama3.presets import HF_NAMES, PRESETS
from dataflow_family_llama3.reference import Llama3Reference


class Llama3Family(DecoderFamily):
    """Llama 3: RMSNorm, RoPE with Llama 3 scaling, GQA, SwiGLU, tied or untied head."""

    name = "llama3"
    presets = PRESETS
    hf_names = HF_NAMES
    reference = Llama3Reference

    config_class = Llama3Config
    hf_model_type = "llama"

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        if hf.get("pretraining_tp", 1) != 1:
            raise CheckpointError(
                f"{source}: pretraining_tp = {hf['pretraining_tp']!r}: only 1 is implemented"
            )

    def config_to_hf(self, config: Llama3Config, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of a ``LlamaForCausalLM`` of ``config``."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **fields_to_hf(config, dtype),
            "mlp_bias": False,
            "pretraining_tp": 1,
            "bos_token_id": 128000 if config.vocab_size == 128256 else None,
            "eos_token_id": 128001 if config.vocab_size == 128256 else None,
        }
