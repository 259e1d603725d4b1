"""HF parity against ``transformers.OlmoeForCausalLM``: random small configs (untied and
tied, two layers, so that the load-balancing term pools the layers' router statistics, 8 experts top-3
without renormalising, q/k norms perturbed away from 1) saved by ``save_pretrained``:
logits and the objective, one training step, export bit for bit (one file and sharded).
The tests and their tolerances are the kit's ``MoEHFParity``; skipped without
transformers (``pip install -e 'families/olmoe[test]'``)."""

from __future__ import annotations

from dataflow_training.testing import MoEHFParity


class TestOlmoeParity(MoEHFParity):
    family_name = "olmoe"
    preset = "olmoe_tiny"
    hf_class = "OlmoeForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.OlmoeConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            router_aux_loss_coef=0.02,
            output_router_logits=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=tied,
            pad_token_id=None,
            eos_token_id=None,
        )
