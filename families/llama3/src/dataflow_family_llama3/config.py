"""``Llama3Config``: the kit's decoder shape without q/k norm, RoPE with Llama 3.1's
frequency scaling where a preset has it (``rope_scaling``), GQA, SwiGLU, tied or untied
embeddings. Fields are named as in HF's ``LlamaConfig``; see
``dataflow_training.kit.decoder.DecoderConfig``."""

from __future__ import annotations

from typing import ClassVar

import attrs
from dataflow_training.kit.decoder import DecoderConfig


@attrs.frozen
class Llama3Config(DecoderConfig):
    """Sizes of a Llama 3 model (no per-head q/k norm)."""

    qk_norm: ClassVar[bool] = False
