"""The family object, its presets and layers, and the plugin's registration."""

from __future__ import annotations

from math import prod
from pathlib import Path

import pytest
from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.family import GPT2Family
from dataflow_family_gpt2.layers import parameter_count
from dataflow_family_gpt2.presets import PRESETS, UnknownPresetError, preset, preset_table
from dataflow_training.kit import BlockMath, EmbedMath, Family, HeadMath
from dataflow_training.testing import TrainingFamilyConformance

DOCS = Path(__file__).resolve().parents[3] / "docs" / "builtin_models.md"


class TestGPT2Conformance(TrainingFamilyConformance):
    """The plugin checks, plus: protocol, lowering validates/simulates/plans into the
    smallest budget, `dataflow verify` on gpt2_tiny, and the HF export round trip."""

    distribution = "dataflow-family-gpt2"
    expected_names = ("gpt2",)
    family_name = "gpt2"
    preset = "gpt2_tiny"


def test_the_family_satisfies_the_protocol() -> None:
    family = GPT2Family()
    assert isinstance(family, Family)
    assert isinstance(family.math("embed"), EmbedMath)
    assert isinstance(family.math("block"), BlockMath)
    assert isinstance(family.math("head"), HeadMath)
    layers = family.layers(family.config("gpt2_tiny"))
    assert layers[-1].tied == {"wte": "emb.wte"} and family.name == "gpt2"
    assert hasattr(family, "import_hf") and hasattr(family, "export_hf")


def test_loaded_through_the_registry() -> None:
    from dataflow import get_plugin_manager

    manager = get_plugin_manager(autoload=False, allow=["dataflow-family-gpt2"])
    family = manager.registry("families").get("gpt2").load()
    assert isinstance(family, GPT2Family)


# -- presets ------------------------------------------------------------------------------

#: Parameter counts of the released GPT-2 sizes, the tied output projection counted once.
RELEASED_COUNTS = {
    "gpt2_124m": 124_439_808,
    "gpt2_350m": 354_823_168,
    "gpt2_774m": 774_030_080,
    "gpt2_1558m": 1_557_611_200,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count(name: str) -> None:
    config = preset(name)
    n, layers = config.n_embd, config.n_layer
    per_block = 4 * n + (3 * n * n + 3 * n) + (n * n + n) + (4 * n * n + 4 * n) + (4 * n * n + n)
    formula = (config.vocab_size + config.n_positions) * n + layers * per_block + 2 * n
    assert parameter_count(config) == formula
    if name in RELEASED_COUNTS:
        assert parameter_count(config) == RELEASED_COUNTS[name]


def test_tiny_preset_count_equals_the_reference_module() -> None:
    family = GPT2Family()
    config = family.config("gpt2_tiny")
    model = family.reference_model(config)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(config) == 124_672


def test_layers_are_embed_blocks_head_and_match_the_reference_state() -> None:
    family = GPT2Family()
    config = family.config("gpt2_tiny", n_layer=3)
    layers = family.layers(config)
    assert [(layer.name, layer.kind) for layer in layers] == [
        ("emb", "embed"),
        ("0", "block"),
        ("1", "block"),
        ("2", "block"),
        ("head", "head"),
    ]
    declared = {f"{layer.name}.{p.name}": p.shape for layer in layers for p in layer.params}
    state = family.reference_model(config).state_dict()
    assert {key: tuple(value.shape) for key, value in state.items()} == declared
    assert declared["0.attn.c_attn.weight"] == (3 * 64, 64)
    assert declared["0.mlp.c_fc.weight"] == (256, 64)
    no_decay = {f"{layer.name}.{p.name}" for layer in layers for p in layer.params if not p.decay}
    assert no_decay == {key for key in declared if key.endswith("bias") or ".ln_" in key}
    assert all(p.dtype == "policy" for layer in layers for p in layer.params)


def test_hidden_shape() -> None:
    family = GPT2Family()
    assert family.hidden_shape(family.config("gpt2_124m"), 4, 1024) == (4, 1024, 768)


def test_config_overrides_and_their_errors() -> None:
    family = GPT2Family()
    assert family.config("gpt2_tiny", n_layer=5).n_layer == 5
    with pytest.raises(UnknownPresetError, match=r"unknown gpt2 preset 'gpt2_7b'; known presets: "):
        family.config("gpt2_7b")
    with pytest.raises(UnknownPresetError, match="gpt2_tiny, gpt2_124m, gpt2_350m"):
        family.config("gpt2-124m")
    with pytest.raises(TypeError, match=r"no field\(s\) 'n_ctx'; known fields: vocab_size, "):
        family.config("gpt2_tiny", n_ctx=64)
    with pytest.raises(ValueError, match=r"n_embd \(64\) must be a multiple of .*n_head \(5\)"):
        family.config("gpt2_tiny", n_head=5)
    with pytest.raises(ValueError, match="GPT2Config.n_layer must be a positive int, got 0"):
        family.config("gpt2_tiny", n_layer=0)


def test_config_derived_sizes() -> None:
    config = GPT2Config(vocab_size=10, n_positions=8, n_embd=48, n_layer=1, n_head=6)
    assert (config.head_dim, config.n_inner) == (8, 192)


def test_preset_table_is_the_one_in_the_docs() -> None:
    table = preset_table()
    assert "| `gpt2_124m` | 12 | 768 | 12 | 50,257 | 1,024 | 124,439,808 |" in table
    if not DOCS.exists():
        pytest.skip(f"{DOCS} is not here (package installed outside the monorepo)")
    assert table in DOCS.read_text(), (
        f"{DOCS} is out of date: paste `python -m dataflow_family_gpt2.presets`"
    )


def test_a_block_preset_sizes_its_saved_activations() -> None:
    """The saved-activation formula of model.py: 9 * n_embd bf16 values and n_head float32
    logsumexps per token, 13,872 bytes per token for gpt2_124m."""
    config = preset("gpt2_124m")
    specs = GPT2Family().math("block").saved(config, 8, 1024)
    size = {"policy": 2, "float32": 4}
    assert sum(prod(spec.shape) * size[spec.dtype] for spec in specs) == 8 * 1024 * 13_872
