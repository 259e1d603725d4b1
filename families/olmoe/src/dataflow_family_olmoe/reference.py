"""``OlmoeReference``: the plain-autograd truth of the olmoe family: the kit's
``MoEReference`` (plain torch, an expert loop) for an ``OlmoeConfig``.
``tests/test_olmoe_hf.py`` holds it to ``transformers.OlmoeForCausalLM``.
"""

from __future__ import annotations

from dataflow_training.kit.moe_reference import MoEReference


class OlmoeReference(MoEReference):
    """``model(rounds)`` -> (per-round losses, router terms); ``model.logits(tokens)``."""
