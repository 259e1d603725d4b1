"""The deepseek_v32 family object: DeepSeek V3's family (``family.DeepseekV3Family``: its
experts, its YaRN rope, its MTP layers dropped on import, FP8 refused) with sparse
attention in every layer (``kit.dsa``), the reference ``kit.dsa_reference.DSAReference``
and the ``config.json`` of ``DeepseekV32ForCausalLM`` both ways.

transformers' V3.2 always has a query latent and interleaved MLA rope pairs (its config
has no ``rope_interleave``); its indexer's rope pairs are half-split. A ``config.json``
whose ``mlp_layer_types`` is not ``first_k_dense_replace`` dense layers then MoE ones is
refused naming the field. The indexer's training settings (``index_loss_coef``,
``index_dense``) are not written.

Its phase recipe ``indexer-warmup`` (``dataflow train --phase 0:@indexer-warmup --phase
N:``) is the report's dense warm-up: every earlier token selected (``index_dense``), every
parameter but the indexers' frozen, the selection bias held (``bias_update_speed`` 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_training import PhaseRecipe
from dataflow_training.kit import CheckpointError, DSAReference

from dataflow_family_deepseek.config import DeepseekV32Config
from dataflow_family_deepseek.family import _HF_DEFAULTS, DeepseekV3Family
from dataflow_family_deepseek.presets_v32 import HF_NAMES, PRESETS

#: HF field -> (config field, default) of the indexer
_INDEX_FIELDS: Mapping[str, tuple[str, Any]] = {
    "index_n_heads": ("index_n_heads", 64),
    "index_head_dim": ("index_head_dim", 128),
    "index_topk": ("index_topk", 2048),
}

#: the dense warm-up of the indexers (module docstring): everything but
#: ``self_attn.indexer.*`` frozen
INDEXER_WARMUP = PhaseRecipe(
    freeze=("embed", "head", "*.mlp.*", "*_layernorm.*", "*.self_attn.[!i]*"),
    config={"index_dense": True, "bias_update_speed": 0.0},
    doc="the indexers alone train, against dense attention (the report's warm-up)",
)


class DeepseekV32Family(DeepseekV3Family):
    """DeepSeek V3.2: DeepSeek V3 with the lightning indexer and sparse attention."""

    name = "deepseek_v32"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = DeepseekV32Config
    reference = DSAReference
    hf_class = "DeepseekV32ForCausalLM"
    hf_model_type = "deepseek_v32"
    hf_defaults = {**_HF_DEFAULTS, "max_position_embeddings": 163840}
    #: HF field -> (config field, default) of the indexer
    index_fields = _INDEX_FIELDS
    #: HF's default indexer pairs (V3.2: half-split)
    index_rope_interleave = False
    #: named phases (``dataflow train --phase START:@NAME``, ``drive.phases``)
    phase_recipes: Mapping[str, PhaseRecipe] = {"indexer-warmup": INDEXER_WARMUP}

    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        super().check_hf(hf, source)
        layers = hf.get("num_hidden_layers", self.hf_defaults["num_hidden_layers"])
        dense = min(hf.get("first_k_dense_replace", 3), layers)
        expected = ["dense"] * dense + ["sparse"] * (layers - dense)
        kinds = hf.get("mlp_layer_types")
        if kinds is not None and list(kinds) != expected:
            raise CheckpointError(
                f"{source}: mlp_layer_types = {kinds!r}: only first_k_dense_replace "
                f"({dense}) dense layers then MoE ones"
            )
        if hf.get("q_lora_rank", 1) is None:
            raise CheckpointError(
                f"{source}: q_lora_rank = None: the indexer reads MLA's query latent"
            )

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().hf_fields({"rope_interleave": True, **hf}, source)
        fields["rope_interleave"] = True
        own = {name: hf.get(key, default) for key, (name, default) in self.index_fields.items()}
        return fields | own | {"index_rope_interleave": self.index_rope_interleave}

    def config_to_hf(self, config: DeepseekV32Config, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().config_to_hf(config, dtype)
        fields.pop("rope_interleave")
        dense = min(config.first_k_dense_replace, config.num_hidden_layers)
        fields["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (
            config.num_hidden_layers - dense
        )
        own = {key: getattr(config, name) for key, (name, _) in self.index_fields.items()}
        return fields | own

    def preset_table(self) -> str:
        """V3's table with the indexer's heads, width and K."""
        lines = super().preset_table().splitlines()
        head = lines[0].replace("| parameters |", "| indexer heads x width (K) | parameters |")
        rule = lines[1].replace("|--:|--:|--:|---|", "|--:|--:|--:|--:|---|")
        rows = []
        for line, c in zip(lines[2:], self.presets.values(), strict=True):
            cells = line.split(" | ")
            index = f"{c.index_n_heads} x {c.index_head_dim} ({c.index_topk:,})"
            rows.append(" | ".join([*cells[:-3], index, *cells[-3:]]))
        return "\n".join([head, rule, *rows]) + "\n"
