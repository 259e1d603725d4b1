"""The qwen3 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on qwen3_tiny, HF round trip) and the kit's decoder-family checks
(parameter counts, docs against the code, errors, ``dataflow train`` and ``export``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_family_qwen3.config import Qwen3Config
from dataflow_family_qwen3.family import Qwen3Family
from dataflow_training.kit import CheckpointError, QKNorm
from dataflow_training.testing import DecoderFamilyChecks, TrainingFamilyConformance

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
    blocks = Qwen3Config.architecture.blocks.values()
    assert {block.attention.qk_norm for block in blocks} == {QKNorm("head")}
    released = [
        family.config(name)
        for name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "qwen3_14b")
    ]
    assert {
        (c.head_dim, c.num_key_value_heads, c.rope_theta, c.rope_scaling) for c in released
    } == {(128, 8, 1000000.0, None)}
    assert [c.tie_word_embeddings for c in released] == [True, True, True, False, False]
    block = {p.name: p.shape for p in family.layers(released[0])[1].params}
    assert block["self_attn.q_norm.weight"] == block["self_attn.k_norm.weight"] == (128,)
    assert block["self_attn.q_proj.weight"] == (2048, 1024)  # wider than the residual


def test_window_settings_of_a_checkpoint_both_ways(tmp_path) -> None:
    """Export writes Qwen's four window fields; import reads them as transformers does
    (``layer_types`` where the file has it, else sliding from ``max_window_layers`` on);
    sliding layers without a window, and layer types the family has no block for, are
    refused naming the field and the file."""
    family = Qwen3Family()
    config = family.config("qwen3_tiny_swa")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written[k] for k in WINDOW_FIELDS} == {
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    assert family.import_hf(tmp_path)[0] == config
    # a file without layer types (older transformers): sliding from max_window_layers on
    (tmp_path / "config.json").write_text(json.dumps({**written, "layer_types": None}))
    assert family.import_hf(tmp_path)[0] == config
    late = {**written, "layer_types": None, "max_window_layers": 2}  # no layer that late
    (tmp_path / "config.json").write_text(json.dumps(late))
    assert family.import_hf(tmp_path)[0] == config.with_overrides(layer_types=None)
    refused = [
        ({"use_sliding_window": False}, r"layer_types = .*: sliding_attention layers need "),
        (
            {"layer_types": ["full_attention", "linear_attention"]},
            r"layer_types = .*: \['linear_attention'\] are not implemented \(only full_",
        ),
    ]
    for change, message in refused:
        (tmp_path / "config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(CheckpointError, match=rf"config.json: {message}"):
            family.import_hf(tmp_path)


WINDOW_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


def test_window_config_rules_name_the_field() -> None:
    family = Qwen3Family()
    with pytest.raises(ValueError, match=r"layer_types has 2 entries; Qwen3Config.num_hidden"):
        family.config("qwen3_tiny_swa", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"'sliding_attention' layers but Qwen3Config.sliding_"):
        family.config("qwen3_tiny_swa", sliding_window=None)
    with pytest.raises(ValueError, match=r"sliding_window must be a positive int, got 0"):
        family.config("qwen3_tiny", sliding_window=0)
    # overrides travel as JSON: a list of layer types is a tuple in the config
    listed = family.config("qwen3_tiny", sliding_window=3, layer_types=["sliding_attention"] * 2)
    assert listed.layer_types == ("sliding_attention", "sliding_attention")
    assert [layer.kind for layer in family.layers(listed)][1:-1] == ["sliding_block"] * 2


def test_a_window_cuts_only_a_longer_sequence_and_is_priced_by_its_width() -> None:
    """The sliding block equals the full one on a sequence no longer than its window and
    differs past it; its attention FLOPs are those of the band the window keeps."""
    import torch
    from dataflow_training.kit import Env, load_ops

    family = Qwen3Family()
    config = family.config("qwen3_tiny_swa")
    state = family.reference_model(config).state_dict()
    params = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("1.")}
    env = Env(load_ops("cpu", family.ops))
    full, sliding = family.math("block"), family.math("sliding_block")
    for seq, same in ((4, True), (9, False)):
        x = torch.randn(2, seq, config.hidden_size, generator=torch.Generator().manual_seed(seq))
        outs = [math.forward(config, params, x, env)[0] for math in (full, sliding)]
        assert torch.equal(*outs) is same, seq
    batch, seq, window, q = 2, 16, 4, config.q_width
    assert full.cost(config, batch, 4, 2) == sliding.cost(config, batch, 4, 2)
    gap = (
        full.cost(config, batch, seq, 2).forward.flops
        - sliding.cost(config, batch, seq, 2).forward.flops
    )
    assert gap == 4 * batch * q * ((seq - window) ** 2 / 2)  # the causal triangle past the band


def test_verify_passes_on_the_sliding_window_preset() -> None:
    """``dataflow verify --family qwen3 --preset qwen3_tiny_swa`` on the CPU: every level
    (ops, each layer kind's tasks at 8 tokens, whole steps at 16) runs sequences longer
    than the 4-token window, and passes."""
    from dataflow_training import verify

    checks = verify("qwen3", "qwen3_tiny_swa", device="cpu")
    assert {c.level for c in checks} == {"op", "task", "step"}
    assert any("sliding_block" in c.name for c in checks if c.level == "task")
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_a_sliding_window_checkpoint_trains_from_init_and_exports(tmp_path) -> None:
    """``dataflow train --init`` of a random ``Qwen3ForCausalLM`` whose layers mix full and
    sliding-window attention, then ``dataflow export --hf``: transformers loads what was
    trained, with its window and layer types."""
    import torch

    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from dataflow.testing import invoke

    hf_config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    args = ["--batch", "2", "--seq-len", "24", "--device", "cpu", "--out", out]
    result = invoke("train", "--init", tmp_path / "hf", "--steps", "2", *args)
    assert result.exit_code == 0, result.output
    assert "preset qwen3_tiny" in result.output
    checkpoint = out / "step_000002"
    result = invoke("export", "--hf", tmp_path / "back", "--from", checkpoint)
    assert result.exit_code == 0, result.output
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.sliding_window == 6
    assert reloaded.config.layer_types == hf_config.layer_types
    trained = load_file(checkpoint / "model.safetensors")
    assert torch.equal(
        reloaded.model.layers[2].self_attn.q_proj.weight, trained["2.self_attn.q_proj.weight"]
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset",
    # qwen3_tiny_swa: the sliding window through flash's own window in bf16
    ["qwen3_tiny", "qwen3_tiny_swa", pytest.param("qwen3_0_6b", marks=pytest.mark.slow)],
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family qwen3 --preset PRESET --device cuda --dtype bf16`: the
    engine's step on the GPU (bf16 weights, gradients, activations) against the float64
    reference, at the bf16 tolerances of `dataflow_training.check.verify.TOLERANCES`."""
    from dataflow_training import verify

    failed = [c for c in verify("qwen3", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed
