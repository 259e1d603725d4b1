"""The qwen3 family object: what ``FamilySpec("qwen3").load()`` returns.

A ``DecoderFamily`` of the training kit (protocol v2: presets, layers, the decoder math
with per-head q/k norm, the reference, HF checkpoints through the kit's key table) plus
what is Qwen's own: the ``config.json`` of ``Qwen3ForCausalLM``, both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.decoder_hf import (
    check_full_attention,
    fields_to_hf,
    full_attention_fields,
)
from dataflow_training.kit.hf import CheckpointError

from dataflow_family_qwen3.config import Qwen3Config
from dataflow_family_qwen3.presets import HF_NAMES, PRESETS
from dataflow_family_qwen3.reference import Qwen3Reference

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
    """Qwen 3 dense: RMSNorm, per-head q/k RMSNorm, RoPE, GQA, SwiGLU, tied small sizes."""

    name = "qwen3"
    presets = PRESETS
    hf_names = HF_NAMES
    reference = Qwen3Reference

    config_class = Qwen3Config
    hf_model_type = "qwen3"
    hf_defaults = _HF_DEFAULTS

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Sliding-window attention is not implemented: refused by name."""
        if hf.get("use_sliding_window", False):
            raise CheckpointError(
                f"{source}: use_sliding_window = True: sliding-window attention is not "
                "implemented by the qwen3 family"
            )
        check_full_attention(hf, source, self.name)

    def config_to_hf(self, config: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of a ``Qwen3ForCausalLM`` of ``config``."""
        released = config.vocab_size == 151936
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **fields_to_hf(config, dtype),
            **full_attention_fields(config.num_hidden_layers),
            "bos_token_id": 151643 if released else None,
            "eos_token_id": 151645 if released else None,
        }
