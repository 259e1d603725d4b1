"""``MoEFamily``: a whole ``Family`` (protocol v2) for the kit's MoE decoder (``moe.py``),
and its HF checkpoints, so that OLMoE and Qwen 3 MoE write only their presets, their
reference's name and their ``config.json`` mapping.

HF stores each expert apart (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) and the router as ``model.layers.{l}.mlp.gate.weight``; the
family stacks the experts (``mlp.experts.gate_up_proj`` = every expert's gate rows then up
rows, ``mlp.experts.down_proj``), through the kit's key map (``stack="expert"``). The rest
of the key table is the dense decoder's. The expert count is read as ``num_experts`` (the
published files) or ``num_local_experts`` (what transformers 5 writes for Qwen 3 MoE);
export writes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from dataflow_training.family import LayerSpec
from dataflow_training.kit.decoder import EMBED, EMBED_WEIGHT, FINAL_NORM, HEAD, LM_HEAD
from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.decoder_hf import fields_from_hf, fields_to_hf
from dataflow_training.kit.hf import (
    CONFIG,
    CheckpointError,
    KeyMap,
    KeyRule,
    checkpoint_folder,
    read_config,
    read_state,
    write_config,
    write_state,
)
from dataflow_training.kit.moe import (
    DOWN,
    GATE_UP,
    OPS,
    MoEConfig,
    moe_active_parameter_count,
    moe_expected_state,
    moe_groups,
    moe_layer_specs,
    moe_math_of,
    moe_parameter_count,
)
from dataflow_training.kit.moe_reference import MoEReference

_LAYER = "model.layers.{layer}"
_EXPERT = _LAYER + ".mlp.experts.{expert}"


def moe_key_map(family: str, config: MoEConfig) -> KeyMap:
    """The family key <-> HF tensor name table of ``config`` (tied or not)."""
    main, _ = moe_groups(config)
    tied = "lm_head.weight" if config.tie_word_embeddings else ()
    return KeyMap(
        family,
        rules=[
            KeyRule(f"{EMBED}.{EMBED_WEIGHT}", "model.embed_tokens.weight", tied=tied),
            *(KeyRule(f"{{layer}}.{p.name}", f"{_LAYER}.{p.name}") for p in main.params),
            KeyRule(
                f"{{layer}}.{GATE_UP}",
                (f"{_EXPERT}.gate_proj.weight", f"{_EXPERT}.up_proj.weight"),
                stack="expert",
            ),
            KeyRule(f"{{layer}}.{DOWN}", f"{_EXPERT}.down_proj.weight", stack="expert"),
            KeyRule(f"{HEAD}.{FINAL_NORM}", "model.norm.weight"),
            KeyRule(f"{HEAD}.{LM_HEAD}", "lm_head.weight"),
        ],
        skip=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"],
    )


class MoEFamily(DecoderFamily):
    """Embed, ``num_hidden_layers`` blocks of kind ``moe``, head (tied or not)."""

    config_class: ClassVar[type[MoEConfig]] = MoEConfig
    reference: ClassVar[type[MoEReference]] = MoEReference
    #: the ``config.json`` field holding the experts' width
    hf_expert_width: ClassVar[str] = "intermediate_size"
    ops = OPS

    def layers(self, config: MoEConfig) -> list[LayerSpec]:
        return moe_layer_specs(config)

    def math(self, kind: str) -> Any:
        return moe_math_of(self.name, kind)

    # -- HF checkpoints ----------------------------------------------------------------
    def config_from_hf(self, hf: Mapping[str, Any], source: str) -> MoEConfig:
        self.check_hf(hf, source)
        width = hf.get(self.hf_expert_width, self.hf_defaults[self.hf_expert_width])
        shared = fields_from_hf(
            {**hf, "intermediate_size": width},
            source,
            model_type=self.hf_model_type,
            defaults=self.hf_defaults,
        )
        moe = {
            name: hf.get(name, self.hf_defaults[name])
            for name in ("num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef")
        }
        # published files spell it num_experts, transformers 5 writes num_local_experts
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        moe["num_experts"] = self.hf_defaults["num_experts"] if experts is None else experts
        moe["router_z_loss_coef"] = hf.get("router_z_loss_coef", 0.0)
        try:
            return self.config_class(**shared, **moe)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{source}: {error}") from error

    def moe_fields_to_hf(self, config: MoEConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The shared and the MoE fields of the ``config.json`` of ``config``."""
        fields = fields_to_hf(config, dtype)
        fields[self.hf_expert_width] = fields.pop("intermediate_size")
        return fields | {
            "num_experts": config.num_experts,
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "norm_topk_prob": config.norm_topk_prob,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "router_z_loss_coef": config.router_z_loss_coef,
            "output_router_logits": False,
        }

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[MoEConfig, dict[str, torch.Tensor]]:
        config = self.config_from_hf(read_config(path), str(checkpoint_folder(path) / CONFIG))
        expected = moe_expected_state(config)
        return config, read_state(path, moe_key_map(self.name, config), expected, dtype=dtype)

    def export_hf(
        self,
        config: MoEConfig,
        state: Mapping[str, torch.Tensor],
        path: str | Path,
        *,
        max_shard_bytes: int | None = None,
    ) -> None:
        embedding = state.get(f"{EMBED}.{EMBED_WEIGHT}")
        dtype = embedding.dtype if embedding is not None else torch.float32
        hf_config = self.config_to_hf(config, dtype)
        key_map, expected = moe_key_map(self.name, config), moe_expected_state(config)
        write_state(path, key_map, state, expected, max_shard_bytes=max_shard_bytes)
        write_config(path, hf_config)

    # -- docs --------------------------------------------------------------------------
    def preset_table(self) -> str:
        """The presets as a Markdown table, every number computed from the configs."""
        lines = [
            "| preset | layers | hidden | heads (kv) | head_dim | experts (top-k) | expert MLP "
            "| vocab | context | tied | parameters | active | HF weights |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|---|",
        ]
        for name, c in self.presets.items():
            hf = f"`{self.hf_names[name]}`" if name in self.hf_names else "-"
            lines.append(
                f"| `{name}` | {c.num_hidden_layers} | {c.hidden_size:,} "
                f"| {c.num_attention_heads} ({c.num_key_value_heads}) | {c.head_dim} "
                f"| {c.num_experts} ({c.num_experts_per_tok}) | {c.intermediate_size:,} "
                f"| {c.vocab_size:,} | {c.max_position_embeddings:,} "
                f"| {'yes' if c.tie_word_embeddings else 'no'} | {moe_parameter_count(c):,} "
                f"| {moe_active_parameter_count(c):,} | {hf} |"
            )
        return "\n".join(lines) + "\n"
