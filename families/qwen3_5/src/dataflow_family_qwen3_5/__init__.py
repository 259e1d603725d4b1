"""dataflow-family-qwen3-5: Qwen 3.5 (dense) as a dataflow model family: its presets, its
config (the kit's decoder with Gated DeltaNet and gated full-attention block kinds) and
the ``config.json`` of ``Qwen3_5ForCausalLM`` on the training kit's ``DecoderFamily``."""
