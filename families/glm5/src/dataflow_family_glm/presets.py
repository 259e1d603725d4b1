"""Named GLM 5-architecture configs.

``glm5`` is transformers 5.25's ``GlmMoeDsaConfig()`` field for field (GLM 5: 78 layers, 3
dense then MoE, width 6,144, 64 heads, 256 experts choosing 8, an indexer of 32 heads of
128 selecting 2,048 tokens, 202,752 positions, every layer's indexer ``"full"``, its
default ``indexer_types``). For ``predict`` only. Its rope base is that class's default,
10,000; the Megatron arguments for the published checkpoints in radixark's miles
(``scripts/models/glm5.1-744B-A40B*.sh``: widths, layers, heads, latents, experts,
scaling and vocabulary as here) pass ``--rotary-base`` 1,000,000 (8,000,000 for GLM 5.2).
A step's cost does not depend on it, and ``--init`` of a checkpoint reads its own
``config.json``.

``glm5_cut`` is it cut to 2 layers (1 dense, 1 MoE) and 4,096 positions, the MoE layer
``"shared"`` (it attends to the dense layer's selection and has no indexer), for one
H200 as ``deepseek_v32_cut``.

``glm5_tiny`` is ``deepseek_v32_tiny``'s shape at 4 layers (1 dense, 3 MoE) with
``indexer_types`` full, shared, shared, full: layer 0 leads layers 1 and 2 (a group of
three: a last and a middle follower), layer 3 leads none.

``python -m dataflow_family_glm.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs
from dataflow_family_deepseek.presets_v32 import PRESETS as V32

from dataflow_family_glm.config import Glm5Config

#: ``GlmMoeDsaConfig()`` of transformers 5.25
_GLM5 = Glm5Config(
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    num_hidden_layers=78,
    num_attention_heads=64,
    num_key_value_heads=64,
    head_dim=64,
    max_position_embeddings=202752,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    rope_interleave=True,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
)


def _tiny() -> Glm5Config:
    v32 = attrs.asdict(V32["deepseek_v32_tiny"], recurse=False)
    return Glm5Config(
        **{
            **v32,
            "num_hidden_layers": 4,
            "indexer_types": ("full", "shared", "shared", "full"),
            "index_rope_interleave": True,
        }
    )


PRESETS: Mapping[str, Glm5Config] = MappingProxyType(
    {
        "glm5_tiny": _tiny(),
        "glm5": _GLM5,
        "glm5_cut": _GLM5.with_overrides(
            num_hidden_layers=2,
            first_k_dense_replace=1,
            max_position_embeddings=4096,
            indexer_types=("full", "shared"),
        ),
    }
)

#: preset -> the HF hub model whose weights it takes
HF_NAMES: Mapping[str, str] = MappingProxyType({})

if __name__ == "__main__":
    from dataflow_family_glm.family import Glm5Family

    print(Glm5Family().preset_table(), end="")
