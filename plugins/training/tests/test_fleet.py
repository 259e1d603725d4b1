"""The data-parallel fleet on gloo over loopback: members with equal and with weighted
(3:1) shares of the rounds match one process that ran all the rounds, step for step."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("dataflow_family_gpt2")

WORKER = Path(__file__).with_name("fleet_worker.py")
#: fp32 on CPU: a fleet sums shares of the gradient where one process accumulates the
#: rounds in order, so the gradients round differently (about 1e-7 relative). Losses and
#: norms are compared at 1e-5 relative. AdamW's first steps move a weight by about
#: lr * g / (|g| + eps), which for a gradient near eps (1e-8) turns that rounding into a
#: visible part of the step: weights are compared at 1e-5 relative and 1e-5 absolute
#: (1 % of one lr=1e-3 step; seen: 3e-6 on 1 of 12288 entries of the 3:1 fleet)
WEIGHT_RTOL, WEIGHT_ATOL, LOSS_RTOL = 1e-5, 1e-5, 1e-5
#: seconds a test fleet may take before it is killed
FLEET_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fleet(
    tmp_path: Path, rounds: list[int], steps: int, clip: str, device: str = "cpu"
) -> list[list]:
    from dataflow_training.drive.fleet import run_on_loopback

    args = [str(tmp_path), ",".join(map(str, rounds)), str(steps), clip, device]
    env = dict(os.environ, DATAFLOW_FLEET_TIMEOUT_S="30")
    argv = [sys.executable, str(WORKER), *args]
    for code, text in run_on_loopback([argv] * len(rounds), FLEET_TIMEOUT_S, env):
        assert code == 0, text
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(rounds))]


def single_process(rounds: int, steps: int, clip: float | None, device: str = "cpu") -> list:
    sys.path.insert(0, str(WORKER.parent))
    import fleet_worker as w
    from dataflow_training.drive.run import TrainingRun

    run = TrainingRun.of("gpt2", w.PRESET, w.train_config(rounds, clip), seed=0, device=device)
    record = []
    for step in range(steps):
        stats = run.step(w.global_batches(step, rounds), lr=1e-3)
        record.append((stats.loss, stats.grad_norm, run.state()[0]))
    run.close()
    return record


@pytest.mark.parametrize(
    ("rounds", "clip"), [([2, 2], "none"), ([3, 1], "0.5")], ids=["2-rank", "weighted-3:1"]
)
def test_fleet_matches_one_process_step_for_step(tmp_path, rounds, clip):
    """Three steps of a fleet against one process running all sum(rounds) rounds of the
    same global batch: the fleet's mean loss, its (global) gradient norm and every
    member's weights after every step agree within the stated tolerances; with the
    weighted fleet the clip (0.5) binds, so the norm is the fleet's, after the sum."""
    steps = 3
    fleet = run_fleet(tmp_path, rounds, steps, clip)
    reference = single_process(sum(rounds), steps, None if clip == "none" else float(clip))
    for rank in range(len(rounds)):  # the all-reduces kept the collective link's order
        assert json.loads((tmp_path / f"rank{rank}_order.json").read_text()) == []
    for step, (loss, norm, weights) in enumerate(reference):
        for rank, record in enumerate(fleet):
            f_loss, f_norm, f_weights = record[step]
            where = f"step {step} rank {rank}"
            assert f_loss == pytest.approx(loss, rel=LOSS_RTOL), where
            assert f_norm == pytest.approx(norm, rel=LOSS_RTOL), where
            for name, value in weights.items():
                torch.testing.assert_close(
                    f_weights[name], value, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=where
                )
    # the steps moved the weights: the comparison is not of copies that stand still
    first, last = reference[0][2], reference[-1][2]
    assert any(not torch.allclose(first[k], last[k], rtol=1e-3) for k in first)


@pytest.mark.gpu
def test_one_member_nccl_fleet_matches_one_process_on_cuda(tmp_path):
    """NCCL on one GPU, world size 1: the all-reduce path runs on CUDA (dispatched, not
    graph-replayed) and the member's steps equal a plain run's (share 1, the sum of one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fleet = run_fleet(tmp_path, [2], 2, "1.0", device="cuda")[0]
    # the all-reduces ran on the collective stream in the execution model's order
    assert json.loads((tmp_path / "rank0_order.json").read_text()) == []
    reference = single_process(2, 2, 1.0, device="cuda")
    for (loss, norm, weights), (f_loss, f_norm, f_weights) in zip(reference, fleet, strict=True):
        assert f_loss == pytest.approx(loss, rel=LOSS_RTOL)
        assert f_norm == pytest.approx(norm, rel=LOSS_RTOL)
        for name, value in weights.items():
            torch.testing.assert_close(f_weights[name], value, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
