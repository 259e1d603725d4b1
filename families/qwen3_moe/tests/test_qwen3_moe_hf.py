"""HF parity against ``transformers.Qwen3MoeForCausalLM``: random small configs (untied and
tied, two layers, so that the load-balancing term pools the layers' router statistics, grouped-query
attention with a ``head_dim`` wider than ``hidden_size / heads``, 8 experts top-3
renormalised, per-head q/k norms perturbed away from 1) saved by ``save_pretrained``:
logits and the objective, one training step, export bit for bit (one file and sharded).
The tests and their tolerances are the kit's ``MoEHFParity``; skipped without
transformers (``pip install -e 'families/qwen3_moe[test]'``)."""

from __future__ import annotations

from dataflow_training.testing import MoEHFParity


class TestQwen3MoeParity(MoEHFParity):
    family_name = "qwen3_moe"
    preset = "qwen3_moe_tiny"
    hf_class = "Qwen3MoeForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3MoeConfig(
            vocab_size=97,
            hidden_size=32,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            router_aux_loss_coef=0.02,
            output_router_logits=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=tied,
        )
