"""The deepseek_v3 family object: the kit's ``DecoderFamily`` with DeepSeek V3's presets, its
reference model (``kit.sigmoid_moe_reference.SigmoidMoEReference``) and the
``config.json`` of ``DeepseekV3ForCausalLM`` both ways.

Import reads DeepSeek's published layout: the experts one by one
(``mlp.experts.{e}.gate_proj.weight``, stacked into the family's ``mlp.experts.gate_up_proj``
and ``down_proj``, as transformers stacks them on load), the selection bias
``mlp.gate.e_score_correction_bias``, the rope's ``rope_scaling`` of type ``yarn``. The
multi-token-prediction layers published after the last layer (``model.layers.61.*`` of
DeepSeek V3: ``num_nextn_predict_layers``) are not trained here: import drops them with one
line saying how many tensors, and export leaves them out. FP8 checkpoints (DeepSeek's
``quantization_config`` with ``weight_scale_inv`` blocks) are refused naming the field:
dequantize them to bf16 first (DeepSeek's ``fp8_cast_bf16.py``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from dataflow_training.kit import (
    CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointError,
    DecoderFamily,
    KeyMap,
    SigmoidMoEReference,
    YarnScaling,
    checkpoint_folder,
    expected_state,
    key_map,
    parameter_count,
    read_config,
    read_state,
)

from dataflow_family_deepseek.config import DeepseekV3Config
from dataflow_family_deepseek.presets import HF_NAMES, PRESETS

log = logging.getLogger(__name__)

#: HF ``DeepseekV3Config`` defaults (transformers 5.25), for fields a config.json leaves out
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: HF field -> (config field, default)
_OWN_FIELDS: Mapping[str, tuple[str, Any]] = {
    "n_routed_experts": ("num_experts", 256),
    "num_experts_per_tok": ("num_experts_per_tok", 8),
    "moe_intermediate_size": ("moe_intermediate_size", 2048),
    "n_shared_experts": ("n_shared_experts", 1),
    "n_group": ("n_group", 8),
    "topk_group": ("topk_group", 4),
    "norm_topk_prob": ("norm_topk_prob", True),
    "routed_scaling_factor": ("routed_scaling_factor", 2.5),
    "first_k_dense_replace": ("first_k_dense_replace", 3),
    "q_lora_rank": ("q_lora_rank", 1536),
    "kv_lora_rank": ("kv_lora_rank", 512),
    "qk_nope_head_dim": ("qk_nope_head_dim", 128),
    "qk_rope_head_dim": ("qk_rope_head_dim", 64),
    "v_head_dim": ("v_head_dim", 128),
    "rope_interleave": ("rope_interleave", True),
}


def _layers_past(path: str | Path, layers: int) -> dict[int, int]:
    """Layer index -> its tensors, of the stored layers at or past ``layers`` (the MTP
    layers DeepSeek publishes after the last one)."""
    # safetensors only where a checkpoint is read
    from safetensors import safe_open

    folder = checkpoint_folder(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        single = Path(path) if Path(path).is_file() else folder / SAFETENSORS
        with safe_open(single, framework="pt") as handle:
            names = list(handle.keys())
    found: dict[int, int] = {}
    for name in names:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= layers:
            found[int(match.group(1))] = found.get(int(match.group(1)), 0) + 1
    return dict(sorted(found.items()))


def _rope_of(hf: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(the field, its object) of the rope settings, in either spelling."""
    if hf.get("rope_parameters") is not None:
        return "rope_parameters", hf["rope_parameters"]
    return "rope_scaling", hf.get("rope_scaling") or {"rope_type": "default"}


