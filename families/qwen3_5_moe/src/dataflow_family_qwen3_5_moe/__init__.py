"""dataflow-family-qwen3-5-moe: Qwen 3.5 MoE as a dataflow model family: its presets, its
config (the kit's hybrid decoder, Gated DeltaNet and gated full-attention block kinds,
with routed experts and a sigmoid-gated shared expert in every layer) and the
``config.json`` of ``Qwen3_5MoeForCausalLM`` on the training kit's ``MoEFamily``."""
