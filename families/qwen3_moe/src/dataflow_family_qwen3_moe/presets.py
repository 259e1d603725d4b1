"""Named Qwen 3 MoE configs: the released 30B-A3B, a cut of it that trains from a host
of 128 GiB, and a tiny one for CPU tests and demos.

``qwen3_30b_a3b`` is copied from the published ``config.json`` of ``Qwen/Qwen3-30B-A3B``
on the HF hub: vocabulary 151,936, hidden 2,048, 48 layers of 32 query and 4 key/value
heads of ``head_dim`` 128, 128 experts of width 768 (``moe_intermediate_size``) with 8
per token, ``norm_topk_prob`` true, ``router_aux_loss_coef`` 0.001, every layer sparse
(``decoder_sparse_step`` 1, no ``mlp_only_layers``), ``rms_norm_eps`` 1e-6,
``rope_theta`` 1,000,000, context 40,960, an untied output projection, no sliding
window, no shared expert. No router z-loss (Qwen publishes none).

``qwen3_30b_a3b_l12`` is that shape cut to its first 12 layers (8.1B parameters): its
host state (bf16 weights and gradients, float32 AdamW moments: 12 bytes a parameter) is
90.5 GiB, which leaves room on the device machine's 128 GiB host for the rest; the full
model's is 341 GiB. ``qwen3_moe_tiny`` is byte-sized (256 tokens), 2 layers of width 64,
4 query and 2 key/value heads of ``head_dim`` 32, 8 experts of width 32 with 2 per token.

``python -m dataflow_family_qwen3_moe.presets`` prints the table of
``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from dataflow_family_qwen3_moe.config import Qwen3MoeConfig

# Qwen/Qwen3-30B-A3B config.json
_30B_A3B = Qwen3MoeConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
)

PRESETS: Mapping[str, Qwen3MoeConfig] = MappingProxyType(
    {
        "qwen3_moe_tiny": Qwen3MoeConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        ),
        "qwen3_30b_a3b": _30B_A3B,
        "qwen3_30b_a3b_l12": attrs.evolve(_30B_A3B, num_hidden_layers=12),
    }
)

#: The HF hub model each released preset has the shape of (its weights import as is).
HF_NAMES: Mapping[str, str] = MappingProxyType({"qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B"})


if __name__ == "__main__":
    from dataflow_family_qwen3_moe.family import Qwen3MoeFamily

    print(Qwen3MoeFamily().preset_table(), end="")
