"""The qwen3_5 family object: the kit's ``DecoderFamily`` with Qwen 3.5's presets and the
``config.json`` of ``Qwen3_5ForCausalLM`` (its Gated DeltaNet sizes and layer types, a
quarter of each head rotated).

Import reads the text model of a published checkpoint too: those are
``Qwen3_5ForConditionalGeneration`` folders, whose ``config.json`` nests the text model's
fields under ``text_config`` and whose tensors are named ``model.language_model.*``
(read as ``model.*``). Their vision tower (``model.visual.*``) and multi-token-prediction
layers (``mtp.*``) are not trained here: import drops them and says so in one line;
export writes the text model alone (``Qwen3_5ForCausalLM``), without them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from dataflow_training.kit import (
    CONFIG,
    CheckpointError,
    DecoderFamily,
    checkpoint_folder,
    expected_state,
    key_map,
    parameter_count,
    read_config,
    read_state,
)

from dataflow_family_qwen3_5.config import (
    FULL_ATTENTION_INTERVAL,
    Qwen3_5Config,
    hybrid_layer_types,
)
from dataflow_family_qwen3_5.presets import HF_NAMES, PRESETS

LOG = logging.getLogger(__name__)

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
LINEAR_FIELDS: Mapping[str, int] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
#: the share of each full-attention head that is rotated
PARTIAL_ROTARY = 0.25
#: tensors of a published checkpoint that are not the text model (import drops them)
DROPPED = {"mtp": r"mtp\..*", "vision": r"model\.visual\..*"}


class Qwen3_5Family(DecoderFamily):
    """Qwen 3.5 dense: three Gated DeltaNet layers to one gated full-attention layer,
    SwiGLU, RMSNorms scaling by ``1 + w``."""

    name = "qwen3_5"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Qwen3_5Config
    hf_class = "Qwen3_5ForCausalLM"
    hf_model_type = "qwen3_5_text"
    hf_defaults = _HF_DEFAULTS

    def config_from_hf(self, hf: Mapping[str, Any], source: str) -> Qwen3_5Config:
        """The text model's config; a published (vision-language) ``config.json`` nests it
        under ``text_config``."""
        text = hf.get("text_config")
        if isinstance(text, Mapping):
            tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            hf = {**text, "tie_word_embeddings": tied}
        return super().config_from_hf(hf, source)

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().hf_fields(hf, source)
        rope = hf.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY))
        if factor != PARTIAL_ROTARY:
            raise CheckpointError(
                f"{source}: partial_rotary_factor = {factor!r}: Qwen 3.5 rotates a quarter "
                f"of each head ({PARTIAL_ROTARY})"
            )
        layers = fields["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None and isinstance(layers, int):
            types = hybrid_layer_types(
                layers, hf.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
            )
        known = set(Qwen3_5Config.architecture.layer_types)
        if not isinstance(types, list | tuple) or not set(types) <= known:
            raise CheckpointError(
                f"{source}: layer_types = {types!r}: expected a list of {', '.join(sorted(known))}"
            )
        linear = {name: hf.get(name, default) for name, default in LINEAR_FIELDS.items()}
        return fields | linear | {"layer_types": tuple(types)}

    def config_to_hf(self, config: Qwen3_5Config, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().config_to_hf(config, dtype)
        rope = {**fields["rope_parameters"], "partial_rotary_factor": PARTIAL_ROTARY}
        return fields | {
            "rope_parameters": rope,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "layer_types": list(config.layer_types),
            **{name: getattr(config, name) for name in LINEAR_FIELDS},
        }

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

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[Qwen3_5Config, dict[str, torch.Tensor]]:
        """As ``DecoderFamily.import_hf``, and a published checkpoint's text model: its
        ``model.language_model.*`` tensors read as ``model.*``, its ``mtp.*`` and
        ``model.visual.*`` tensors dropped with one line saying how many."""
        config = self.config_from_hf(read_config(path), str(checkpoint_folder(path) / CONFIG))
        keys = key_map(self.name, config)
        keys = attrs.evolve(
            keys,
            skip=(*keys.skip, *DROPPED.values()),
            aliases=(*keys.aliases, (r"model\.language_model\.(.*)", r"model.\1")),
        )
        state = read_state(path, keys, expected_state(config), dtype=dtype)
        dropped = _dropped(path)
        if dropped:
            LOG.warning(
                "%s: dropped %s (not trained by the qwen3_5 family; export leaves them out)",
                path,
                ", ".join(f"{count} {what} tensors" for what, count in dropped.items()),
            )
        return config, state


def _dropped(path: str | Path) -> dict[str, int]:
    """How many tensors of each dropped kind (``DROPPED``) the checkpoint holds."""
    import json
    import re

    from safetensors import safe_open

    folder, names = checkpoint_folder(path), []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        single = Path(path) if Path(path).is_file() else folder / "model.safetensors"
        with safe_open(single, framework="pt") as handle:
            names = list(handle.keys())
    counts = {what: sum(bool(re.fullmatch(p, n)) for n in names) for what, p in DROPPED.items()}
    return {what: count for what, count in counts.items() if count}
