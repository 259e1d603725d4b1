"""HF parity against ``transformers.DeepseekV3ForCausalLM``: random small configs (untied and
tied; three layers, the first dense; a q latent and none; values narrower than the
queries; 8 experts in 4 groups, 2 groups chosen, top 3; selection biases set away from
zero so that they change the choice; every norm perturbed) saved by ``save_pretrained``:
logits and the objective (cross-entropy plus the sequence-wise balance loss, written out
here from transformers' router outputs: its model has no such term), one training step
against ``torch.optim.AdamW`` with the selection bias moved by the sign rule written out
here from transformers' routing, export reloading bit for bit (one file and sharded), the
published layout (an MTP layer past the last, dropped with a line), FP8 refused by name.
Skipped without transformers (``pip install -e 'families/deepseek[test]'``)."""

from __future__ import annotations

import json

from dataflow_family_deepseek.testing import DeepseekV3HFParity


class TestDeepseekV3Parity(DeepseekV3HFParity):
    """Values narrower than the queries, a q latent (DeepSeek V3's attention)."""


class TestDeepseekV3ParityNoQLatent(TestDeepseekV3Parity):
    """Moonlight's attention: ``q_lora_rank`` None, a plain ``q_proj``."""

    q_lora_rank = None


class TestDeepseekV3ParityYarn(TestDeepseekV3Parity):
    """YaRN (as DeepSeek V3's and Kimi K2's checkpoints): its frequencies, its rope
    factor (``mscale`` apart from ``mscale_all_dim``) and the softmax scale's
    ``mscale_all_dim``; rope pairs not interleaved."""

    def hf_config(self, transformers, tied):
        config = super().hf_config(transformers, tied)
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        }
        config.rope_interleave = False
        return config

    def test_the_published_config_spelling_imports(self, family, tmp_path):
        """Hub files spell YaRN as ``rope_theta`` + ``rope_scaling`` with ``type``."""
        config = family.config(self.preset, rope_yarn={"factor": 4.0, "original_max_position": 16})
        family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        rope = written.pop("rope_parameters")
        written["rope_theta"] = rope.pop("rope_theta")
        written["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        (tmp_path / "config.json").write_text(json.dumps(written))
        assert family.import_hf(tmp_path)[0] == config
