"""Named Qwen 3 dense configs: the five released sizes up to 14B, and a tiny one for CPU
tests and demos.

The released shapes are copied from each model's published ``config.json`` on the HF hub
(``Qwen/Qwen3-0.6B``, ``Qwen/Qwen3-1.7B``, ``Qwen/Qwen3-4B``, ``Qwen/Qwen3-8B``,
``Qwen/Qwen3-14B``; the 14B's sizes as slime's ``scripts/models/qwen3-14B.sh`` gives them):
vocabulary 151,936, context 40,960, ``head_dim`` 128, 8 key/value heads,
``rms_norm_eps`` 1e-6, ``rope_theta`` 1,000,000 with no scaling, no sliding window. The
three small sizes tie the output projection to the embedding, the 8B and 14B do not.
``qwen3_tiny`` is byte-sized (256 tokens), 2 layers of width 64 with 4 query and 2
key/value heads of ``head_dim`` 32, so, as in every Qwen 3, the attention is wider
(4 x 32 = 128) than the residual stream. ``qwen3_tiny_swa`` is ``qwen3_tiny`` with a
sliding window of 4 tokens on its second layer (HF's ``use_sliding_window`` with
``max_window_layers`` 1: the layer types ``full_attention``, ``sliding_attention``), so
every sequence ``dataflow verify`` runs is longer than the window.

``python -m dataflow_family_qwen3.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_family_qwen3.config import Qwen3Config

_THETA = 1000000.0


def _released(**sizes: object) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=_THETA,
        rms_norm_eps=1e-6,
        num_key_value_heads=8,
        head_dim=128,
        **sizes,
    )


_TINY = Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rope_theta=_THETA,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

PRESETS: Mapping[str, Qwen3Config] = MappingProxyType(
    {
        "qwen3_tiny": _TINY,
        "qwen3_tiny_swa": _TINY.with_overrides(
            sliding_window=4, layer_types=("full_attention", "sliding_attention")
        ),
        # Qwen/Qwen3-0.6B config.json
        "qwen3_0_6b": _released(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        # Qwen/Qwen3-1.7B config.json
        "qwen3_1_7b": _released(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        # Qwen/Qwen3-4B config.json
        "qwen3_4b": _released(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            tie_word_embeddings=True,
        ),
        # Qwen/Qwen3-8B config.json
        "qwen3_8b": _released(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            tie_word_embeddings=False,
        ),
        # Qwen/Qwen3-14B config.json: the 14B-class dense model of issue 50
        "qwen3_14b": _released(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=40,
            num_attention_heads=40,
            tie_word_embeddings=False,
        ),
    }
)

#: The HF hub model each released preset has the shape of (its weights import as is).
HF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "qwen3_0_6b": "Qwen/Qwen3-0.6B",
        "qwen3_1_7b": "Qwen/Qwen3-1.7B",
        "qwen3_4b": "Qwen/Qwen3-4B",
        "qwen3_8b": "Qwen/Qwen3-8B",
        "qwen3_14b": "Qwen/Qwen3-14B",
    }
)


if __name__ == "__main__":
    from dataflow_family_qwen3.family import Qwen3Family

    print(Qwen3Family().preset_table(), end="")
