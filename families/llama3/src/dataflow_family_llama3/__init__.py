"""dataflow-family-llama3: Llama 3 (3.1, 3.2) as a dataflow model family: its presets and the
``config.json`` of ``LlamaForCausalLM`` on the training kit's ``DecoderFamily``, whose
default parts are Llama's (``dataflow_training.kit.decoder``)."""
