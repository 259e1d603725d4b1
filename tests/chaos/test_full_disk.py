"""A full file system, for real: a run writing its checkpoints onto a 4 MiB tmpfs runs
out of space in the middle of one (``drive.checkpoint.write_checkpoint``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dataflow.testing import assert_one_line_error, invoke

from ._runs import CONSTANT, checkpoints, intact, losses, straight_prefix, train_args

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

pytestmark = pytest.mark.chaos


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (two of gpt2_tiny's 1.5 MB checkpoints fit, a third does not), where
    the machine lets this process mount one (root, as on CI); else the test skips: a
    fault-injection hook would test a simulated failure, not the file system's."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(small_disk):
    """A checkpoint write that runs out of space: one line naming the checkpoint and the
    cause, exit 1, nothing of that write left behind, the earlier checkpoints intact; once
    there is space again the run resumes from the newest and trains as one that never
    ran out does."""
    out = small_disk / "run"
    result = invoke(*train_args(out, 5, *CONSTANT, "--checkpoint-every", "1"))
    line = assert_one_line_error(result, 1, f"cannot write checkpoint {out / 'step_000003'}")
    assert "no space left on the device (ENOSPC)" in line
    assert "the earlier checkpoints are intact" in line
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl",
        "step_000001",
        "step_000002",
    ]  # no .tmp-* folder, no lock file
    assert all(intact(out / name) for name in checkpoints(out))
    kept = checkpoints(out)["step_000002"]
    shutil.rmtree(out / "step_000001")  # space again
    resumed = invoke(*train_args(out, 3, *CONSTANT, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "step_000002 (step 2)" in resumed.output
    assert losses(out) == straight_prefix(3)
    assert checkpoints(out)["step_000002"] == kept
