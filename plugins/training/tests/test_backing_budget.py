"""``--backing-budget``: one backing (pinned host) budget per fleet member, or one for all
(or for one process); a wrong count names the option; each member's value reaches its
``TrainingRun``, whose plan and engine keep to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch

pytest.importorskip("dataflow_family_gpt2")

sys.path.insert(0, str(Path(__file__).parent))
from fleet_worker import BATCH, PRESET, SEQ_LEN, global_batches, train_config  # noqa: E402
from test_fleet_cli import TRAIN, topology  # noqa: E402

GiB = 2**30


def test_each_member_takes_its_own_backing_budget(monkeypatch):
    from dataflow_training.cli import train_cli
    from dataflow_training.cli.train_cli import _join
    from dataflow_training.drive import fleet as fleet_module

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(
        train_cli, "join", lambda rounds, *a, **k: fleet_module.Fleet(1, 2, tuple(rounds), 0.25)
    )
    rest = {"rounds": 1, "batch": BATCH, "seq_len": SEQ_LEN}
    fleet, rounds, fast, backing = _join("3,1", "4GiB,2GiB", "60GiB,30GiB", None, "cpu", rest)
    assert (fleet.rank, rounds, fast, backing) == (1, 1, 2 * GiB, 30 * GiB)
    # one value stands for every member; none leaves the backing unbounded
    assert _join("3,1", None, "8GiB", None, "cpu", rest)[3] == 8 * GiB
    assert _join("3,1", None, None, None, "cpu", rest)[3] is None
    with pytest.raises(click.BadParameter, match=r"'60GiB,30GiB,9GiB' gives 3 values") as bad:
        _join("3,1", None, "60GiB,30GiB,9GiB", None, "cpu", rest)
    assert bad.value.param_hint == "--backing-budget"
    with pytest.raises(click.BadParameter, match="'lots' is not a size") as bad:
        _join("3,1", None, "lots,30GiB", None, "cpu", rest)
    assert bad.value.param_hint == "--backing-budget"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dataflow", "train", *TRAIN, "--steps", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_wrong_count_names_the_option(tmp_path):
    # one process takes one value
    done = run_cli("--out", str(tmp_path / "one"), "--backing-budget", "60GiB,30GiB")
    assert done.returncode == 2
    assert "--backing-budget" in done.stderr and "gives 2 values" in done.stderr
    # the conductor checks the count against the group before it starts anyone
    topo = topology(tmp_path)
    done = run_cli(
        "--out",
        str(tmp_path / "fleet"),
        "--topology",
        str(topo),
        "--group",
        "dp",
        "--backing-budget",
        "1GiB,2GiB,3GiB",
    )
    assert done.returncode == 2
    assert "--backing-budget" in done.stderr and "(group dp)" in done.stderr
    assert not (tmp_path / "fleet").exists()


def test_the_run_plans_and_runs_inside_its_backing_budget():
    from dataflow_training.drive.run import TrainingRun

    from dataflow import Location, PlanningError

    train = train_config(1, None)
    backing = 16 * 2**20
    run = TrainingRun.of(
        "gpt2", PRESET, train, seed=0, budget_bytes=2 * 2**20, backing_bytes=backing,
        recompute=False,
    )  # fmt: skip
    assert run.compiled.plan.slow_budget_bytes == backing
    stats = run.step(global_batches(0, 1))
    assert torch.isfinite(torch.tensor(stats.loss))
    assert run._engine.slow_budget_bytes == backing  # the engine checks it too
    assert run.last_result.steps[-1].slow_peak_bytes <= backing
    run.close()
    # gpt2_tiny's weights and optimizer state take about 1.4 MiB: a 1 MiB backing cannot
    # hold them all, but the 2 MiB fast budget homes them fast between steps
    run = TrainingRun.of(
        "gpt2", PRESET, train, seed=0, budget_bytes=2 * 2**20, backing_bytes=2**20,
        recompute=False,
    )  # fmt: skip
    homes = [run.compiled.program.obj(o).location for o in run.compiled.program.persistent]
    assert Location.FAST in homes
    run.step(global_batches(0, 1))
    assert run.last_result.steps[-1].slow_peak_bytes <= 2**20
    run.close()
    # what starts or ends slow and is not persistent (the step's tokens) must fit it
    with pytest.raises(PlanningError, match="more than the slow budget"):
        TrainingRun.of(
            "gpt2", PRESET, train, seed=0, budget_bytes=2 * 2**20, backing_bytes=64,
            recompute=False,
        )  # fmt: skip
