"""Named DeepSeek V3.2-architecture configs.

``deepseek_v32`` is DeepSeek V3.2 (671B; deepseek-ai/DeepSeek-V3.2-Exp):
``DeepseekV32Config()`` of transformers 5.25 field for field (DeepSeek V3's shape, and an
indexer of 64 heads of 128 selecting 2,048 tokens), with DeepSeek V3's published rope
scaling and context (YaRN factor 40 over 4,096 positions, 163,840; the V3.2 report keeps
V3's architecture but for DSA). For ``predict`` only.

``deepseek_v32_cut`` is it cut to 2 layers (1 dense, 1 MoE), 4,096 positions, for one
H200 as ``deepseek_v3_cut`` (the indexers add 2 x 17M parameters).

``deepseek_v32_tiny`` is ``deepseek_v3_tiny`` with an indexer of 4 heads of 16 (8 of them
rotated) selecting 16 tokens: a step of more than 16 tokens attends sparsely.

``python -m dataflow_family_deepseek.presets_v32`` prints the table of
``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from dataflow_family_deepseek.config import DeepseekV32Config
from dataflow_family_deepseek.presets import PRESETS as V3

#: the indexer of transformers' ``DeepseekV32Config()``
_INDEXER = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}


def _v32(preset: str, **fields) -> DeepseekV32Config:
    """V3's preset ``preset`` with an indexer."""
    v3 = V3[preset]
    return DeepseekV32Config(**{**attrs.asdict(v3, recurse=False), **fields})


PRESETS: Mapping[str, DeepseekV32Config] = MappingProxyType(
    {
        "deepseek_v32_tiny": _v32(
            "deepseek_v3_tiny", index_n_heads=4, index_head_dim=16, index_topk=16
        ),
        "deepseek_v32": _v32("deepseek_v3", **_INDEXER),
        "deepseek_v32_cut": _v32("deepseek_v3_cut", **_INDEXER),
    }
)

#: preset -> the HF hub model whose weights it takes
HF_NAMES: Mapping[str, str] = MappingProxyType({"deepseek_v32": "deepseek-ai/DeepSeek-V3.2-Exp"})

if __name__ == "__main__":
    from dataflow_family_deepseek.family_v32 import DeepseekV32Family

    print(DeepseekV32Family().preset_table(), end="")
