"""dataflow-family-olmoe: OLMoE (mixture of experts) as a dataflow model family: its presets,
its config (the kit's MoE decoder with q/k norms over the whole projections, top-k weights
not renormalised) and the ``config.json`` of ``OlmoeForCausalLM`` on the training kit's
``MoEFamily``."""
