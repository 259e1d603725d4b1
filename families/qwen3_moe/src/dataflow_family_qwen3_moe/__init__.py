"""dataflow-family-qwen3-moe: Qwen 3 MoE as a dataflow model family: its presets, its config
(the kit's MoE decoder: per-head q/k norms) and the ``config.json`` of
``Qwen3MoeForCausalLM`` on the training kit's ``MoEFamily``."""
