"""Named OLMoE configs: the released 1B-active / 7B-total model and a tiny one for CPU
tests and demos.

``olmoe_1b_7b`` is copied from the published ``config.json`` of
``allenai/OLMoE-1B-7B-0924`` on the HF hub: vocabulary 50,304, hidden 2,048, 16 layers of
16 heads (no GQA, ``head_dim`` 128), 64 experts of width 1,024 with 8 per token,
``norm_topk_prob`` false, ``router_aux_loss_coef`` 0.01, ``rms_norm_eps`` 1e-5,
``rope_theta`` 10,000 with no scaling, context 4,096, an untied output projection, no
``clip_qkv``. The router z-loss coefficient (absent from that file, and from transformers)
is the 0.001 OLMoE was trained with (Muennighoff et al., "OLMoE: Open Mixture-of-Experts
Language Models", 2024, section 2 / table 1). ``olmoe_tiny`` is byte-sized (256 tokens), 2
layers of width 64, 4 heads, 8 experts of width 32 with 2 per token.

``python -m dataflow_family_olmoe.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_family_olmoe.config import OlmoeConfig

PRESETS: Mapping[str, OlmoeConfig] = MappingProxyType(
    {
        "olmoe_tiny": OlmoeConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            router_z_loss_coef=0.001,
        ),
        # allenai/OLMoE-1B-7B-0924 config.json
        "olmoe_1b_7b": OlmoeConfig(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            router_aux_loss_coef=0.01,
            router_z_loss_coef=0.001,
        ),
    }
)

#: The HF hub model each released preset has the shape of (its weights import as is).
HF_NAMES: Mapping[str, str] = MappingProxyType({"olmoe_1b_7b": "allenai/OLMoE-1B-7B-0924"})


if __name__ == "__main__":
    from dataflow_family_olmoe.family import OlmoeFamily

    print(OlmoeFamily().preset_table(), end="")
