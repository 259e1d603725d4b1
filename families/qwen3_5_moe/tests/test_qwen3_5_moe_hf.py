"""HF parity against ``transformers.Qwen3_5MoeForCausalLM``: random small configs (untied and
tied; four layers, three Gated DeltaNet with grouped values and one gated full attention,
so that the load-balancing term pools the layers of both kinds; 8 experts top-3 and a
shared expert wider than them; every norm perturbed away from its start) saved by
``save_pretrained``: logits and the objective (cross-entropy plus
``router_aux_loss_coef`` times transformers' balance term), one training step against
``torch.optim.AdamW``, export reloading bit for bit (one file and sharded). The tests and
their tolerances are the kit's ``MoEHFParity``; here also a published
(``Qwen3_5MoeForConditionalGeneration``) checkpoint's layout: nested ``text_config``,
``model.language_model.*`` tensors, ``mtp.*`` and ``model.visual.*`` dropped with one line.
Skipped without transformers (``pip install -e 'families/qwen3_5_moe[test]'``)."""

from __future__ import annotations

import torch
from dataflow_training.testing import HybridHFChecks, MoEHFParity


class TestQwen3_5MoeParity(HybridHFChecks, MoEHFParity):
    family_name = "qwen3_5_moe"
    preset = "qwen3_5_moe_tiny"
    published_class = "Qwen3_5MoeForConditionalGeneration"
    mtp_mlp_tensor = "mtp.layers.0.mlp.experts.0.up_proj.weight"
    hf_class = "Qwen3_5MoeForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3_5MoeTextConfig(
            vocab_size=97,
            hidden_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.25,
            },
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=3,
            router_aux_loss_coef=0.02,
            output_router_logits=True,
            tie_word_embeddings=tied,
        )

    def test_the_parts_are_there(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        kinds = [layer.kind for layer in family.layers(config)[1:-1]]
        assert kinds == ["linear_moe"] * 3 + ["full_moe"]
        assert (config.num_experts, config.num_experts_per_tok) == (8, 3)
        assert config.shared_expert_intermediate_size == 24 and config.norm_topk_prob
        assert state["0.mlp.experts.gate_up_proj"].shape == (8, 2 * 16, 32)
        assert state["3.mlp.shared_expert.up_proj.weight"].shape == (24, 32)
        assert state["3.mlp.shared_expert_gate.weight"].shape == (1, 32)
        assert state["3.self_attn.q_proj.weight"].shape == (2 * 64, 32)  # queries and gates
        hf_experts = model.model.layers[1].mlp.experts
        assert torch.equal(state["1.mlp.experts.down_proj"], hf_experts.down_proj)
