"""HF checkpoint import/export without transformers: layouts, round trips, and errors that
name the tensor or field and the file at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_family_gpt2.checkpoint import (
    CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointError,
    export_hf,
    import_hf,
)
from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.reference import GPT2Reference
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_SMALL = GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=2, n_head=2)


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT2Reference(CONFIG_SMALL)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.fixture
def exported(tmp_path: Path, state) -> Path:
    folder = tmp_path / "exported"
    export_hf(CONFIG_SMALL, state, folder)
    return folder


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(file, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(folder / SAFETENSORS), metadata={"format": "pt"})


def test_export_writes_hf_names_and_conv1d_layout(exported: Path, state) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    assert "lm_head.weight" not in tensors  # tied
    assert len(tensors) == len(state)
    assert torch.equal(tensors["transformer.wte.weight"], state["emb.wte"])
    assert torch.equal(
        tensors["transformer.h.1.attn.c_attn.weight"], state["1.attn.c_attn.weight"].t()
    )
    assert tensors["transformer.h.0.mlp.c_fc.weight"].shape == (16, 64)  # (in, out)
    assert torch.equal(tensors["transformer.ln_f.bias"], state["head.ln_f.bias"])
    config = json.loads((exported / CONFIG).read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["n_head"]) == (16, 2, 2)
    assert config["resid_pdrop"] == config["attn_pdrop"] == config["embd_pdrop"] == 0.0


def test_export_then_import_is_bit_exact(exported: Path, state) -> None:
    config, imported = import_hf(exported)
    assert config == CONFIG_SMALL
    assert list(imported) == list(state)
    assert all(torch.equal(imported[key], state[key]) for key in state)
    assert all(imported[key].is_contiguous() for key in state)


def test_import_of_the_original_hub_layout(exported: Path, state) -> None:
    """No ``transformer.`` prefix, the old causal-mask buffers, an explicit lm_head."""
    tensors = {
        name.removeprefix("transformer."): t for name, t in _tensors(exported / SAFETENSORS).items()
    }
    for layer in range(CONFIG_SMALL.n_layer):
        tensors[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 8, 8).tril()
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    _rewrite(exported, tensors)
    _, imported = import_hf(exported / SAFETENSORS)  # the file itself, config.json beside it
    assert all(torch.equal(imported[key], state[key]) for key in state)


def test_import_of_a_sharded_checkpoint(exported: Path, state) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard in shards.items():
        save_file({name: tensors[name] for name in shard}, str(exported / file))
    (exported / SAFETENSORS).unlink()
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    (exported / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    _, imported = import_hf(exported)
    assert all(torch.equal(imported[key], state[key]) for key in state)


def test_a_sharded_export_imports_bit_exact(tmp_path: Path, state) -> None:
    export_hf(CONFIG_SMALL, state, tmp_path, max_shard_bytes=4096)
    index = json.loads((tmp_path / SAFETENSORS_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / SAFETENSORS).exists()
    assert "lm_head.weight" not in index["weight_map"]
    config, imported = import_hf(tmp_path)
    assert config == CONFIG_SMALL
    assert all(torch.equal(imported[key], state[key]) for key in state)


def test_import_casts_when_asked(exported: Path) -> None:
    _, imported = import_hf(exported, dtype=torch.bfloat16)
    assert {tensor.dtype for tensor in imported.values()} == {torch.bfloat16}


def test_a_missing_tensor_is_named_with_its_file(exported: Path) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    del tensors["transformer.h.1.mlp.c_proj.bias"]
    _rewrite(exported, tensors)
    with pytest.raises(CheckpointError) as failure:
        import_hf(exported)
    message = str(failure.value)
    assert "tensor 'transformer.h.1.mlp.c_proj.bias' is missing" in message
    assert str(exported / SAFETENSORS) in message and "'1.mlp.c_proj.bias'" in message


def test_a_mis_shaped_tensor_is_named_with_its_file_and_shapes(exported: Path) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    tensors["transformer.h.0.attn.c_attn.weight"] = (
        tensors["transformer.h.0.attn.c_attn.weight"].t().contiguous()
    )
    _rewrite(exported, tensors)
    with pytest.raises(CheckpointError) as failure:
        import_hf(exported)
    message = str(failure.value)
    assert message.startswith(str(exported / SAFETENSORS))
    assert "'transformer.h.0.attn.c_attn.weight' has shape (48, 16), expected (16, 48)" in message


def test_an_unexpected_tensor_is_named(exported: Path) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    tensors["transformer.h.2.ln_1.weight"] = torch.ones(16)  # a third layer: wrong n_layer
    _rewrite(exported, tensors)
    with pytest.raises(
        CheckpointError,
        match=r"exported/model.safetensors: unexpected tensor 'transformer.h.2.ln_1.weight'",
    ):
        import_hf(exported)


def test_an_untied_lm_head_is_refused(exported: Path) -> None:
    tensors = _tensors(exported / SAFETENSORS)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    _rewrite(exported, tensors)
    with pytest.raises(
        CheckpointError, match="'lm_head.weight' differs from 'transformer.wte.weight'"
    ):
        import_hf(exported)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("activation_function", "relu", "activation_function = 'relu'"),
        ("n_inner", 100, "n_inner = 100: the gpt2 family's MLP is 4 \\* n_embd = 64"),
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx = True"),
        ("tie_word_embeddings", False, "tie_word_embeddings = False"),
        ("model_type", "llama", "model_type = 'llama': not a GPT-2 checkpoint"),
        ("n_head", 3, r"n_embd \(16\) must be a multiple of GPT2Config.n_head \(3\)"),
    ],
)
def test_an_unsupported_config_names_the_field_and_file(
    exported: Path, field: str, value: object, message: str
) -> None:
    config = json.loads((exported / CONFIG).read_text())
    (exported / CONFIG).write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=message) as failure:
        import_hf(exported)
    assert str(failure.value).startswith(str(exported / CONFIG))


def test_a_folder_without_safetensors_or_config_is_named(tmp_path: Path, exported: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path}: no {CONFIG} beside the weights"):
        import_hf(tmp_path)
    (exported / SAFETENSORS).rename(exported / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match=r"no model.safetensors .*found: config.json, pytorch_model.bin"
    ):
        import_hf(exported)


def test_export_names_a_missing_extra_or_mis_shaped_tensor(tmp_path: Path, state) -> None:
    folder = tmp_path / "out"
    without = {key: value for key, value in state.items() if key != "0.ln_2.bias"}
    with pytest.raises(CheckpointError, match="state has no tensor '0.ln_2.bias'"):
        export_hf(CONFIG_SMALL, without, folder)
    with pytest.raises(CheckpointError, match=r"state has tensor 'head.lm_head' that"):
        export_hf(CONFIG_SMALL, {**state, "head.lm_head": state["emb.wte"]}, folder)
    wrong = {**state, "1.mlp.c_fc.weight": state["1.mlp.c_fc.weight"].t()}
    with pytest.raises(
        CheckpointError, match=r"'1.mlp.c_fc.weight' has shape \(16, 64\), expected \(64, 16\)"
    ):
        export_hf(CONFIG_SMALL, wrong, folder)
    assert not folder.exists()  # nothing written on error
