"""``MoEFamily``: a whole ``Family`` (protocol v2) for the kit's MoE decoder (``moe.py``),
so that OLMoE and Qwen 3 MoE write only their presets and their ``config.json`` mapping.

HF stores each expert apart (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) and the router as ``model.layers.{l}.mlp.gate.weight``; the
family stacks the experts (``mlp.experts.gate_up_proj`` = every expert's gate rows then up
rows, ``mlp.experts.down_proj``), through the key rules of the ``RoutedExperts`` part
(``stack="expert"``). The rest of the key table is the dense decoder's. The expert count
is read as ``num_experts`` (the published files) or ``num_local_experts`` (what
transformers 5 writes for Qwen 3 MoE); export writes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.decoder_hf import fields_from_hf, fields_to_hf, key_map
from dataflow_training.kit.moe import MoEConfig, moe_active_parameter_count, moe_parameter_count
from dataflow_training.kit.moe_reference import MoEReference


def moe_key_map(family: str, config: MoEConfig) -> Any:
    """The family key <-> HF tensor name table of ``config`` (``decoder_hf.key_map``)."""
    return key_map(family, config)


class MoEFamily(DecoderFamily):
    """Embed, ``num_hidden_layers`` blocks of kind ``moe``, head (tied or not)."""

    config_class: ClassVar[type[MoEConfig]] = MoEConfig
    reference: ClassVar[type[MoEReference]] = MoEReference
    #: the ``config.json`` field holding the experts' width
    hf_expert_width: ClassVar[str] = "intermediate_size"

    # -- HF checkpoints ----------------------------------------------------------------
    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
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
        return shared | moe

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

    def config_to_hf(self, config: MoEConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The class, the model type, the shared and the MoE fields (a family adds its own)."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.hf_model_type,
            **self.moe_fields_to_hf(config, dtype),
        }

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
