"""``Qwen3MoeReference``: the plain-autograd truth of the qwen3_moe family: the kit's
``MoEReference`` (plain torch, an expert loop) for a ``Qwen3MoeConfig``.
``tests/test_qwen3_moe_hf.py`` holds it to ``transformers.Qwen3MoeForCausalLM``.
"""

from __future__ import annotations

from dataflow_training.kit.moe_reference import MoEReference


class Qwen3MoeReference(MoEReference):
    """``model(rounds)`` -> (per-round losses, router terms); ``model.logits(tokens)``."""
