"""The deepseek_v32 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on deepseek_v32_tiny, HF round trip), the kit's decoder checks, and
DeepSeek V3.2's own: the selection is each layer's AuxTemp, the sparse path at more
tokens than the indexer keeps agrees with the plain reference over a whole step (the
indexer's KL loss included), the dense warm-up trains the indexers alone, and a 20-step
run whose loss falls and whose export transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_family_deepseek.family_v32 import DeepseekV32Family
from dataflow_family_deepseek.testing import hf_parameter_count
from dataflow_training.kit import parameter_count
from dataflow_training.testing import DecoderFamilyChecks, TrainingFamilyConformance

from dataflow.testing import invoke

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
GRADS = {"rtol": 1e-4, "atol": 1e-6}
DOCS = Path(__file__).resolve().parents[3] / "docs"
#: every parameter but the indexers' (the dense warm-up's freeze patterns)
WARMUP_FREEZE = ("embed", "head", "*.mlp.*", "*_layernorm.*", "*.self_attn.[!i]*")


class TestDeepseekV32(TrainingFamilyConformance, DecoderFamilyChecks):
    distribution = "dataflow-family-deepseek"
    expected_names = ("deepseek_v3", "deepseek_v32")
    family_name = "deepseek_v32"
    preset = "deepseek_v32_tiny"
    docs = DOCS
    block_tensor = "0.mlp.up_proj.weight"

    def test_config_errors_name_the_field(self, family):
        with pytest.raises(KeyError, match=r"unknown deepseek_v32 preset 'nope'; known"):
            family.config("nope")
        with pytest.raises(ValueError, match=r"q_lora_rank is None: the indexer reads"):
            family.config(self.preset, q_lora_rank=None)
        with pytest.raises(ValueError, match=r"index_head_dim \(4\) must be at least"):
            family.config(self.preset, index_head_dim=4)
        with pytest.raises(ValueError, match=r"index_topk must be a positive int, got 0"):
            family.config(self.preset, index_topk=0)

    def test_checkpoint_errors_name_the_field_or_tensor_and_the_file(self, family, tmp_path):
        from dataflow_training.kit import CheckpointError

        config = family.config(self.preset)
        family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        for field, value, why in [
            ("attention_bias", True, "no biases"),
            ("model_type", "deepseek_v3", "not a"),
            ("scoring_func", "softmax", "only sigmoid"),
            ("mlp_layer_types", ["sparse", "dense", "sparse"], "dense layers then MoE"),
            ("q_lora_rank", None, "the indexer reads"),
        ]:
            (tmp_path / "config.json").write_text(json.dumps({**written, field: value}))
            with pytest.raises(CheckpointError, match=rf"config.json: {field} = .*{why}"):
                family.import_hf(tmp_path)


@pytest.mark.parametrize("preset", ["deepseek_v32", "deepseek_v32_tiny"])
def test_parameter_counts_equal_transformers(preset) -> None:
    """Each preset's count is ``DeepseekV32ForCausalLM``'s (meta device) of its exported
    config.json, plus its selection biases (buffers there)."""
    transformers = pytest.importorskip("transformers")
    family = DeepseekV32Family()
    config = family.config(preset)
    hf = transformers.DeepseekV32Config(**family.config_to_hf(config, torch.bfloat16))
    assert parameter_count(config) == hf_parameter_count(transformers.DeepseekV32ForCausalLM, hf)


def test_the_671b_is_transformers_default_config() -> None:
    transformers = pytest.importorskip("transformers")
    family = DeepseekV32Family()
    config = family.config_from_hf(transformers.DeepseekV32Config().to_dict(), "defaults")
    assert config == family.config("deepseek_v32", rope_yarn=None)


def test_the_selection_is_each_layers_aux_temp_and_the_indexer_float32() -> None:
    from dataflow_training import TrainConfig, lower

    family = DeepseekV32Family()
    config = family.config("deepseek_v32")
    temp = {s.name: (s.shape, s.dtype) for s in family.math("moe").aux_temp(config, 1, 65536)}
    assert temp["index"] == ((1, 65536, 2048), "int32")  # 512 MiB
    lowered = lower(family, "deepseek_v32_tiny", TrainConfig(seq_len=40, batch=2))
    objects = {o.id: o for o in lowered.program.objects}
    assert objects["AuxTemp_0_0_0"].size_bytes == 2 * 40 * 16 * 4  # the dense layer's
    readers = [t.id for t in lowered.program.tasks if "AuxTemp_0_0_0" in t.inputs]
    assert readers == ["bwd_0_0_0"]
    entries = {e.name: e for e in lowered.layout.packed["W_1"].layout.entries}
    assert entries["self_attn.indexer.weights_proj.weight"].dtype == "float32"


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_a_step_past_index_topk_agrees_with_the_reference(dense) -> None:
    """40 tokens, the indexer keeping 16 (or, dense, all): the step's loss and every
    gradient (the indexers' from their KL loss) against autograd of the reference's
    objective, float32 (the kit's HF parity tolerances)."""
    from dataflow_training import OptimizerPolicy, TrainConfig, TrainingRun

    family = DeepseekV32Family()
    overrides = {"index_dense": dense, "bias_update_speed": 0.0}
    config = family.config("deepseek_v32_tiny", **overrides)
    torch.manual_seed(0)
    reference = family.reference_model(config)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    tokens = torch.randint(
        0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    targets = torch.roll(tokens, -1, 1)
    losses, terms = reference([(tokens, targets)])
    (losses[0] + terms).backward()
    assert terms > 0
    train = TrainConfig(seq_len=40, batch=2, optimizer=OptimizerPolicy(lr=0.0))
    run = TrainingRun.of(
        family, "deepseek_v32_tiny", train, overrides=overrides, state=state, keep_grads=True
    )
    with run:
        stats = run.step([(tokens, targets)])
        grads = run.grads()
    torch.testing.assert_close(torch.tensor(stats.losses[0]), losses[0].detach(), **FLOAT32)
    for name, param in reference.named_parameters():
        if param.requires_grad:
            assert param.grad.abs().max() > 0, name
            torch.testing.assert_close(grads[name], param.grad, **GRADS, msg=name)


def test_the_dense_warmup_trains_the_indexers_alone(tmp_path) -> None:
    """``index_dense``, the selection biases' rule off and every parameter but the
    indexers frozen: after 3 steps only the indexers moved."""
    from dataflow_training import OptimizerPolicy, TrainConfig, TrainingRun

    family = DeepseekV32Family()
    overrides = {"index_dense": True, "bias_update_speed": 0.0}
    train = TrainConfig(
        seq_len=32, batch=2, freeze=WARMUP_FREEZE, optimizer=OptimizerPolicy(lr=1e-2)
    )
    run = TrainingRun.of(family, "deepseek_v32_tiny", train, overrides=overrides, seed=0)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, 33), generator=generator)
    with run:
        before = {k: v.clone() for k, v in run.state()[0].items()}
        for _ in range(3):
            run.step([(tokens[:, :-1], tokens[:, 1:])])
        after = run.state()[0]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".self_attn.indexer." in k for k in moved)
    assert len(moved) == 5 * 3


