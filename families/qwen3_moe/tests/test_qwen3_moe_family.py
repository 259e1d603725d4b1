"""The qwen3_moe family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on qwen3_moe_tiny, HF round trip) and the kit's MoE-family checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_family_qwen3_moe.config import Qwen3MoeConfig
from dataflow_family_qwen3_moe.family import Qwen3MoeFamily
from dataflow_training.kit import CheckpointError
from dataflow_training.testing import MoEFamilyChecks, TrainingFamilyConformance

DOCS = Path(__file__).resolve().parents[3] / "docs"
HOST_BYTES_PER_PARAMETER = 2 + 2 + 8  # bf16 weight and gradient, two float32 moments


class TestQwen3Moe(TrainingFamilyConformance, MoEFamilyChecks):
    distribution = "dataflow-family-qwen3-moe"
    expected_names = ("qwen3_moe",)
    family_name = "qwen3_moe"
    preset = "qwen3_moe_tiny"
    docs = DOCS
    #: Qwen3-30B-A3B's 30.5B total parameters, counted from its published config.json
    published_counts = {"qwen3_30b_a3b": 30_532_122_624}


def test_the_released_preset_and_its_cut() -> None:
    from dataflow_training.kit import moe_parameter_count

    family = Qwen3MoeFamily()
    full, cut = family.config("qwen3_30b_a3b"), family.config("qwen3_30b_a3b_l12")
    assert type(full) is Qwen3MoeConfig
    assert Qwen3MoeConfig.architecture.blocks["moe"].attention.qk_norm.scope == "head"
    assert (full.num_experts, full.num_experts_per_tok, full.norm_topk_prob) == (128, 8, True)
    assert (full.head_dim, full.num_key_value_heads, full.intermediate_size) == (128, 4, 768)
    block = {p.name: p.shape for p in family.layers(full)[1].params}
    assert block["self_attn.q_norm.weight"] == block["self_attn.k_norm.weight"] == (128,)
    assert cut == full.with_overrides(num_hidden_layers=12)
    host = moe_parameter_count(cut) * HOST_BYTES_PER_PARAMETER
    assert 80 * 2**30 < host < 96 * 2**30  # fits the 128 GiB host with room to spare
    assert moe_parameter_count(full) * HOST_BYTES_PER_PARAMETER > 128 * 2**30


def test_dense_layers_and_sliding_windows_are_refused(tmp_path) -> None:
    family = Qwen3MoeFamily()
    config = family.config("qwen3_moe_tiny")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for field, value in [
        ("use_sliding_window", True),
        ("decoder_sparse_step", 2),
        ("mlp_only_layers", [0]),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**written, field: value}))
        with pytest.raises(CheckpointError, match=rf"config.json: {field} = .* not implemented"):
            family.import_hf(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["qwen3_moe_tiny", pytest.param("qwen3_30b_a3b_l12", marks=pytest.mark.slow)]
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family qwen3_moe --preset PRESET --device cuda --dtype bf16`."""
    from dataflow_training import verify

    failed = [c for c in verify("qwen3_moe", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed
