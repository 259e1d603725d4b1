"""HF parity against ``transformers.Qwen3_5ForCausalLM``: random small configs (untied and
tied; three Gated DeltaNet layers with grouped values and a gated full-attention layer,
every norm perturbed away from its start) saved by ``save_pretrained``: logits and loss,
one training step against ``torch.optim.AdamW``, export reloading bit for bit (one file
and sharded). The tests and their tolerances are the kit's ``DecoderHFParity``; here also
a published (vision-language) checkpoint's layout: nested ``text_config``,
``model.language_model.*`` tensors, ``mtp.*`` and ``model.visual.*`` dropped with one line.
Skipped without transformers (``pip install -e 'families/qwen3_5[test]'``)."""

from __future__ import annotations

import json
import logging

import torch
from dataflow_training.testing import DecoderHFParity
from safetensors.torch import load_file, save_file


class TestQwen3_5Parity(DecoderHFParity):
    family_name = "qwen3_5"
    preset = "qwen3_5_tiny"
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

    def adjust(self, model):
        """Decays of at most 1 a token (``A`` in 0.01 .. 1, HF draws it up to 16): HF's
        chunked rule sums a chunk's log decays in float32, which over 20 tokens of decays
        near 16 loses the digits its smallest ``in_proj_a`` gradients are made of (the
        kernels here sum them in float64)."""
        generator = torch.Generator().manual_seed(3)
        for layer in model.model.layers[:3]:
            a_log = layer.linear_attn.A_log
            a_log.copy_(torch.empty(a_log.shape).uniform_(0.01, 1.0, generator=generator).log())

    def test_a_published_layout_imports_its_text_model(self, family, hf_checkpoint, caplog):
        """A ``Qwen3_5ForConditionalGeneration``-style folder: the text config nested, the
        tensors under ``model.language_model``, an MTP layer and a vision tensor beside."""
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tensors = load_file(folder / "model.safetensors")
        renamed = {
            name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()
        }
        renamed["mtp.fc.weight"] = torch.zeros(4, 4)
        renamed["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
        renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        save_file(renamed, folder / "model.safetensors")
        hf = json.loads((folder / "config.json").read_text())
        published = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": hf["tie_word_embeddings"],
            "text_config": hf,
            "vision_config": {"depth": 2},
        }
        (folder / "config.json").write_text(json.dumps(published))
        with caplog.at_level(logging.WARNING):
            again, read = family.import_hf(folder)
        assert again == config
        assert all(torch.equal(read[key], state[key]) for key in state)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "dropped 2 mtp tensors, 1 vision tensors" in lines[0]

    def test_the_parts_are_there(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        kinds = [layer.kind for layer in family.layers(config)[1:-1]]
        assert kinds == ["linear_block"] * 3 + ["full_block"]
        assert state["0.linear_attn.conv1d.weight"].shape == (2 * 16 + 48, 1, 4)
        assert state["3.self_attn.q_proj.weight"].shape == (2 * 64, 32)  # queries and gates
        block = family.math("full_block")
        assert block.attention.positions.rotary_dim(config) == 4
