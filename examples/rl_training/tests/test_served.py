"""The ``rl`` trainer kind served by ``dataflow serve-trainer`` (a real server process):
two updates through a client equal the example's own ``PolicyTrainer`` doing the same two,
bit for bit; save, a third update, restore (or a new server's resume) and the third again
give the same weights; the export reloads in transformers; bad input is one line and the
server serves on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dataflow_rl_example import PolicyTrainer, generate_rollouts, read_rollouts, write_rollouts
from dataflow_rl_example.standin import load_model
from dataflow_training import ServiceError, load_family
from dataflow_training.testing import ServerProcess, short_folder
from safetensors.torch import load_file

pytest.importorskip("transformers")

LR = (1e-2, 5e-3, 1e-2)


@pytest.fixture
def home():
    with short_folder("dfrl-") as path:
        yield path


def _same(served: Path, direct: Path) -> None:
    """Two exported folders reload in transformers to the same weights, bit for bit."""
    ours, theirs = load_model(served).state_dict(), load_model(direct).state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_served_rl_updates_are_the_policy_trainers(home):
    family = load_family("llama3")
    config = family.config("llama3_tiny")
    torch.manual_seed(0)
    family.export_hf(config, family.reference_model(config).state_dict(), home / "policy_0")
    prompts = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def rollouts(policy: Path, seed: int) -> Path:
        written = generate_rollouts(
            load_model(policy), prompts, group_size=4, max_new_tokens=8, seed=seed
        )
        write_rollouts(written, home / f"rollouts_{seed}")
        return home / f"rollouts_{seed}"

    server = ServerProcess(home / "run")
    try:
        with server.client(timeout=300) as trainer:
            with pytest.raises(ServiceError) as unknown:
                trainer.load(kind="nope", init=str(home / "policy_0"))
            assert "\n" not in str(unknown.value)
            assert "'nope' is not one of tokens, rl" in str(unknown.value)
            with pytest.raises(ServiceError, match=r"args\.lossy: load \(kind rl\) takes no"):
                trainer.load(kind="rl", init=str(home / "policy_0"), lossy=1)
            with pytest.raises(ServiceError, match=r"args\.dtype: 'float16' is not one of"):
                trainer.load(kind="rl", preset="llama3_tiny", dtype="float16")
            with pytest.raises(ServiceError, match=r"args\.rounds: a whole number >= 1, not 0"):
                trainer.load(kind="rl", preset="llama3_tiny", rounds=0)
            with pytest.raises(ServiceError, match=r"^load: args\.family: missing"):
                trainer.load(kind="rl", init=str(home / "policy_0"))

            loaded = trainer.load(
                kind="rl", family="llama3", init=str(home / "policy_0"), budget="4MiB"
            )
            assert (loaded["kind"], loaded["step"], loaded["family"]) == ("rl", 0, "llama3")
            batches = [rollouts(home / "policy_0", 0)]
            first = trainer.step(batches[0], lr=LR[0])
            assert first["step"] == 1 and first["ratio"] == pytest.approx(1.0, abs=1e-4)
            exported = trainer.export_weights(home / "policy_1")
            assert exported["step"] == 1
            # the engine samples the next rollouts with the weights just exported: on-policy
            batches.append(rollouts(home / "policy_1", 1))
            second = trainer.step(batches[1], lr=LR[1])
            assert second["ratio"] == pytest.approx(1.0, abs=1e-4)
            saved = trainer.save()
            assert saved["step"] == 2 and Path(saved["checkpoint"]).name == "step_000002"

            # bad input: one line naming the field or the file, and nothing changes
            (home / "broken").mkdir()
            (home / "broken" / "rollouts.json").write_text("{not json")
            for path, named in [
                (home / "broken", "args.batch.path: "),
                (home / "absent", "args.batch.path: "),
            ]:
                with pytest.raises(ServiceError) as bad:
                    trainer.step(path, lr=LR[2])
                assert str(bad.value).startswith("step: " + named), str(bad.value)
                assert "\n" not in str(bad.value) and str(path) in str(bad.value)
            with pytest.raises(ServiceError, match=r"args\.kl_coef: .*load with kl: true"):
                trainer.step(batches[1], lr=LR[2], kl_coef=0.1)
            with pytest.raises(ServiceError, match=r"args\.lr: "):
                trainer.step(batches[1], lr=-1.0)
            assert trainer.status()["step"] == 2

            batches.append(rollouts(home / "policy_1", 2))  # off-policy now: ratio != 1
            trainer.step(batches[2], lr=LR[2])
            trainer.export_weights(home / "policy_3a")
            restored = trainer.restore(saved["checkpoint"])
            assert restored["step"] == 2
            trainer.export_weights(home / "policy_2")
            again = trainer.step(batches[2], lr=LR[2])
            assert again["step"] == 3
            trainer.export_weights(home / "policy_3b", changed_only=True)
            status = trainer.status()
            assert (status["kind"], status["step"]) == ("rl", 3)
            assert status["checkpoints"] == ["step_000002"]
            trainer.shutdown()
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()

    # a new server on the run folder resumes from its checkpoint and goes on alike
    server = ServerProcess(home / "run")
    try:
        with server.client(timeout=300) as trainer:
            with pytest.raises(ServiceError, match=r"args\.resume: .* holds checkpoints"):
                trainer.load(kind="rl", family="llama3", init=str(home / "policy_0"))
            resumed = trainer.load(
                kind="rl",
                family="llama3",
                init=str(home / "policy_0"),
                budget="4MiB",
                resume="auto",
            )
            assert resumed["step"] == 2 and resumed["resumed"].endswith("step_000002")
            trainer.step(batches[2], lr=LR[2])
            trainer.export_weights(home / "policy_3c")
            trainer.shutdown()
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()
    _same(home / "policy_3c", home / "policy_3a")

    direct = PolicyTrainer(
        family, config, family.import_hf(home / "policy_0")[1], budget_bytes=4 << 20
    )
    for batch, lr, folder in zip(batches, LR, ("policy_1", "policy_2", "policy_3a"), strict=True):
        direct.update(read_rollouts(batch), lr=lr)
        _same(home / folder, direct.export(home / f"direct_{folder}"))
    before, after = load_model(home / "policy_0").state_dict(), load_model(home / "policy_1")
    assert not all(torch.equal(t, after.state_dict()[n]) for n, t in before.items())
    # the restored run's third update wrote, changed_only, the tensors that differ from
    # the export after the restore: those of the first third update, bit for bit
    whole = load_file(home / "policy_3a" / "model.safetensors")
    changed = load_file(home / "policy_3b" / "model.safetensors")
    assert changed and set(changed) <= set(whole)
    for name, t in changed.items():
        assert torch.equal(t, whole[name]), name


def test_loaded_rounds_reach_the_update(tmp_path):
    """``load``'s ``rounds`` is the update's: its steps equal the one-round update's, and
    rollouts whose rows it does not divide are refused naming ``args.rounds``."""
    from dataflow_rl_example.served import open_policy

    policies = {
        rounds: open_policy({"preset": "llama3_tiny", "rounds": rounds}, device="cpu")
        for rounds in (1, 4)
    }
    assert policies[4].describe()["rounds"] == 4
    family = load_family("llama3")
    family.export_hf(family.config("llama3_tiny"), policies[1].state(), tmp_path / "policy")
    prompts = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    written = generate_rollouts(
        load_model(tmp_path / "policy"), prompts, group_size=4, max_new_tokens=8, seed=0
    )
    write_rollouts(written, tmp_path / "rollouts")
    stats = {r: policy.step(tmp_path / "rollouts", lr=1e-3) for r, policy in policies.items()}
    assert stats[4] == pytest.approx(stats[1], abs=1e-6)
    ours, one = policies[4].state(), policies[1].state()
    assert max((ours[k] - one[k]).abs().max().item() for k in one) < 2e-5
    six = generate_rollouts(
        load_model(tmp_path / "policy"), prompts, group_size=3, max_new_tokens=8, seed=0
    )
    write_rollouts(six, tmp_path / "six")
    with pytest.raises(ValueError, match=r"^args\.rounds: 4 \(loaded\) does not divide the 6"):
        policies[4].step(tmp_path / "six")
    for policy in policies.values():
        policy.close()
