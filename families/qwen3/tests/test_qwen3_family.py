"""The qwen3 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on qwen3_tiny, HF round trip) and the kit's decoder-family checks
(parameter counts, docs against the code, errors, ``dataflow train`` and ``export``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dataflow_family_qwen3.config import Qwen3Config
from dataflow_family_qwen3.family import Qwen3Family
from dataflow_training.kit.decoder_testing import DecoderFamilyChecks
from dataflow_training.kit.hf import CheckpointError
from dataflow_training.testing import TrainingFamilyConformance

DOCS = Path(__file__).resolve().parents[3] / "docs"


class TestQwen3(TrainingFamilyConformance, DecoderFamilyChecks):
    distribution = "dataflow-family-qwen3"
    expected_names = ("qwen3",)
    family_name = "qwen3"
    preset = "qwen3_tiny"
    docs = DOCS
    #: the counts the released models are published with (tied output projection once)
    published_counts = {"qwen3_0_6b": 596_049_920}


def test_presets_have_qk_norm_and_head_dim_128() -> None:
    family = Qwen3Family()
    assert all(type(config) is Qwen3Config for config in family.presets.values())
    assert Qwen3Config.qk_norm
    released = [
        family.config(name) for name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b")
    ]
    assert {
        (c.head_dim, c.num_key_value_heads, c.rope_theta, c.rope_scaling) for c in released
    } == {(128, 8, 1000000.0, None)}
    assert [c.tie_word_embeddings for c in released] == [True, True, True, False]
    block = {p.name: p.shape for p in family.layers(released[0])[1].params}
    assert block["self_attn.q_norm.weight"] == block["self_attn.k_norm.weight"] == (128,)
    assert block["self_attn.q_proj.weight"] == (2048, 1024)  # wider than the residual


def test_a_sliding_window_checkpoint_is_refused(tmp_path) -> None:
    import json

    family = Qwen3Family()
    config = family.config("qwen3_tiny")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match=r"config.json: use_sliding_window = True: "):
        family.import_hf(tmp_path)
    layer_types = ["full_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps({**written, "layer_types": layer_types}))
    with pytest.raises(CheckpointError, match=r"layer_types has \['sliding_attention'\]"):
        family.import_hf(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["qwen3_tiny", pytest.param("qwen3_0_6b", marks=pytest.mark.slow)]
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family qwen3 --preset PRESET --device cuda --dtype bf16`: the
    engine's step on the GPU (bf16 weights, gradients, activations) against the float64
    reference, at the bf16 tolerances of `dataflow_training.verify.TOLERANCES`."""
    from dataflow_training.verify import verify

    failed = [c for c in verify("qwen3", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed
