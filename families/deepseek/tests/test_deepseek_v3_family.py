"""The deepseek_v3 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on deepseek_v3_tiny, HF round trip), the kit's decoder checks
(parameter counts against the reference and transformers, docs against the code, errors,
``dataflow train`` and ``export``), and DeepSeek V3's own: the dense-then-MoE stack, the
per-layer Aux read by the optimizer task that moves the selection bias, what MLA saves,
the task check's autograd run routed with forward's choices, a 20-step run whose loss
falls and whose export transformers loads, and ``dataflow predict`` of the 671B at 16
GiB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_family_deepseek.family import DeepseekV3Family
from dataflow_family_deepseek.testing import hf_parameter_count
from dataflow_training.kit import parameter_count
from dataflow_training.testing import (
    DecoderFamilyChecks,
    TrainingFamilyConformance,
    assert_predicts_at_16_gib,
    assert_tasks_route_as_forward,
)

from dataflow.testing import invoke

DOCS = Path(__file__).resolve().parents[3] / "docs"


class TestDeepseekV3(TrainingFamilyConformance, DecoderFamilyChecks):
    distribution = "dataflow-family-deepseek"
    expected_names = ("deepseek_v3", "deepseek_v32")
    family_name = "deepseek_v3"
    preset = "deepseek_v3_tiny"
    docs = DOCS
    block_tensor = "0.mlp.up_proj.weight"

    def test_config_errors_name_the_field(self, family):
        """MLA has as many key/value heads as query heads: the kit's GQA check still runs."""
        with pytest.raises(KeyError, match=r"unknown deepseek_v3 preset 'nope'; known"):
            family.config("nope")
        with pytest.raises(TypeError, match=r"no field\(s\) 'n_embd'; known fields: vocab_size"):
            family.config(self.preset, n_embd=8)
        with pytest.raises(ValueError, match=r"num_hidden_layers must be a positive int, got 0"):
            family.config(self.preset, num_hidden_layers=0)
        with pytest.raises(ValueError, match=r"n_group \(3\) must divide .*num_experts \(8\)"):
            family.config(self.preset, n_group=3)
        with pytest.raises(ValueError, match=r"qk_rope_head_dim \(7\) must be even"):
            family.config(self.preset, qk_rope_head_dim=7)

    def test_checkpoint_errors_name_the_field_or_tensor_and_the_file(self, family, tmp_path):
        from dataflow_training.kit import CheckpointError

        config = family.config(self.preset)
        state = family.reference_model(config).state_dict()
        family.export_hf(config, state, tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        for field, value, why in [
            ("attention_bias", True, "no biases"),
            ("hidden_act", "gelu", "silu"),
            ("model_type", "gpt2", "not a"),
            ("scoring_func", "softmax", "only sigmoid"),
            ("topk_method", "greedy", "only 'noaux_tc'"),
        ]:
            (tmp_path / "config.json").write_text(json.dumps({**written, field: value}))
            with pytest.raises(CheckpointError, match=rf"config.json: {field} = .*{why}"):
                family.import_hf(tmp_path)


@pytest.mark.parametrize("preset", ["deepseek_v3", "deepseek_v3_tiny", "moonlight_16b_a3b"])
def test_parameter_counts_equal_transformers(preset) -> None:
    """Each preset's count is ``DeepseekV3ForCausalLM``'s of its exported config.json."""
    transformers = pytest.importorskip("transformers")
    import torch

    family = DeepseekV3Family()
    config = family.config(preset)
    hf = transformers.DeepseekV3Config(**family.config_to_hf(config, torch.bfloat16))
    assert parameter_count(config) == hf_parameter_count(transformers.DeepseekV3ForCausalLM, hf)


def test_the_671b_is_transformers_default_config() -> None:
    """Field for field ``DeepseekV3Config()`` but the published rope scaling and context."""
    transformers = pytest.importorskip("transformers")
    family = DeepseekV3Family()
    hf = transformers.DeepseekV3Config().to_dict()
    config = family.config_from_hf(hf, "defaults")
    assert config == family.config("deepseek_v3", rope_yarn=None, max_position_embeddings=4096)


def test_dense_then_moe_and_the_bias_rule_reads_the_layers_aux() -> None:
    """The first ``first_k_dense_replace`` layers are dense; each MoE layer has its own
    Aux, zeroed by round 0's forward, added to by every round's, read by the optimizer
    task of the group holding the selection bias (no gradient, no optimizer state)."""
    from dataflow_training import TrainConfig, lower

    family = DeepseekV3Family()
    config = family.config("deepseek_v3_tiny")
    blocks = family.layers(config)[1:-1]
    assert [b.kind for b in blocks] == ["dense", "moe", "moe"]
    assert [b.aux_object for b in blocks[1:]] == ["Aux_1", "Aux_2"] and not blocks[0].aux
    program = lower(family, "deepseek_v3_tiny", TrainConfig(seq_len=8, batch=1, rounds=2)).program
    assert [o.id for o in program.objects if o.role == "aux"] == ["Aux_1", "Aux_2"]
    for layer in ("1", "2"):
        readers = {t.id for t in program.tasks if f"Aux_{layer}" in t.inputs}
        assert f"opt_0_1_{layer}" in readers
        assert (
            f"Aux_{layer}" in next(t for t in program.tasks if t.id == f"fwd_0_0_{layer}").mutates
        )
    objects = {o.id: o for o in program.objects}
    bias = "mlp.gate.e_score_correction_bias"
    layout = lower(family, "deepseek_v3_tiny", TrainConfig(seq_len=8, batch=1)).layout
    assert bias in {e.name for e in layout.packed["W_1"].layout.entries}
    assert bias not in {e.name for e in layout.packed["dW_1"].layout.entries}
    assert "W_1.experts" in objects


def test_verify_tasks_in_bf16_give_autograd_forward_routing() -> None:
    """The sigmoid router's task checks in bf16 with 256 experts: autograd's run of the
    block takes forward's expert choices (weights still its scores at them), so near ties
    in the biased group top-k do not send a token to another expert; routing afresh, the
    MoE gradients missed by 5 to 13 % in three of the four seeds."""
    family = DeepseekV3Family()
    assert_tasks_route_as_forward(family, family.config("deepseek_v3_tiny"), "moe backward")


def test_mla_saves_the_latents() -> None:
    family = DeepseekV3Family()
    config = family.config("deepseek_v3")
    saved = {s.name: s.shape for s in family.math("moe").saved(config, 1, 4096)}
    assert saved["q_a"] == (1, 4096, 1536) and saved["kv_a"] == (1, 4096, 512 + 64)
    assert saved["attn"] == (1, 4096, 128 * 128)


def test_twenty_steps_lower_the_loss_and_transformers_loads_the_export(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    args = ["--batch", "4", "--seq-len", "32", "--device", "cpu", "--out", out, "--lr", "3e-3"]
    result = invoke("train", "--preset", "deepseek_v3_tiny", "--steps", "20", *args)
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    result = invoke("export", "--hf", tmp_path / "hf", "--from", out / "step_000020")
    assert result.exit_code == 0, result.output
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 3


@pytest.mark.slow
def test_predict_the_671b_at_16_gib_has_no_infeasible_cell() -> None:
    """Each MoE layer's 256 experts run in 16 shards of 1.4 GB (``kit.moe.expert_shards``),
    so no task holds more than one shard's weights, gradient and moments."""
    assert_predicts_at_16_gib("deepseek_v3")
