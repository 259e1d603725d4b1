"""HF parity against ``transformers.Qwen3_5ForCausalLM``: random small configs (untied and
tied; three Gated DeltaNet layers with grouped values and a gated full-attention layer,
every norm perturbed away from its start) saved by ``save_pretrained``: logits and loss,
one training step against ``torch.optim.AdamW``, export reloading bit for bit (one file
and sharded). The tests and their tolerances are the kit's ``DecoderHFParity``; here also
a published (vision-language) checkpoint's layout: nested ``text_config``,
``model.language_model.*`` tensors, ``mtp.*`` and ``model.visual.*`` dropped with one line.
Skipped without transformers (``pip install -e 'families/qwen3_5[test]'``)."""

from __future__ import annotations

from dataflow_training.testing import DecoderHFParity, HybridHFChecks


class TestQwen3_5Parity(HybridHFChecks, DecoderHFParity):
    family_name = "qwen3_5"
    preset = "qwen3_5_tiny"
    published_class = "Qwen3_5ForConditionalGeneration"
    hf_class = "Qwen3_5ForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3_5TextConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
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
            tie_word_embeddings=tied,
        )

    def test_the_parts_are_there(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        kinds = [layer.kind for layer in family.layers(config)[1:-1]]
        assert kinds == ["linear_block"] * 3 + ["full_block"]
        assert state["0.linear_attn.conv1d.weight"].shape == (2 * 16 + 48, 1, 4)
        assert state["3.self_attn.q_proj.weight"].shape == (2 * 64, 32)  # queries and gates
        block = family.math("full_block")
        assert block.attention.positions.rotary_dim(config) == 4
