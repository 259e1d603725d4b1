"""dataflow-family-qwen3: Qwen 3 (dense) as a dataflow model family.

The entry point is ``dataflow_family_qwen3.plugin`` (tiny: it registers the family); the
family object is ``dataflow_family_qwen3.family.Qwen3Family``, a
``dataflow_training.kit.decoder_family.DecoderFamily`` whose config turns on the kit
decoder's per-head q/k RMSNorm. This package adds the presets and the ``config.json``
mapping of ``Qwen3ForCausalLM``.
"""
