"""dataflow-family-qwen3-moe: Qwen 3 MoE as a dataflow model family.

The entry point is ``dataflow_family_qwen3_moe.plugin`` (tiny: it registers the family);
the family object is ``dataflow_family_qwen3_moe.family.Qwen3MoeFamily``, a
``dataflow_training.kit.moe_family.MoEFamily`` whose config normalises q and k per head
and renormalises the top-k routing weights. This package adds the presets and the
``config.json`` mapping of ``Qwen3MoeForCausalLM``.
"""