def test_the_warmup_recipe_then_sparse_training_is_one_run(tmp_path) -> None:
    """``--phase 0:@indexer-warmup --phase 2:``: in the first 2 steps only the indexers move
    (from step 1's checkpoint to step 2's), then
    everything trains sparse; the checkpoint records the recipe, and a resume at the
    boundary goes on as the run never stopped."""
    from safetensors.torch import load_file

    def weights(folder):
        return load_file(folder / "model.safetensors")  # the checkpoint's model state

    def train(out, steps, *extra):
        args = ["--batch", "2", "--seq-len", "32", "--device", "cpu", "--lr", "1e-2"]
        return invoke(
            "train", "--preset", "deepseek_v32_tiny", "--steps", str(steps), *args,
            "--ga-rounds", "1", "--schedule", "constant", "--checkpoint-every", "1",
            "--out", out, *extra,
        )  # fmt: skip

    phases = ("--phase", "0:@indexer-warmup", "--phase", "2:")
    out = tmp_path / "run"
    result = train(out, 4, *phases)
    assert result.exit_code == 0, result.output
    assert "phase 1 of 2, from step 1: indexer-warmup: frozen embed" in result.output
    assert "index_dense = True" in result.output and "phase 2 of 2" in result.output
    first, warm = weights(out / "step_000001"), weights(out / "step_000002")
    moved = {k for k, v in first.items() if not torch.equal(v, warm[k])}
    assert moved and all(".self_attn.indexer." in k for k in moved), sorted(moved)
    end = weights(out / "step_000004")
    assert any(".mlp." in k and not torch.equal(warm[k], end[k]) for k in end)
    resumed = tmp_path / "resumed"
    assert train(resumed, 2, *phases).exit_code == 0
    assert train(resumed, 4, *phases, "--resume", "auto").exit_code == 0
    again = weights(resumed / "step_000004")
    assert all(torch.equal(again[k], end[k]) for k in end)
    bad = train(tmp_path / "bad", 2, "--phase", "0:@warmup")
    assert bad.exit_code != 0 and "its recipes: @indexer-warmup" in bad.output


def test_twenty_steps_lower_the_loss_and_transformers_loads_the_export(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    args = ["--batch", "4", "--seq-len", "32", "--device", "cpu", "--out", out, "--lr", "3e-3"]
    result = invoke("train", "--preset", "deepseek_v32_tiny", "--steps", "20", *args)
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    result = invoke("export", "--hf", tmp_path / "hf", "--from", out / "step_000020")
    assert result.exit_code == 0, result.output
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.index_topk == 16
