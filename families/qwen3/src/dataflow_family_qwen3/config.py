"""``Qwen3Config``: the kit's decoder shape with Qwen 3's per-head q/k RMSNorm (one
``head_dim`` weight each for queries and keys, applied before the rotation), plain RoPE
(``rope_theta`` 1,000,000 on the released models), GQA, SwiGLU, and a ``head_dim`` set
apart from ``hidden_size // num_attention_heads`` (128 at every released size). Fields are
named as in HF's ``Qwen3Config``; see ``dataflow_training.kit.decoder.DecoderConfig``."""

from __future__ import annotations

from typing import ClassVar

import attrs
from dataflow_training.kit.decoder import DecoderConfig


@attrs.frozen
class Qwen3Config(DecoderConfig):
    """Sizes of a Qwen 3 dense model (per-head q/k norm on)."""

    qk_norm: ClassVar[bool] = True
