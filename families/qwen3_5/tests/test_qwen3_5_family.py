"""The qwen3_5 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on qwen3_5_tiny, HF round trip), the kit's decoder-family checks
(parameter counts, docs against the code, errors, ``dataflow train`` and ``export``), and
Qwen 3.5's own: the 9B count against transformers, the two block kinds and their layer
pattern, Gated DeltaNet's pricing linear in the sequence length, a 20-step run whose loss
falls and whose export transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_family_qwen3_5.config import Qwen3_5Config
from dataflow_family_qwen3_5.family import Qwen3_5Family
from dataflow_training.kit import (
    CheckpointError,
    GatedDeltaNet,
    hybrid_layer_types,
    parameter_count,
)
from dataflow_training.testing import (
    DecoderFamilyChecks,
    TrainingFamilyConformance,
    assert_predicts_at_16_gib,
)

DOCS = Path(__file__).resolve().parents[3] / "docs"


class TestQwen3_5(TrainingFamilyConformance, DecoderFamilyChecks):
    distribution = "dataflow-family-qwen3-5"
    expected_names = ("qwen3_5",)
    family_name = "qwen3_5"
    preset = "qwen3_5_tiny"
    docs = DOCS
    #: ``Qwen3_5ForCausalLM(Qwen3_5TextConfig())`` of transformers 5.25, counted on the meta
    #: device (test_the_9b_is_transformers_default_config counts it again where installed)
    published_counts = {"qwen3_5_9b": 8_953_803_264}


def test_the_9b_is_transformers_default_config() -> None:
    """Field for field ``Qwen3_5TextConfig()``, and the same parameter count."""
    transformers = pytest.importorskip("transformers")
    import torch

    family = Qwen3_5Family()
    hf = transformers.Qwen3_5TextConfig()
    config = family.config_from_hf(hf.to_dict(), "defaults")
    assert config == family.config("qwen3_5_9b")
    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(hf)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_block_kinds_follow_the_layer_pattern() -> None:
    family = Qwen3_5Family()
    kinds = [layer.kind for layer in family.layers(family.config("qwen3_5_9b"))[1:-1]]
    assert kinds == ["linear_block", "linear_block", "linear_block", "full_block"] * 8
    eight = family.config("qwen3_5_tiny", num_hidden_layers=8)
    assert eight.layer_types == hybrid_layer_types(8)
    assert family.config("qwen3_5_cut") == family.config("qwen3_5_9b", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"layer_types has 4 entries; Qwen3_5Config.num_hidden"):
        family.config("qwen3_5_tiny", num_hidden_layers=5, layer_types=hybrid_layer_types(4))
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of "):
        family.config("qwen3_5_tiny", linear_num_value_heads=3)
    blocks = Qwen3_5Config.architecture.blocks
    attention = blocks["full_block"].attention
    assert (attention.positions.fraction, attention.gate is not None) == (0.25, True)
    assert {block.norm.offset for block in blocks.values()} == {1.0}
    assert Qwen3_5Config.architecture.norm.offset == 1.0


def test_gated_deltanet_is_priced_linearly_in_the_sequence_length() -> None:
    family = Qwen3_5Family()
    config = family.config("qwen3_5_cut")
    linear, full = family.math("linear_block"), family.math("full_block")
    part = GatedDeltaNet()
    short, long = part.flops(config, 1, 4096), part.flops(config, 1, 8192)
    assert long == (2 * short[0], 2 * short[1])
    at = [linear.cost(config, 1, seq, 2).forward.flops for seq in (4096, 8192, 16384)]
    assert at[2] - at[1] == 2 * (at[1] - at[0])  # linear: equal steps
    attention = [full.cost(config, 1, seq, 2).forward.flops for seq in (4096, 8192, 16384)]
    assert attention[2] - attention[1] > 2 * (attention[1] - attention[0])  # quadratic
    saved = {s.name: s.shape for s in linear.saved(config, 1, 4096)}
    assert saved["qkv"] == (1, 4096, 8192) and saved["core"] == (1, 4096, 4096)


def test_a_checkpoint_with_another_rotation_or_layer_type_is_refused(tmp_path) -> None:
    family = Qwen3_5Family()
    config = family.config("qwen3_5_tiny")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    rope = {**written["rope_parameters"], "partial_rotary_factor": 0.5}
    refused = [
        ({"rope_parameters": rope}, r"partial_rotary_factor = 0.5: Qwen 3.5 rotates a quarter"),
        ({"layer_types": ["sliding_attention"] * 4}, r"layer_types = .*: expected a list of"),
    ]
    for change, message in refused:
        (tmp_path / "config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(CheckpointError, match=rf"config.json: {message}"):
            family.import_hf(tmp_path)


def test_twenty_steps_on_the_cpu_lower_the_loss_and_export_loads_in_transformers(tmp_path):
    """``dataflow train --preset qwen3_5_tiny --steps 20 --device cpu``, then ``dataflow
    export --hf``: the loss falls, and ``Qwen3_5ForCausalLM`` loads the trained weights."""
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from dataflow.testing import invoke

    out = tmp_path / "run"
    args = ["--batch", "4", "--seq-len", "32", "--device", "cpu", "--out", out]
    result = invoke("train", "--preset", "qwen3_5_tiny", "--steps", "20", *args)
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    result = invoke("export", "--hf", tmp_path / "hf", "--from", out / "step_000020")
    assert result.exit_code == 0, result.output
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "hf")
    trained = load_file(out / "step_000020" / "model.safetensors")
    assert torch.equal(model.model.layers[0].linear_attn.A_log, trained["0.linear_attn.A_log"])
    family = Qwen3_5Family()
    config, state = family.import_hf(tmp_path / "hf")
    reference = family.reference_model(config)
    reference.load_state_dict(state)
    tokens = torch.randint(
        0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=tokens).logits, reference.logits(tokens), rtol=1e-4, atol=1e-4
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["qwen3_5_tiny", pytest.param("qwen3_5_cut", marks=pytest.mark.slow)]
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family qwen3_5 --preset PRESET --device cuda --dtype bf16`: the
    engine's step on the GPU (fla's gated delta rule, bf16) against the float64 reference."""
    from dataflow_training import verify

    failed = [c for c in verify("qwen3_5", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed


def test_predict_the_9b_at_16_gib_has_no_infeasible_cell() -> None:
    """The whole 9B plans into 16 GiB at seq 4096 (simulated)."""
    assert_predicts_at_16_gib("qwen3_5_9b")
