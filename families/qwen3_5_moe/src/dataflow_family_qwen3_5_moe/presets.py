"""Named Qwen 3.5 MoE configs: the 35B-A3B shape that transformers documents, a cut of it
for one GPU, and a tiny one for CPU tests and demos.

``qwen3_5_35b_a3b`` is ``Qwen3_5MoeTextConfig()`` of transformers 5.25, field for field
(its docstring calls these defaults the "Qwen3.5-35B-A3B style configuration"):
vocabulary 248,320, width 2,048, 40 layers (30 Gated DeltaNet, 10 full attention), 16
query and 2 key/value heads of ``head_dim`` 256 with RoPE (base 10,000) on a quarter of
each head, Gated DeltaNet with 16 key heads and 32 value heads of 128 and a 4-tap
convolution, 256 experts of width 512 with 8 per token (renormalised) and a shared
expert of width 512, ``router_aux_loss_coef`` 0.001, ``rms_norm_eps`` 1e-6, context
32,768, untied. Its parameter count is checked against ``Qwen3_5MoeForCausalLM`` of that
config (34,660,610,688; the multi-token-prediction and vision weights of the published
checkpoint are not part of it).

``qwen3_5_moe_cut`` is 4 layers of ``qwen3_5_35b_a3b`` (three Gated DeltaNet, one full
attention: every block kind once), for the speed row on one GPU: its host state (bf16
weights and gradients, float32 AdamW moments: 12 bytes a parameter) is 49 GiB, where the
whole model's (387 GiB) is more than the device machine's 128 GiB host holds.

``qwen3_5_moe_tiny`` is byte-sized (256 tokens), 4 layers of width 64 (three Gated
DeltaNet, then one full attention), 4 query and 2 key/value heads of ``head_dim`` 32,
Gated DeltaNet with 2 key and 4 value heads of 16, 8 experts of width 32 with 2 per
token and a shared expert of width 48.

``python -m dataflow_family_qwen3_5_moe.presets`` prints the table of
``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_family_qwen3_5_moe.config import Qwen3_5MoeConfig

#: ``Qwen3_5MoeTextConfig()`` of transformers 5.25
_35B_A3B = Qwen3_5MoeConfig(
    vocab_size=248320,
    hidden_size=2048,
    intermediate_size=512,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    router_aux_loss_coef=0.001,
    shared_expert_intermediate_size=512,
)

_TINY = Qwen3_5MoeConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.001,
    shared_expert_intermediate_size=48,
)

PRESETS: Mapping[str, Qwen3_5MoeConfig] = MappingProxyType(
    {
        "qwen3_5_moe_tiny": _TINY,
        "qwen3_5_35b_a3b": _35B_A3B,
        "qwen3_5_moe_cut": _35B_A3B.with_overrides(num_hidden_layers=4),
    }
)

#: The HF hub model each released preset has the shape of (none is pinned yet: the
#: published ``config.json`` is not readable here; the shape is transformers' default).
HF_NAMES: Mapping[str, str] = MappingProxyType({})


if __name__ == "__main__":
    from dataflow_family_qwen3_5_moe.family import Qwen3_5MoeFamily

    print(Qwen3_5MoeFamily().preset_table(), end="")
