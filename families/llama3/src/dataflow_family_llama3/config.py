"""``Llama3Config``: the kit's decoder config (fields as HF's ``LlamaConfig``) and its default
architecture, Llama's: RMSNorm, GQA with RoPE (Llama 3.1's scaling where a preset has
``rope_scaling``), SwiGLU, tied or untied embeddings."""

import attrs
from dataflow_training.kit import DecoderConfig


@attrs.frozen
class Llama3Config(DecoderConfig):
    """Sizes of a Llama 3 model."""
