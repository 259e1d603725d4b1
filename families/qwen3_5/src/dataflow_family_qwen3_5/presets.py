"""Named Qwen 3.5 dense configs: a tiny one for CPU tests and demos, the 9B shape that
transformers documents, and a cut of it for one GPU.

``qwen3_5_9b`` is ``Qwen3_5TextConfig()`` of transformers 5.25, field for field (its
docstring calls these defaults "the Qwen3.5-9B style configuration"): vocabulary 248,320,
width 4,096, 32 layers (24 Gated DeltaNet, 8 full attention), MLP 12,288, 16 query and 4
key/value heads of ``head_dim`` 256 with RoPE (base 10,000) on a quarter of each head,
Gated DeltaNet with 16 key heads and 32 value heads of 128 and a 4-tap convolution,
``rms_norm_eps`` 1e-6, context 32,768, untied. Its parameter count is checked against
``Qwen3_5ForCausalLM`` of that config (8,953,803,264). The other published dense sizes
(0.8B to 27B) are left out until their ``config.json`` files can be read here: their
Gated DeltaNet head counts are not in transformers.

``qwen3_5_cut`` is 4 layers of ``qwen3_5_9b`` (three Gated DeltaNet, one full attention:
every block kind once), which stock PyTorch trains on one H200 at sequence 4,096 (the
speed row of ``benchmarks/results/compare.json``).

``qwen3_5_tiny`` is byte-sized (256 tokens), 4 layers of width 64 (three Gated
DeltaNet, then one full attention), 4 query and 2 key/value heads of ``head_dim`` 32
(a rotary dimension of 8), Gated DeltaNet with 2 key and 4 value heads of 16 (grouped
values, as the released models have).

``python -m dataflow_family_qwen3_5.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_family_qwen3_5.config import Qwen3_5Config

#: ``Qwen3_5TextConfig()`` of transformers 5.25
_9B = Qwen3_5Config(
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
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
)

_TINY = Qwen3_5Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)

PRESETS: Mapping[str, Qwen3_5Config] = MappingProxyType(
    {
        "qwen3_5_tiny": _TINY,
        "qwen3_5_9b": _9B,
        "qwen3_5_cut": _9B.with_overrides(num_hidden_layers=4),
    }
)

#: The HF hub model each released preset has the shape of (none is pinned yet: see above).
HF_NAMES: Mapping[str, str] = MappingProxyType({})


if __name__ == "__main__":
    from dataflow_family_qwen3_5.family import Qwen3_5Family

    print(Qwen3_5Family().preset_table(), end="")
