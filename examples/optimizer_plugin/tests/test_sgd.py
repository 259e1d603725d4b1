"""The ``sgd`` optimizer: registered through its entry point, equal to ``torch.optim.SGD``
over 5 steps, and trained through ``dataflow train --optimizer sgd``."""

from __future__ import annotations

import json

import pytest
import torch
from dataflow_optimizer_sgd.plugin import SGD

from dataflow import optimizers


def test_the_entry_point_registers_sgd() -> None:
    assert optimizers().distribution_of("sgd") == "dataflow-optimizer-sgd"


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_equals_torch_sgd_over_five_steps(nesterov: bool) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(4, 3), torch.randn(5)]
    reference = [w.clone().double().requires_grad_() for w in weights]
    optimizer = torch.optim.SGD(reference, lr=0.1, momentum=0.8, nesterov=nesterov)
    momenta = [torch.zeros_like(w) for w in weights]
    args = {**SGD.defaults(), **SGD.parse_args(["momentum=0.8", f"nesterov={nesterov}"])}
    for step in range(1, 6):
        grads = [torch.randn_like(w) for w in weights]
        for r, g in zip(reference, grads, strict=True):
            r.grad = g.double()
        optimizer.step()
        SGD.update(
            {}, weights, grads, {"momentum": momenta}, step=step,
            policy={"lr": 0.1, "weight_decay": 0.0, **args}, weight_decay=0.0,
        )  # fmt: skip
    for w, r in zip(weights, reference, strict=True):
        torch.testing.assert_close(w.double(), r.detach(), rtol=1e-5, atol=1e-6)


def test_dataflow_train_runs_sgd(tmp_path) -> None:
    pytest.importorskip("dataflow_family_gpt2")
    from dataflow.testing import invoke

    out = tmp_path / "run"
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--steps", "3", "--batch", "2", "--seq-len", "16",
        "--device", "cpu", "--out", str(out), "--optimizer", "sgd", "--lr", "0.05",
        "--optimizer-arg", "momentum=0.5",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]
    manifest = json.loads(next(out.glob("step_*/manifest.json")).read_text())
    assert manifest["train"]["optimizer"]["name"] == "sgd"
    assert manifest["train"]["optimizer"]["args"] == {"momentum": 0.5}
