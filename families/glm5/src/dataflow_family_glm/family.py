"""The glm5 family object: DeepSeek V3.2's family (``DeepseekV32Family``: the experts, the
indexer, the reference ``kit.dsa_reference.DSAReference``, which groups each shared layer
with its leader) with GLM 5's ``indexer_types``, interleaved indexer rope pairs and the
``config.json`` of ``GlmMoeDsaForCausalLM`` both ways.

``indexer_types`` is read as transformers reads it: the field, else ``index_topk_pattern``
(``"FSSF..."``), else ``index_topk_freq`` and ``index_skip_topk_offset``; export writes
the field. A list of all ``"full"`` is kept as None (every layer its own indexer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from dataflow_family_deepseek.family_v32 import DeepseekV32Family
from dataflow_training.kit import CheckpointError

from dataflow_family_glm.config import INDEXER_TYPES, Glm5Config
from dataflow_family_glm.presets import HF_NAMES, PRESETS

#: HF ``GlmMoeDsaConfig`` defaults (transformers 5.25), for fields a config.json leaves out
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: HF field -> (config field, default) of the indexer
_INDEX_FIELDS: Mapping[str, tuple[str, Any]] = {
    "index_n_heads": ("index_n_heads", 32),
    "index_head_dim": ("index_head_dim", 128),
    "index_topk": ("index_topk", 2048),
}

#: HF field -> default of the fields whose defaults differ from DeepSeek V3's
_GLM_DEFAULTS: Mapping[str, Any] = {
    "n_routed_experts": 256,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "first_k_dense_replace": 3,
}


def indexer_types(hf: Mapping[str, Any], layers: int, source: str) -> tuple[str, ...] | None:
    """``indexer_types`` of an HF config as transformers derives it; None where every
    layer is ``"full"``; a bad value is a ``CheckpointError`` naming the field."""
    types = hf.get("indexer_types")
    field = "indexer_types"
    if types is None and hf.get("index_topk_pattern") is not None:
        field, pattern = "index_topk_pattern", hf["index_topk_pattern"]
        names = {"F": "full", "S": "shared"}
        if isinstance(pattern, str):
            if set(pattern) - set(names):
                raise CheckpointError(f"{source}: {field} = {pattern!r}: only 'F' and 'S'")
            types = [names[c] for c in pattern]
        else:
            types = list(pattern)
    if types is None:
        freq = max(hf.get("index_topk_freq", 1), 1)
        offset = hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or set(types) - set(INDEXER_TYPES) or types[0] != "full":
        raise CheckpointError(
            f"{source}: {field} = {list(types)!r}: {layers} entries of 'full' or 'shared', "
            "the first 'full'"
        )
    return None if all(t == "full" for t in types) else types


class Glm5Family(DeepseekV32Family):
    """GLM 5: DeepSeek V3.2 whose shared-index layers reuse an earlier layer's selection."""

    name = "glm5"
    presets = PRESETS
    hf_names = HF_NAMES
    config_class = Glm5Config
    hf_class = "GlmMoeDsaForCausalLM"
    hf_model_type = "glm_moe_dsa"
    hf_defaults = _HF_DEFAULTS
    index_fields = _INDEX_FIELDS
    index_rope_interleave = True

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        hf = {**_GLM_DEFAULTS, **hf}
        fields = super().hf_fields(hf, source)
        layers = hf.get("num_hidden_layers", self.hf_defaults["num_hidden_layers"])
        return fields | {"indexer_types": indexer_types(hf, layers, source)}

    def config_to_hf(self, config: Glm5Config, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().config_to_hf(config, dtype)
        types = config.indexer_types or ("full",) * config.num_hidden_layers
        return fields | {"indexer_types": list(types)}

    def preset_table(self) -> str:
        """V3.2's table with each preset's shared layers."""
        lines = super().preset_table().splitlines()
        head = lines[0].replace("| parameters |", "| shared-index layers | parameters |")
        rule = lines[1].replace("|--:|---|", "|--:|--:|---|", 1)
        rows = []
        for line, c in zip(lines[2:], self.presets.values(), strict=True):
            cells = line.split(" | ")
            shared = sum(t == "shared" for t in c.indexer_types or ())
            rows.append(" | ".join([*cells[:-3], str(shared), *cells[-3:]]))
        return "\n".join([head, rule, *rows]) + "\n"
