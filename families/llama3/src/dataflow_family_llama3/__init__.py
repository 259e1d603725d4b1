"""dataflow-family-llama3: Llama 3 (3.1, 3.2) as a dataflow model family.

The entry point is ``dataflow_family_llama3.plugin`` (tiny: it registers the family); the
family object is ``dataflow_family_llama3.family.Llama3Family``, a
``dataflow_training.kit.decoder_family.DecoderFamily``: the math, the reference model and
the safetensors I/O are the training kit's decoder, this package adds the presets and the
``config.json`` mapping of ``LlamaForCausalLM``.
"""
