"""dataflow-family-olmoe: OLMoE (mixture of experts) as a dataflow model family.

The entry point is ``dataflow_family_olmoe.plugin`` (tiny: it registers the family); the
family object is ``dataflow_family_olmoe.family.OlmoeFamily``, a
``dataflow_training.kit.moe_family.MoEFamily`` whose config normalises q and k over the
whole projection and does not renormalise the top-k routing weights. This package adds
the presets and the ``config.json`` mapping of ``OlmoeForCausalLM``.
"""
