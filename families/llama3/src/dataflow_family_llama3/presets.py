"""Named Llama 3 configs: the shapes of Llama 3.2 1B and 3B and Llama 3.1 8B, and a tiny
one for CPU tests and demos.

The released shapes are copied from each model's published ``config.json`` on the HF hub
(``meta-llama/Llama-3.2-1B``, ``meta-llama/Llama-3.2-3B``, ``meta-llama/Llama-3.1-8B``):
vocabulary 128,256, context 131,072, ``rms_norm_eps`` 1e-5, ``rope_theta`` 500,000 and
``rope_scaling`` of type ``llama3`` (factor 32 for 3.2, 8 for 3.1; low/high frequency
factors 1 and 4; original context 8,192). The 1B and 3B tie the output projection to the
embedding, the 8B does not. ``llama3_tiny`` is byte-sized (256 tokens), 2 layers of width
64 with grouped-query attention (4 query heads, 2 key/value heads), an MLP width that is
not a power of two, and a rope scaling whose original context (64) puts one frequency in
each of the three bands of the scaling (kept, blended, divided).

``python -m dataflow_family_llama3.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_training.kit import Llama3Scaling

from dataflow_family_llama3.config import Llama3Config

_VOCAB = 128256
_CONTEXT = 131072
_THETA = 500000.0
_LLAMA_3_2_ROPE = Llama3Scaling(factor=32.0, original_max_position=8192)
_LLAMA_3_1_ROPE = Llama3Scaling(factor=8.0, original_max_position=8192)


def _released(**sizes: object) -> Llama3Config:
    return Llama3Config(
        vocab_size=_VOCAB,
        max_position_embeddings=_CONTEXT,
        rope_theta=_THETA,
        rms_norm_eps=1e-5,
        num_key_value_heads=8,
        **sizes,
    )


PRESETS: Mapping[str, Llama3Config] = MappingProxyType(
    {
        "llama3_tiny": Llama3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_theta=_THETA,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_scaling=Llama3Scaling(factor=8.0, original_max_position=64),
        ),
        # meta-llama/Llama-3.2-1B config.json
        "l3_1b": _released(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            head_dim=64,
            tie_word_embeddings=True,
            rope_scaling=_LLAMA_3_2_ROPE,
        ),
        # meta-llama/Llama-3.2-3B config.json
        "l3_3b": _released(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            head_dim=128,
            tie_word_embeddings=True,
            rope_scaling=_LLAMA_3_2_ROPE,
        ),
        # meta-llama/Llama-3.1-8B config.json
        "llama3_8b": _released(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            tie_word_embeddings=False,
            rope_scaling=_LLAMA_3_1_ROPE,
        ),
    }
)

#: The HF hub model each released preset has the shape of (its weights import as is).
HF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "l3_1b": "meta-llama/Llama-3.2-1B",
        "l3_3b": "meta-llama/Llama-3.2-3B",
        "llama3_8b": "meta-llama/Llama-3.1-8B",
    }
)


if __name__ == "__main__":
    from dataflow_family_llama3.family import Llama3Family

    print(Llama3Family().preset_table(), end="")
