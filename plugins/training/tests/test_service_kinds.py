"""Trainer kinds a plugin registers (``dataflow_trainer_kinds``), served by ``ServedRun``
in process with a toy kind: the server's checkpoints hold the trainer's tensors and give
them back, a checkpoint of other ``load`` fields or another kind is refused, a resume
carries on, a bad batch or field is one line and changes nothing. (The RL example's
``rl`` kind, through a real server: examples/rl_training/tests/test_served.py.)"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from dataflow_training.service.protocol import ProtocolError
from dataflow_training.service.served_run import ServedRun

from dataflow import TrainerKindSpec, hookimpl


class Counter:
    """A toy trainer: ``w += lr * x`` for the number ``x`` a batch file holds; its
    "optimizer" keeps the sum of the numbers."""

    family = config = None

    def __init__(self, size: int) -> None:
        self.updates, self.w, self.m = 0, torch.zeros(size), torch.zeros(size)

    def describe(self) -> dict:
        return {"size": len(self.w)}

    def step(self, path: Path, lr: float = 1.0) -> dict:
        try:
            x = float(path.read_text())
        except ValueError:
            raise ValueError(f"args.batch.path: {path} holds no number") from None
        self.w += lr * x
        self.m += x
        self.updates += 1
        return {"loss": float(self.w.sum())}

    def state(self) -> dict:
        return {"w": self.w.clone()}

    def optimizer_state(self) -> dict:
        return {"m": self.m.clone(), "updates": torch.tensor(self.updates)}

    def load_state(self, weights, optimizer_state) -> None:
        if weights["w"].shape != self.w.shape:
            raise ValueError("checkpoint: w has another shape")
        self.w, self.m = weights["w"].clone(), optimizer_state["m"].clone()
        self.updates = int(optimizer_state["updates"])

    def close(self) -> None:
        pass


def _open(options: dict, *, device: str) -> Counter:
    size = options.get("size", 3)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"args.size: a whole number >= 1, not {size!r}")
    return Counter(size)


class Kinds:
    @hookimpl
    def dataflow_trainer_kinds(self):
        return [TrainerKindSpec("counter", "a toy kind", _open, ("size",), ("lr",))]


@pytest.fixture
def kinds(isolated_plugin_manager):
    isolated_plugin_manager(Kinds())


def _served(out: Path) -> ServedRun:
    out.mkdir(exist_ok=True)
    return ServedRun(out, log=io.StringIO())


def _batch(tmp_path: Path, name: str, text: str) -> dict:
    (tmp_path / name).write_text(text)
    return {"path": str(tmp_path / name)}


def test_a_kind_steps_saves_restores_and_resumes(kinds, tmp_path):
    served = _served(tmp_path / "run")
    with pytest.raises(ProtocolError, match=r"args\.kind: 'nope' is not one of tokens, counter"):
        served.load({"kind": "nope"})
    with pytest.raises(ProtocolError, match=r"args\.batch: load \(kind counter\) takes no such"):
        served.load({"kind": "counter", "batch": 4})
    loaded = served.load({"kind": "counter", "size": 3})
    assert (loaded["kind"], loaded["step"], loaded["size"]) == ("counter", 0, 3)
    two, three = _batch(tmp_path, "two", "2"), _batch(tmp_path, "three", "3")
    assert served.step({"batch": two, "lr": 0.5}) == {"step": 1, "loss": 3.0}
    served.step({"batch": three, "lr": 1.0})
    checkpoint = Path(served.save({})["checkpoint"])
    assert checkpoint.name == "step_000002"
    assert served.save({})["checkpoint"] == str(checkpoint)  # the one written there already

    for batch, named in [
        (_batch(tmp_path, "bad", "x"), r"args\.batch\.path: .*bad holds no number"),
        ({"path": str(tmp_path / "absent")}, r"args\.batch\.path: .*absent does not exist"),
        ({"path": str(tmp_path), "rows": 1}, r"args\.batch\.rows: a counter batch takes no"),
        ({"kind": "tokens", "path": str(tmp_path / "two")}, r"args\.batch\.kind: 'tokens'"),
    ]:
        with pytest.raises(ProtocolError, match=named):
            served.step({"batch": batch})
    with pytest.raises(ProtocolError, match=r"args\.kl_coef: step takes no such field"):
        served.step({"batch": two, "kl_coef": 1.0})
    assert served.status({})["step"] == 2

    served.step({"batch": three, "lr": 2.0})
    assert torch.equal(served.kind_run.trainer.w, torch.full((3,), 10.0))
    assert served.restore({"checkpoint": "auto"})["step"] == 2
    assert torch.equal(served.kind_run.trainer.w, torch.full((3,), 4.0))
    assert torch.equal(served.kind_run.trainer.m, torch.full((3,), 5.0))
    window = served.profile_start({"folder": str(tmp_path / "profile")})
    assert window["from_step"] == 3
    served.step({"batch": two, "lr": 1.0})
    traced = served.profile_stop({})
    assert traced["steps"] == [3] and Path(traced["trace"]).is_file()
    status = served.status({})
    assert (status["kind"], status["step"], status["last_loss"]) == ("counter", 3, 18.0)
    assert status["checkpoints"] == ["step_000002"]
    served.close(save=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]

    again = _served(tmp_path / "run")
    with pytest.raises(ProtocolError, match=r"args\.resume: .* holds checkpoints"):
        again.load({"kind": "counter", "size": 3})
    assert again.load({"kind": "counter", "size": 3, "resume": "auto"})["step"] == 2
    assert torch.equal(again.kind_run.trainer.w, torch.full((3,), 4.0))
    again.close(save=False)

    other = _served(tmp_path / "other")
    other.load({"kind": "counter", "size": 4})
    with pytest.raises(ProtocolError, match=r"was loaded with size=3, this run with size=4"):
        other.restore({"checkpoint": str(checkpoint)})
    assert other.status({})["step"] == 0
    other.close(save=False)


def test_a_kind_is_not_restored_from_a_token_checkpoint(kinds, tmp_path):
    served = _served(tmp_path / "run")
    served.load({"kind": "counter"})
    served.step({"batch": _batch(tmp_path, "one", "1")})
    path = Path(served.save({})["checkpoint"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "counter"
    assert manifest["service"]["load"] == {"kind": "counter"}
    manifest.pop("kind")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProtocolError, match=r"is of kind 'tokens', not 'counter'"):
        served.restore({"checkpoint": str(path)})
    served.close(save=False)


def test_a_kinds_open_error_leaves_nothing_loaded(kinds, tmp_path):
    served = _served(tmp_path / "run")
    with pytest.raises(ValueError, match=r"args\.size: a whole number >= 1, not 0"):
        served.load({"kind": "counter", "size": 0})
    assert served.status({})["loaded"] is False
    assert served.load({"kind": "counter", "size": 2})["size"] == 2
    with pytest.raises(ProtocolError, match=r"load: a run is loaded already \(counter, step 0\)"):
        served.load({"kind": "counter"})
    served.close(save=False)
