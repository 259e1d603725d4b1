"""dataflow-family-qwen3: Qwen 3 (dense) as a dataflow model family: its presets, its config
(the kit's decoder with per-head q/k norms and sliding-window layers) and the
``config.json`` of ``Qwen3ForCausalLM`` on the training kit's ``DecoderFamily``."""
