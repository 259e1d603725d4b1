"""The whole loop on the CPU: sample with the stand-in engine, write the rollouts, read
them, update, export the weights, reload them in transformers, sample again; in under a
minute."""

from __future__ import annotations

import time

import pytest
import torch
from dataflow_rl_example import PolicyTrainer, generate_rollouts, read_rollouts, write_rollouts
from dataflow_rl_example.standin import load_model
from dataflow_training import load_family

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("family_name", "preset"), [("llama3", "llama3_tiny"), ("qwen3_moe", "qwen3_moe_tiny")]
)
def test_generate_update_export_reload_in_under_a_minute(tmp_path, family_name, preset):
    started = time.perf_counter()
    family = load_family(family_name)
    config = family.config(preset)
    torch.manual_seed(0)
    trainer = PolicyTrainer(family, config, family.reference_model(config).state_dict())
    trainer.export(tmp_path / "policy_0")
    prompts = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    rewards = []
    for update in range(3):
        model = load_model(tmp_path / f"policy_{update}")
        written = generate_rollouts(model, prompts, group_size=4, max_new_tokens=8, seed=update)
        write_rollouts(written, tmp_path / f"rollouts_{update}")
        batch = read_rollouts(tmp_path / f"rollouts_{update}")
        stats = trainer.update(batch, lr=1e-2)
        assert stats["ratio"] == pytest.approx(1.0, abs=1e-4)  # on-policy: the engine's weights
        rewards.append(float(batch.rewards.mean()))
        trainer.export(tmp_path / f"policy_{update + 1}")
    reloaded = load_model(tmp_path / "policy_3")
    hf_state = {name: t for name, t in reloaded.state_dict().items()}
    _, ours = family.import_hf(tmp_path / "policy_3")
    assert all(torch.equal(ours[k], trainer.state()[k]) for k in ours)
    assert any(
        not torch.equal(t, load_model(tmp_path / "policy_0").state_dict()[n])
        for n, t in hf_state.items()
    )
    again = generate_rollouts(reloaded, prompts, group_size=4, max_new_tokens=8, seed=9)
    assert again.tokens.shape == (8, 14)
    assert time.perf_counter() - started < 60