class DeepseekV3Family(DecoderFamily):
    """DeepSeek V3: MLA in every layer; the first ``first_k_dense_replace`` layers' FFN the
    dense SwiGLU, the rest's the sigmoid-routed experts and the shared experts."""

    name = "deepseek_v3"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = DeepseekV3Config
    reference = SigmoidMoEReference
    hf_class = "DeepseekV3ForCausalLM"
    hf_model_type = "deepseek_v3"
    hf_defaults = _HF_DEFAULTS

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Refuse by name what the family does not implement: FP8 weights, other scoring
        or selection methods."""
        refused = {
            "quantization_config": (
                hf.get("quantization_config") is not None,
                "quantized (FP8 weight_scale_inv blocks) weights are not read; dequantize "
                "them to bf16 first",
            ),
            "scoring_func": (hf.get("scoring_func", "sigmoid") != "sigmoid", "only sigmoid"),
            "topk_method": (
                hf.get("topk_method", "noaux_tc") != "noaux_tc",
                "only 'noaux_tc' (group-limited, biased selection)",
            ),
        }
        for field, (bad, why) in refused.items():
            if bad:
                raise CheckpointError(f"{source}: {field} = {hf[field]!r}: {why}")

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        field, rope = _rope_of(hf)
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else None
        yarn = None
        if kind == "yarn":
            try:
                yarn = YarnScaling(
                    factor=rope["factor"],
                    original_max_position=rope["original_max_position_embeddings"],
                    beta_fast=rope.get("beta_fast") or 32.0,
                    beta_slow=rope.get("beta_slow") or 1.0,
                    mscale=rope.get("mscale", 1.0),
                    mscale_all_dim=rope.get("mscale_all_dim", 0.0),
                )
            except KeyError as missing:
                raise CheckpointError(
                    f"{source}: {field} = {rope!r}: a 'yarn' rope type needs {missing}"
                ) from None
            theta = rope.get("rope_theta", hf.get("rope_theta", self.hf_defaults["rope_theta"]))
            plain = {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
            hf = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
            hf = hf | plain
        fields = super().hf_fields(hf, source)
        own = {name: hf.get(key, default) for key, (name, default) in _OWN_FIELDS.items()}
        fields["head_dim"] = own["qk_rope_head_dim"]
        return fields | own | {"rope_yarn": yarn}

    def config_to_hf(self, config: DeepseekV3Config, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().config_to_hf(config, dtype)
        own = {key: getattr(config, name) for key, (name, _) in _OWN_FIELDS.items()}
        yarn = config.rope_yarn
        if yarn is not None:
            fields["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": config.rope_theta,
                "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_position,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
                "mscale": yarn.mscale,
                "mscale_all_dim": yarn.mscale_all_dim,
            }
        fields["head_dim"] = config.qk_rope_head_dim
        # the MTP layers are not trained here, and not written
        return fields | own | {"num_nextn_predict_layers": 0, "attention_bias": False}

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[DeepseekV3Config, dict[str, torch.Tensor]]:
        """(config, state) of an HF checkpoint folder; the MTP layers after the last one
        are dropped with one line."""
        config = self.config_from_hf(read_config(path), str(checkpoint_folder(path) / CONFIG))
        extra = _layers_past(path, config.num_hidden_layers)
        keymap = self.key_map(config, extra)
        state = read_state(path, keymap, expected_state(config), dtype=dtype)
        if extra:
            log.warning(
                "%s: dropped %d multi-token-prediction tensors (layers %s; not trained by "
                "the %s family; export leaves them out)",
                path,
                sum(extra.values()),
                ", ".join(map(str, extra)),
                self.name,
            )
        return config, state

    def key_map(self, config: DeepseekV3Config, skipped: Mapping[int, int] = {}) -> KeyMap:  # noqa: B006
        """The decoder's key table; the layers ``skipped`` (MTP layers past the last) skipped."""
        keymap = key_map(self.name, config)
        patterns = [rf"model\.layers\.{layer}\..*" for layer in skipped]
        return attrs.evolve(keymap, skip=(*keymap.skip, *patterns))

    # -- docs --------------------------------------------------------------------------
    def preset_table(self) -> str:
        """The presets as a Markdown table, every number computed from the configs."""
        lines = [
            "| preset | layers (dense + MoE) | hidden | heads | q / kv latent | head qk (rope) "
            "/ v | experts (top-k, groups) | expert MLP | shared | dense MLP | vocab "
            "| parameters | active | HF weights |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
        ]
        for name, c in self.presets.items():
            hf = f"`{self.hf_names[name]}`" if name in self.hf_names else "-"
            dense = min(c.first_k_dense_replace, c.num_hidden_layers)
            lines.append(
                f"| `{name}` | {c.num_hidden_layers} ({dense} + {c.num_hidden_layers - dense}) "
                f"| {c.hidden_size:,} | {c.num_attention_heads} "
                f"| {c.q_lora_rank or '-'} / {c.kv_lora_rank} "
                f"| {c.qk_nope_head_dim + c.qk_rope_head_dim} ({c.qk_rope_head_dim}) / "
                f"{c.v_head_dim} | {c.num_experts} ({c.num_experts_per_tok}, "
                f"{c.topk_group}/{c.n_group}) | {c.moe_intermediate_size:,} "
                f"| {c.n_shared_experts} | {c.intermediate_size:,} | {c.vocab_size:,} "
                f"| {parameter_count(c):,} | {active_parameter_count(c):,} | {hf} |"
            )
        return "\n".join(lines) + "\n"


def active_parameter_count(config: DeepseekV3Config) -> int:
    """Parameters one token uses: all but the routed experts it is not routed to (the
    selection biases counted, as the parameter count does)."""
    moe = config.num_hidden_layers - min(config.first_k_dense_replace, config.num_hidden_layers)
    idle = config.num_experts - config.num_experts_per_tok
    return (
        parameter_count(config) - moe * idle * 3 * config.hidden_size * config.moe_intermediate_size
    )
