"""The llama3 family: the training plugin's conformance (protocol, lowering, planning,
``dataflow verify`` on llama3_tiny, HF round trip) and the kit's decoder-family checks
(parameter counts, docs against the code, errors, ``dataflow train`` and ``export``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dataflow_family_llama3.config import Llama3Config
from dataflow_family_llama3.family import Llama3Family
from dataflow_training.kit import Block, Decoder
from dataflow_training.testing import DecoderFamilyChecks, TrainingFamilyConformance

DOCS = Path(__file__).resolve().parents[3] / "docs"


class TestLlama3(TrainingFamilyConformance, DecoderFamilyChecks):
    distribution = "dataflow-family-llama3"
    expected_names = ("llama3",)
    family_name = "llama3"
    preset = "llama3_tiny"
    docs = DOCS
    #: Meta's published sizes (HF model cards; tied output projection counted once)
    published_counts = {
        "l3_1b": 1_235_814_400,
        "l3_3b": 3_212_749_824,
        "llama3_8b": 8_030_261_248,
    }


def test_presets_are_llama3_configs_without_qk_norm() -> None:
    family = Llama3Family()
    assert all(type(config) is Llama3Config for config in family.presets.values())
    # Llama's parts, the kit's default: no q/k norm, no window, the dense SwiGLU
    assert Llama3Config.architecture == Decoder({"block": Block()})
    assert Block().attention.qk_norm is None and Block().attention.window is None
    released = [family.config(name) for name in ("l3_1b", "l3_3b", "llama3_8b")]
    assert [c.rope_scaling.factor for c in released] == [32.0, 32.0, 8.0]
    assert [c.tie_word_embeddings for c in released] == [True, True, False]
    assert {(c.num_key_value_heads, c.vocab_size, c.rope_theta) for c in released} == {
        (8, 128256, 500000.0)
    }


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama3_tiny", pytest.param("l3_1b", marks=pytest.mark.slow)])
def test_verify_passes_in_bf16_on_cuda(preset: str) -> None:
    """`dataflow verify --family llama3 --preset PRESET --device cuda --dtype bf16`: the
    engine's step on the GPU (bf16 weights, gradients, activations) against the float64
    reference, at the bf16 tolerances of `dataflow_training.check.verify.TOLERANCES`."""
    from dataflow_training import verify

    failed = [c for c in verify("llama3", preset, device="cuda", policy="bf16") if not c.ok]
    assert not failed, failed
