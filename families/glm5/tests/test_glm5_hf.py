"""HF parity against ``transformers.GlmMoeDsaForCausalLM``: DeepSeek V3.2's parity tests
(``DeepseekV32HFParity`` of ``dataflow_family_deepseek.testing``: logits, the objective, export, one training step, the MTP
layers dropped, FP8 refused) on random small GLM 5 configs of 4 layers whose
``indexer_types`` are full, shared, shared, full (``index_topk_pattern`` ``"FSSF"``): the
shared layers attend to layer 0's selection, and the indexer keeps 6 of the 20 tokens.
transformers' indexer has no loss: the indexers' gradients are held to autograd of the
plain reference's KL, each leader's towards its group's mean distribution."""

from __future__ import annotations

import logging

import pytest
import torch
from dataflow_family_deepseek.testing import DeepseekV32HFParity
from dataflow_family_glm.config import Glm5Config  # noqa: F401 (the family's module loads)
from safetensors.torch import load_file, save_file

PATTERN = "FSSF"


class TestGlm5Parity(DeepseekV32HFParity):
    family_name = "glm5"
    preset = "glm5_tiny"
    hf_class = "GlmMoeDsaForCausalLM"
    #: the indexers of the full layers (0 and 3), 5 tensors each
    indexers = 5 * 2

    def hf_config(self, transformers, tied):
        fields = super().hf_config(transformers, tied).to_dict()
        keep = set(transformers.GlmMoeDsaConfig().to_dict()) - {"indexer_types"}
        fields = {k: v for k, v in fields.items() if k in keep}
        fields |= {"num_hidden_layers": 4, "mlp_layer_types": None, "layer_types": None}
        return transformers.GlmMoeDsaConfig(**fields, index_topk_pattern=PATTERN)

    def test_the_parts_are_there(self, family, hf_checkpoint):
        _, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        assert config.indexer_types == ("full", "shared", "shared", "full")
        kinds = [(layer.kind, layer.leader) for layer in family.layers(config)[1:-1]]
        assert kinds == [("dense", ""), ("moe_shared", "0"), ("moe_shared", "0"), ("moe", "")]
        assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (8, 16, 6)
        assert state["3.self_attn.indexer.wq_b.weight"].shape == (8 * 16, 24)
        assert not any(k.startswith(("1.self_attn.indexer", "2.self_attn.indexer")) for k in state)
        assert config.index_rope_interleave and config.rope_interleave

    def test_mtp_layers_are_dropped_with_a_line(self, family, hf_checkpoint, caplog):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)
        save_file(tensors, folder / "model.safetensors")
        with caplog.at_level(logging.WARNING):
            again, read = family.import_hf(folder)
        assert again == config and all(torch.equal(read[k], state[k]) for k in state)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "dropped 1 multi-token-prediction tensors (layers 4" in lines[0]


def test_a_shared_layer_first_is_refused_as_transformers_refuses_it(tmp_path) -> None:
    """transformers raises at a shared first layer; import names the field."""
    transformers = pytest.importorskip("transformers")
    from dataflow_family_glm.family import Glm5Family
    from dataflow_training.kit import CheckpointError

    family = Glm5Family()
    fields = family.config_to_hf(family.config("glm5_tiny"), torch.float32)
    fields["indexer_types"] = ["shared", "full", "full", "full"]
    with pytest.raises(CheckpointError, match=r"defaults: indexer_types = .*the first 'full'"):
        family.config_from_hf(fields, "defaults")
    assert transformers.GlmMoeDsaConfig(**fields).indexer_types[0] == "shared"
