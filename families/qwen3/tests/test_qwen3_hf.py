"""HF parity against ``transformers.Qwen3ForCausalLM``: random small configs (untied and
tied, grouped-query attention, a ``head_dim`` wider than ``hidden_size / heads``, per-head
q/k norms perturbed away from 1) saved by ``save_pretrained``: logits and one training
step agree, export reloads bit for bit (one file and sharded). The tests and their
tolerances are the kit's ``DecoderHFParity``; skipped without transformers (``pip install
-e 'families/qwen3[test]'``)."""

from __future__ import annotations

from dataflow_training.kit.decoder_testing import DecoderHFParity


class TestQwen3Parity(DecoderHFParity):
    family_name = "qwen3"
    preset = "qwen3_tiny"
    hf_class = "Qwen3ForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=tied,
        )
