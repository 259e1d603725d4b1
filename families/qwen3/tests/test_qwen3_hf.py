"""HF parity against ``transformers.Qwen3ForCausalLM``: random small configs (untied and
tied, grouped-query attention, a ``head_dim`` wider than ``hidden_size / heads``, per-head
q/k norms perturbed away from 1) saved by ``save_pretrained``: logits and one training
step agree, export reloads bit for bit (one file and sharded). The tests and their
tolerances are the kit's ``DecoderHFParity``; skipped without transformers (``pip install
-e 'families/qwen3[test]'``)."""

from __future__ import annotations

from dataflow_training.testing import DecoderHFParity


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


class TestQwen3SlidingWindowParity(DecoderHFParity):
    """Layers of full and sliding-window attention mixed as HF's ``layer_types`` mixes them
    (a window of 5 tokens, shorter than the 20 the tests run), against transformers' own
    sliding-window mask: logits, one AdamW step, export and import."""

    family_name = "qwen3"
    preset = "qwen3_tiny_swa"
    hf_class = "Qwen3ForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=tied,
        )

    def test_the_window_is_imported_and_it_cuts(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, _ = family.import_hf(folder)
        assert config.sliding_window == 5 and config.num_hidden_layers == 3
        kinds = [layer.kind for layer in family.layers(config)[1:-1]]
        assert kinds == ["sliding_block", "block", "sliding_block"]
        # the same checkpoint read without its window gives other logits: the window matters
        import json

        import torch

        hf = json.loads((folder / "config.json").read_text())
        full = family.config_from_hf({**hf, "use_sliding_window": False, "layer_types": None}, "c")
        state = family.import_hf(folder)[1]
        tokens, _ = self._batch(config.vocab_size)
        with torch.no_grad():
            logits = []
            for c in (config, full):
                reference = family.reference_model(c)
                reference.load_state_dict(state)
                logits.append(reference.logits(tokens))
        assert not torch.allclose(logits[0], logits[1], rtol=1e-3, atol=1e-3)
