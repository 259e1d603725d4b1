"""The olmoe family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on olmoe_tiny, HF round trip) and the kit's MoE-family checks
(parameter counts, docs against the code, errors, experts as their own group, router
state shapes, ``dataflow train`` and ``export``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_family_olmoe.config import OlmoeConfig
from dataflow_family_olmoe.family import OlmoeFamily
from dataflow_training.kit import CheckpointError
from dataflow_training.testing import MoEFamilyChecks, TrainingFamilyConformance

DOCS = Path(__file__).resolve().parents[3] / "docs"


class TestOlmoe(TrainingFamilyConformance, MoEFamilyChecks):
    distribution = "dataflow-family-olmoe"
    expected_names = ("olmoe",)
    family_name = "olmoe"
    preset = "olmoe_tiny"
    docs = DOCS
    #: OLMoE-1B-7B's 6.9B total parameters, counted from its published config.json
    published_counts = {"olmoe_1b_7b": 6_919_161_856}


def test_the_released_preset_is_olmoe_1b_7b() -> None:
    config = OlmoeFamily().config("olmoe_1b_7b")
    assert type(config) is OlmoeConfig
    assert OlmoeConfig.architecture.blocks["moe"].attention.qk_norm.scope == "projection"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (64, 8, False)
    assert (config.head_dim, config.num_key_value_heads, config.intermediate_size) == (
        128,
        16,
        1024,
    )
    block = {p.name: p.shape for p in OlmoeFamily().layers(config)[1].params}
    # q/k norms over the whole projection, not per head
    assert block["self_attn.q_norm.weight"] == block["self_attn.k_norm.weight"] == (2048,)


def test_top_k_weights_are_not_renormalised() -> None:
    """OLMoE's routing weights are the softmax probabilities of the chosen experts: they sum
    to less than one (the kit's forward writes them to AuxTemp as they are)."""
    from dataflow_training.kit import Env, load_ops

    family = OlmoeFamily()
    config = family.config("olmoe_tiny")
    state = family.reference_model(config).state_dict()
    params = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("0.")}
    params["mlp.gate.weight"] = 0.1 * torch.randn_like(params["mlp.gate.weight"])
    x = torch.randn(2, 5, config.hidden_size)
    env = Env(load_ops("cpu", family.ops))
    _, _, temp = family.math("moe").forward(config, params, x, env)
    sums = temp["weights"].sum(-1)
    assert (sums < 0.9).all()  # 2 of 8 experts, router near uniform
    normalised = family.config("olmoe_tiny", norm_topk_prob=True)
    _, _, temp = family.math("moe").forward(normalised, params, x, env)
    torch.testing.assert_close(temp["weights"].sum(-1), torch.ones(10), rtol=1e-6, atol=1e-6)


def test_a_clip_qkv_checkpoint_is_refused(tmp_path) -> None:
    family = OlmoeFamily()
    config = family.config("olmoe_tiny")
    family.export_hf(config, family.reference_model(config).state_dict(), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "clip_qkv": 8.0}))
    with pytest.raises(CheckpointError, match=r"config.json: clip_qkv = 8.0: clipping q, k"):
        family.import_hf(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["olmoe_tiny", pytest.param("olmoe_1b_7b", marks=pytest.mark.slow)]
)
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family olmoe --preset PRESET --device cuda --dtype bf16`: the
    engine's step on the GPU (bf16, torch._grouped_mm experts) against the float64
    reference, at the bf16 tolerances of `dataflow_training.check.verify.TOLERANCES`."""
    from dataflow_training import verify

    failed = [c for c in verify("olmoe", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed
