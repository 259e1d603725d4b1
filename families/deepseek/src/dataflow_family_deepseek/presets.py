"""Named DeepSeek V3-architecture configs.

``deepseek_v3`` is DeepSeek V3 (671B), ``DeepseekV3Config()`` of transformers 5.25 field
for field, with the published checkpoint's ``rope_scaling`` (YaRN: factor 40 over 4,096
positions, ``beta_fast`` 32, ``beta_slow`` 1, ``mscale = mscale_all_dim = 1``) and context
(163,840) from deepseek-ai/DeepSeek-V3's ``config.json`` (as transcribed in the DeepSeek V3
report's appendix and the hub file; not downloaded here). Its multi-token-prediction layer
is not part of it (import drops it). For ``predict`` only.

``kimi_k2`` is Kimi K2 (1T; moonshotai/Kimi-K2-Base, ``model_type`` ``kimi_k2`` with the
``DeepseekV3ForCausalLM`` architecture): 61 layers (1 dense), width 7,168, 64 heads,
384 experts (8 per token, one group), one shared expert, routed scaling 2.827, vocabulary
163,840, YaRN factor 32 over 4,096 positions (``beta_fast = beta_slow = 1``), rope base
50,000. Cross-checked against the Megatron arguments in THUDM/slime's
``scripts/models/kimi-k2.sh`` (layers, first dense, widths, heads, q and kv latents, head
widths, experts and their width, shared expert, scaling, norm eps, vocabulary, rope base and
YaRN factor); the YaRN betas and the 131,072-token context are from memory of its
``config.json``, not read here. For ``predict`` only.

``moonlight_16b_a3b`` is moonshotai/Moonlight-16B-A3B (``model_type`` ``deepseek_v3``):
27 layers (first 1 dense), width 2,048, dense MLP 11,264, 16 heads, no q latent, kv latent
512, 64 experts of 1,408 (6 per token, ``n_group = topk_group = 1``), 2 shared experts,
routed scaling 2.446, RMSNorm eps 1e-5, rope base 50,000, context 8,192. Cross-checked
against the Megatron arguments in THUDM/slime's ``scripts/models/moonlight.sh`` (layers,
widths, heads, experts, shared experts, scaling, norm eps, rope base, vocabulary 163,840;
it passes no ``--q-lora-rank``, Megatron's "no q latent", so ``q_lora_rank`` is null).
Its bf16 weights and AdamW state (12 bytes a parameter: bf16 weight and gradient, float32
moments) are 178 GiB, which the host's 256 GiB of a two-GPU machine holds.

``deepseek_v3_cut`` is DeepSeek V3 cut to 2 layers (1 dense, 1 MoE: every block kind
once) for a stock PyTorch run on one H200 (141 GB): 13.9B parameters, bf16 weights,
gradients and fused AdamW's bf16 moments (8 bytes a parameter) 111 GB, leaving about 30
GB for activations at 4,096 tokens (arithmetic, not measured). A third layer would be
another MoE layer of 11.5B parameters (92 GB) and does not fit.

``deepseek_v3_tiny`` is byte-sized (256 tokens), 3 layers (1 dense, 2 MoE) of width 64, 4
heads of query/key width 16 (8 rotated) and value width 8, a q latent of 32 and a kv
latent of 16, 8 experts of width 32 in 4 groups (2 groups, 2 experts per token), one
shared expert.

``python -m dataflow_family_deepseek.presets`` prints the table of
``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_training.kit import YarnScaling

from dataflow_family_deepseek.config import DeepseekV3Config

#: ``DeepseekV3Config()`` of transformers 5.25 with the published rope scaling and context
_DEEPSEEK_V3 = DeepseekV3Config(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    head_dim=64,
    max_position_embeddings=163840,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    rope_yarn=YarnScaling(
        factor=40.0,
        original_max_position=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),  # fmt: skip
)

PRESETS: Mapping[str, DeepseekV3Config] = MappingProxyType(
    {
        "deepseek_v3_tiny": DeepseekV3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            max_position_embeddings=128,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        "moonlight_16b_a3b": DeepseekV3Config(
            vocab_size=163840,
            hidden_size=2048,
            intermediate_size=11264,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=1408,
            n_shared_experts=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        "deepseek_v3": _DEEPSEEK_V3,
        "kimi_k2": _DEEPSEEK_V3.with_overrides(
            vocab_size=163840,
            num_attention_heads=64,
            num_key_value_heads=64,
            head_dim=64,
            max_position_embeddings=131072,
            rope_theta=50000.0,
            num_experts=384,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            first_k_dense_replace=1,
            rope_yarn=YarnScaling(
                factor=32.0,
                original_max_position=4096,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),  # fmt: skip
        ),
        "deepseek_v3_cut": _DEEPSEEK_V3.with_overrides(
            num_hidden_layers=2,
            first_k_dense_replace=1,
            max_position_embeddings=4096,
            rope_yarn=None,
        ),  # fmt: skip
    }
)

#: preset -> the HF hub model whose weights it takes
HF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "moonlight_16b_a3b": "moonshotai/Moonlight-16B-A3B",
        "deepseek_v3": "deepseek-ai/DeepSeek-V3",
        "kimi_k2": "moonshotai/Kimi-K2-Base",
    }
)

if __name__ == "__main__":
    from dataflow_family_deepseek.family import DeepseekV3Family

    print(DeepseekV3Family().preset_table(), end="")
