"""``Qwen3Reference``: the plain-autograd truth of the qwen3 family.

It is the training kit's ``DecoderReference`` (plain torch only: no ``ops``, no code shared
with the kit's math) for a ``Qwen3Config``, whose ``qk_norm`` gives every attention a
``q_norm`` and a ``k_norm`` (RMSNorm over each head) before the rotation.
``tests/test_qwen3_hf.py`` holds it to ``transformers.Qwen3ForCausalLM``.
"""

from __future__ import annotations

from dataflow_training.kit.decoder_reference import DecoderReference


class Qwen3Reference(DecoderReference):
    """``model(tokens, targets)`` -> mean loss; ``model.logits(tokens)``."""
