"""A fleet reads the one-process stream: gloo fleets of real processes on loopback train
gpt2_tiny on the embedded default and log, step for step, the losses of one process that
runs the same rounds in all; the run goes on from their checkpoints at another split and
then as one process, neither repeating nor skipping data.

Tolerance: float32 on the CPU. A fleet sums its members' share-scaled gradients in an
all-reduce where one process adds its rounds up in order, so the gradients round apart in
the last bits (about 1e-7 relative) and the next steps carry that into the loss (seen:
5e-8 relative after three steps); losses agree to ``LOSS_RTOL``, far below what one round
of other data moves them (about 2e-3: 5.5320 against 5.5206 at step 1 when each member
read its own slice of the feed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dataflow.testing import invoke

pytest.importorskip("dataflow_family_gpt2")

LOSS_RTOL = 1e-5
#: gpt2_tiny on the embedded corpus (the default --data), a step of 4 rounds of 2 x 16
#: tokens; a constant schedule, so a run of N steps trains as the first N of a longer one
TRAIN = (
    "train", "--preset", "gpt2_tiny", "--device", "cpu", "--batch", "2", "--seq-len", "16",
    "--schedule", "constant", "--lr", "3e-3",
)  # fmt: skip
ROUNDS, ROUND_TOKENS = 4, 2 * 16
#: seconds a fleet may take before its members are killed
FLEET_TIMEOUT_S = 120


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def fleet(out: Path, rounds: str, *args: str) -> str:
    """``dataflow train --rounds ROUNDS`` as a gloo fleet of real processes on loopback;
    rank 0's output."""
    from dataflow_training.drive.fleet import run_on_loopback

    argv = [sys.executable, "-m", "dataflow", *TRAIN, "--out", str(out), "--rounds", rounds]
    env = dict(os.environ, DATAFLOW_FLEET_TIMEOUT_S="30")
    members = run_on_loopback([[*argv, *args]] * len(rounds.split(",")), FLEET_TIMEOUT_S, env)
    for rank, (code, text) in enumerate(members):
        assert code == 0, f"rank {rank} exited with {code}:\n{text}"
    return members[0][1]


def test_fleets_of_any_split_and_one_process_read_one_stream(tmp_path):
    """One process runs 6 steps of 4 rounds. A 3:1 fleet runs steps 1-2 into another
    folder, a 2-rank fleet resumes its checkpoint for steps 3-4, one process (taking the
    rounds from the checkpoint) resumes that for steps 5-6: every step's loss is the
    uninterrupted process's, and each checkpoint's data position is the one process's
    (steps x rounds x batch x seq_len tokens into the stream)."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    result = invoke(*TRAIN, "--out", whole, "--steps", "6", "--ga-rounds", str(ROUNDS))
    assert result.exit_code == 0, result.output
    expected = losses(whole)

    fleet(out, "3,1", "--steps", "2")
    assert losses(out) == pytest.approx(expected[:2], rel=LOSS_RTOL)
    text = fleet(out, "2,2", "--steps", "4", "--resume", "auto")
    assert f"resumed from {out / 'step_000002'} (step 2)" in text, text
    assert losses(out) == pytest.approx(expected[:4], rel=LOSS_RTOL)

    result = invoke(*TRAIN, "--out", out, "--steps", "6", "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert f"resumed from {out / 'step_000004'} (step 4)" in result.output
    assert losses(out) == pytest.approx(expected, rel=LOSS_RTOL)
    # the steps moved the loss: equal losses are not those of a model standing still
    assert abs(expected[-1] - expected[0]) > 100 * LOSS_RTOL * expected[0]

    for step in (2, 4, 6):
        manifest = json.loads((out / f"step_{step:06d}" / "manifest.json").read_text())
        assert manifest["feed"]["position"] == step * ROUNDS * ROUND_TOKENS, step
        assert manifest["feed"]["world"] == 1, step
    written = json.loads((out / "step_000004" / "manifest.json").read_text())
    assert written["fleet"] == {"rounds": [2, 2]} and written["options"]["rounds"] == ROUNDS
