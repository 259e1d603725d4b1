"""HF parity against ``transformers.LlamaForCausalLM``: random small configs (untied and
tied, grouped-query attention, Llama 3 rope scaling whose bands the sequence reaches)
saved by ``save_pretrained``: logits and one training step agree, export reloads bit for
bit (one file and sharded). The tests and their tolerances are the kit's
``DecoderHFParity``; skipped without transformers (``pip install -e
'families/llama3[test]'``)."""

from __future__ import annotations

from dataflow_training.testing import DecoderHFParity


class TestLlamaParity(DecoderHFParity):
    family_name = "llama3"
    preset = "llama3_tiny"
    hf_class = "LlamaForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=tied,
        )
