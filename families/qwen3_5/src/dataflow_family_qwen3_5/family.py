"""The qwen3_5 family object: the kit's ``DecoderFamily`` with Qwen 3.5's presets and the
``config.json`` of ``Qwen3_5ForCausalLM`` (its Gated DeltaNet sizes and layer types, a
quarter of each head rotated: the kit's ``HybridFamily``).

Import reads the text model of a published checkpoint too: those are
``Qwen3_5ForConditionalGeneration`` folders, whose ``config.json`` nests the text model's
fields under ``text_config`` and whose tensors are named ``model.language_model.*``
(read as ``model.*``). Their vision tower (``model.visual.*``) and multi-token-prediction
layers (``mtp.*``) are not trained here: import drops them and says so in one line;
export writes the text model alone (``Qwen3_5ForCausalLM``), without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataflow_training.kit import HybridFamily, parameter_count

from dataflow_family_qwen3_5.config import Qwen3_5Config
from dataflow_family_qwen3_5.presets import HF_NAMES, PRESETS

#: HF ``Qwen3_5TextConfig`` defaults, for sizes a config.json leaves out (as transformers does)
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


class Qwen3_5Family(HybridFamily):
    """Qwen 3.5 dense: three Gated DeltaNet layers to one gated full-attention layer,
    SwiGLU, RMSNorms scaling by ``1 + w``."""

    name = "qwen3_5"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Qwen3_5Config
    hf_class = "Qwen3_5ForCausalLM"
    hf_model_type = "qwen3_5_text"
    hf_defaults = _HF_DEFAULTS

    def preset_table(self) -> str:
        """The presets as a Markdown table, every number computed from the configs: the
        kit's columns with the layer types and the Gated DeltaNet heads."""
        lines = [
            "| preset | layers (linear + full) | hidden | heads (kv) | head_dim "
            "| DeltaNet heads k (v) x dim | MLP | vocab | context | tied | parameters |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
        ]
        for name, c in self.presets.items():
            full = c.layer_types.count("full_attention")
            lines.append(
                f"| `{name}` | {c.num_hidden_layers} ({c.num_hidden_layers - full} + {full}) "
                f"| {c.hidden_size:,} | {c.num_attention_heads} ({c.num_key_value_heads}) "
                f"| {c.head_dim} | {c.linear_num_key_heads} ({c.linear_num_value_heads}) x "
                f"{c.linear_key_head_dim} | {c.intermediate_size:,} | {c.vocab_size:,} "
                f"| {c.max_position_embeddings:,} | {'yes' if c.tie_word_embeddings else 'no'} "
                f"| {parameter_count(c):,} |"
            )
        return "\n".join(lines) + "\n"
