"""Round trip through transformers: a random HF GPT-2 saved with ``save_pretrained`` imports
into the reference model with the same loss and logits, and exports back to weights
transformers reloads bit for bit. Skipped without transformers (``pip install -e
'families/gpt2[test]'``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_family_gpt2.family import GPT2Family

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: the HF round trip needs it "
    "(pip install -e 'families/gpt2[test]')",
)

# HF's sdpa attention and the reference's written-out softmax differ by float32 rounding.
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory):
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=24, n_embd=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF init leaves biases at 0 and norms at 1: perturb everything
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_an_hf_checkpoint_gives_the_same_loss_and_logits(hf_model) -> None:
    model, folder = hf_model
    family = GPT2Family()
    config, state = family.import_hf(folder)
    assert (config.vocab_size, config.n_positions, config.n_layer) == (97, 24, 2)
    reference = family.reference_model(config)
    reference.load_state_dict(state)

    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_out = model(input_ids=tokens, labels=tokens)
        targets = torch.cat([tokens[:, 1:], torch.full((3, 1), -100)], dim=1)  # HF shifts
        loss = reference(tokens, targets)
        logits = reference.logits(tokens)
    torch.testing.assert_close(logits, hf_out.logits, **FLOAT32)
    torch.testing.assert_close(loss, hf_out.loss, **FLOAT32)


def test_export_reloads_in_transformers_bit_exact(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    family = GPT2Family()
    config, state = family.import_hf(folder)
    family.export_hf(config, state, tmp_path / "back")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back")
    original, again = model.state_dict(), reloaded.state_dict()
    assert set(again) == set(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name
    assert torch.equal(reloaded.lm_head.weight, reloaded.transformer.wte.weight)  # still tied


def test_a_sharded_export_reloads_in_transformers_and_imports_back(
    hf_model, tmp_path: Path
) -> None:
    model, folder = hf_model
    family = GPT2Family()
    config, state = family.import_hf(folder)
    family.export_hf(config, state, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "sharded")
    original, again = model.state_dict(), reloaded.state_dict()
    assert set(again) == set(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name
    _, back = family.import_hf(tmp_path / "sharded")
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_a_checkpoint_sharded_by_transformers_imports(hf_model, tmp_path: Path) -> None:
    model, _ = hf_model
    model.save_pretrained(tmp_path / "hf_sharded", max_shard_size="20KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
    config, state = GPT2Family().import_hf(tmp_path / "hf_sharded")
    reference = GPT2Family().reference_model(config)
    reference.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reference.logits(tokens), model(tokens).logits, **FLOAT32)
