"""The qwen3_5_moe family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on qwen3_5_moe_tiny, HF round trip), the kit's MoE-family checks
(parameter counts, the experts' group, the routing as AuxTemp, one Aux pooled over the
layers and rounds, docs against the code, errors, ``dataflow train`` and ``export``), and
Qwen 3.5 MoE's own: the 35B-A3B against transformers, both block kinds pooling one Aux, a
20-step run whose loss falls and whose export transformers loads, and what ``dataflow
predict`` says for the full model at 16 GiB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_family_qwen3_5_moe.config import Qwen3_5MoeConfig
from dataflow_family_qwen3_5_moe.family import Qwen3_5MoeFamily
from dataflow_training.kit import (
    CheckpointError,
    hybrid_layer_types,
    moe_active_parameter_count,
    moe_parameter_count,
)
from dataflow_training.testing import (
    MoEFamilyChecks,
    TrainingFamilyConformance,
    assert_predicts_at_16_gib,
)

DOCS = Path(__file__).resolve().parents[3] / "docs"
HOST_BYTES_PER_PARAMETER = 2 + 2 + 8  # bf16 weight and gradient, two float32 moments


class TestQwen3_5Moe(TrainingFamilyConformance, MoEFamilyChecks):
    distribution = "dataflow-family-qwen3-5-moe"
    expected_names = ("qwen3_5_moe",)
    family_name = "qwen3_5_moe"
    preset = "qwen3_5_moe_tiny"
    moe_kind = "linear_moe"
    docs = DOCS
    #: ``Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig())`` of transformers 5.25, counted on
    #: the meta device (test_the_35b_is_transformers_default_config counts it again)
    published_counts = {"qwen3_5_35b_a3b": 34_660_610_688}


def test_the_35b_is_transformers_default_config() -> None:
    """Field for field ``Qwen3_5MoeTextConfig()``, and the same parameter count."""
    transformers = pytest.importorskip("transformers")
    import torch

    family = Qwen3_5MoeFamily()
    hf = transformers.Qwen3_5MoeTextConfig()
    config = family.config_from_hf(hf.to_dict(), "defaults")
    assert config == family.config("qwen3_5_35b_a3b")
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForCausalLM(hf)
    assert moe_parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_both_block_kinds_route_and_pool_one_aux() -> None:
    """Every layer has the routed and the shared experts; the linear- and full-attention
    blocks add their loads to one ``Aux_moe`` (transformers pools every layer's), zeroed by
    the step's first forward and read by every last-round backward."""
    from dataflow_training import TrainConfig, lower

    family = Qwen3_5MoeFamily()
    config = family.config("qwen3_5_moe_tiny")
    blocks = family.layers(config)[1:-1]
    assert [b.kind for b in blocks] == ["linear_moe"] * 3 + ["full_moe"]
    assert {b.aux_object for b in blocks} == {"Aux_moe"}
    for block in blocks:
        main, experts = block.groups
        names = {p.name for p in main.params}
        assert {"mlp.gate.weight", "mlp.shared_expert_gate.weight"} <= names
        assert "mlp.shared_expert.down_proj.weight" in names
        assert {p.name for p in experts.params} == {
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        }
    program = lower(family, "qwen3_5_moe_tiny", TrainConfig(seq_len=8, batch=1, rounds=2)).program
    assert [o.id for o in program.objects if o.role == "aux"] == ["Aux_moe"]
    readers = {t.id for t in program.tasks if "Aux_moe" in t.inputs}
    assert readers == {f"bwd_0_1_{i}" for i in range(4)}
    assert {t.id for t in program.tasks if t.params.get("zero_aux")} == {"fwd_0_0_0"}
    saved = {s.name: s.shape for s in family.math("full_moe").saved(config, 1, 8)}
    assert saved["gate_up"] == (16, 64) and saved["shared_gate"] == (8, 48)


def test_the_released_shape_its_cut_and_the_router_setting() -> None:
    family = Qwen3_5MoeFamily()
    full, cut = family.config("qwen3_5_35b_a3b"), family.config("qwen3_5_moe_cut")
    assert type(full) is Qwen3_5MoeConfig
    assert full.layer_types == hybrid_layer_types(40)
    assert cut == full.with_overrides(num_hidden_layers=4)
    assert cut.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert moe_active_parameter_count(full) == 3_454_988_928  # "A3B"
    host = moe_parameter_count(cut) * HOST_BYTES_PER_PARAMETER
    assert 40 * 2**30 < host < 56 * 2**30  # the cut trains from the 128 GiB host
    assert moe_parameter_count(full) * HOST_BYTES_PER_PARAMETER > 128 * 2**30
    with pytest.raises(ValueError, match=r"norm_topk_prob must be True"):
        family.config("qwen3_5_moe_tiny", norm_topk_prob=False)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size must be a positive"):
        family.config("qwen3_5_moe_tiny", shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be at most"):
        family.config("qwen3_5_moe_tiny", num_experts_per_tok=9)


def test_dense_layers_and_unnormalised_weights_are_refused(tmp_path) -> None:
    family = Qwen3_5MoeFamily()
    config = family.config("qwen3_5_moe_tiny")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "norm_topk_prob" not in written
    rope = {**written["rope_parameters"], "partial_rotary_factor": 0.5}
    refused = [
        ({"mlp_only_layers": [0]}, r"mlp_only_layers = \[0\]: dense layers are not"),
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2: dense layers are not"),
        ({"norm_topk_prob": False}, r"norm_topk_prob = False: top-k weights not renormalised"),
        ({"rope_parameters": rope}, r"partial_rotary_factor = 0.5: Qwen 3.5 rotates a quarter"),
        ({"layer_types": ["sliding_attention"] * 4}, r"layer_types = .*: expected a list of"),
    ]
    for change, message in refused:
        (tmp_path / "config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(CheckpointError, match=rf"config.json: {message}"):
            family.import_hf(tmp_path)


def test_twenty_steps_on_the_cpu_lower_the_loss_and_export_loads_in_transformers(tmp_path):
    """``dataflow train --preset qwen3_5_moe_tiny --steps 20 --device cpu``, then
    ``dataflow export --hf``: the loss falls, and ``Qwen3_5MoeForCausalLM`` loads the
    trained weights and gives the reference's logits."""
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from dataflow.testing import invoke

    out = tmp_path / "run"
    args = ["--batch", "4", "--seq-len", "32", "--device", "cpu", "--out", out]
    result = invoke("train", "--preset", "qwen3_5_moe_tiny", "--steps", "20", *args)
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    # from ln(256) = 5.55 to about 5.27 (the last three steps' mean) on the default schedule
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    result = invoke("export", "--hf", tmp_path / "hf", "--from", out / "step_000020")
    assert result.exit_code == 0, result.output
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf")
    trained = load_file(out / "step_000020" / "model.safetensors")
    layer = model.model.layers[3].mlp
    assert torch.equal(layer.experts.down_proj, trained["3.mlp.experts.down_proj"])
    assert torch.equal(layer.shared_expert_gate.weight, trained["3.mlp.shared_expert_gate.weight"])
    family = Qwen3_5MoeFamily()
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


def test_a_run_starts_from_a_folder_transformers_saved(tmp_path):
    """``dataflow train --init FOLDER`` from a ``Qwen3_5MoeForCausalLM`` that
    ``save_pretrained`` wrote (its experts per expert), one step at learning rate 0, then
    ``dataflow export --hf``: transformers reads back every tensor it saved, bit for bit."""
    transformers = pytest.importorskip("transformers")
    import torch

    from dataflow.testing import invoke

    family = Qwen3_5MoeFamily()
    config = family.config("qwen3_5_moe_tiny")
    torch.manual_seed(4)
    reference = family.reference_model(config)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    family.export_hf(config, reference.state_dict(), tmp_path / "exported")
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "exported")
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    args = ["--steps", "1", "--lr", "0", "--batch", "2", "--seq-len", "16", "--device", "cpu"]
    result = invoke(
        "train", "--preset", "qwen3_5_moe_tiny", "--init", tmp_path / "hf", *args, "--out", out
    )
    assert result.exit_code == 0, result.output
    assert f"init: weights from {tmp_path / 'hf'} (preset qwen3_5_moe_tiny)" in result.output
    result = invoke("export", "--hf", tmp_path / "back", "--from", out / "step_000001")
    assert result.exit_code == 0, result.output
    again = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    original = model.state_dict()
    assert set(again) == set(original)
    assert all(torch.equal(again[name], tensor) for name, tensor in original.items())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["qwen3_5_moe_tiny", pytest.param("qwen3_5_moe_cut", marks=pytest.mark.slow)]
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family qwen3_5_moe --preset PRESET --device cuda --dtype bf16`."""
    from dataflow_training import verify

    failed = [c for c in verify("qwen3_5_moe", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed


def test_predict_the_35b_a3b_at_16_gib_has_no_infeasible_cell() -> None:
    """The whole 35B-A3B plans into 16 GiB at seq 4096 (simulated: its pool of
    host memory, some 248 GiB with bf16 moments, is more than this host's 128 GiB)."""
    assert_predicts_at_16_gib("qwen3_5_35b_a3b")
