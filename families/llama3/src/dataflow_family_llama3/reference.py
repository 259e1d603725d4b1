"""``Llama3Reference``: the plain-autograd truth of the llama3 family.

It is the training kit's ``DecoderReference`` (plain torch only: no ``ops``, no code shared
with the kit's math) for a ``Llama3Config``: RMSNorm, RoPE with Llama 3's frequency
scaling written out, grouped-query attention as the softmax of masked scores, SwiGLU.
``tests/test_llama3_hf.py`` holds it to ``transformers.LlamaForCausalLM``.
"""

from __future__ import annotations

from dataflow_training.kit.decoder_reference import DecoderReference


class Llama3Reference(DecoderReference):
    """``model(tokens, targets)`` -> mean loss; ``model.logits(tokens)``."""
