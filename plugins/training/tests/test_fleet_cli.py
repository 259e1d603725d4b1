"""``dataflow train --topology``: the conductor starts a local fleet (and one member
through a fake ``ssh``), a killed member stops the fleet with one line, ``--resume auto``
continues from the last checkpoint; the topology file, the member commands and the
version check on their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dataflow_training.drive.conductor import Topology, member_command, member_env
from dataflow_training.drive.fleet import FleetError, check_versions

pytest.importorskip("dataflow_family_gpt2")

sys.path.insert(0, str(Path(__file__).parent))
from test_fleet import FLEET_TIMEOUT_S, free_port  # noqa: E402

TRAIN = ["--preset", "gpt2_tiny", "--device", "cpu", "--batch", "2", "--seq-len", "16"]
#: a schedule that does not depend on --steps, so a resumed run with fewer steps than the
#: killed one follows the same learning rates
CONSTANT = ["--schedule", "constant"]


def topology(tmp_path: Path, b_extra: str = "", a_extra: str = "") -> Path:
    port = free_port()
    path = tmp_path / "topology.toml"
    path.write_text(
        f'conductor = "a"\n[hosts.a]\nlisten = "127.0.0.1:{port}"\n{a_extra}'
        f'[hosts.b]\nlisten = "127.0.0.1:{port}"\n{b_extra}'
        '[groups.dp]\nmembers = ["a", "b"]\nbackend = "gloo"\n'
    )
    return path


def conductor(topo: Path, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dataflow", "train", *TRAIN, "--out", str(out)]
    cmd += ["--topology", str(topo), "--group", "dp", "--fleet-timeout", "20", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        text = proc.communicate(timeout=FLEET_TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, text


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_killed_member_stops_the_fleet_and_resume_continues(tmp_path):
    """A 3:1 fleet checkpoints every 2 steps; once step 2's checkpoint is complete one
    member is killed: the conductor fails within the timeout with one line naming it
    and the checkpoint; ``--resume auto`` continues from that checkpoint to the end, with
    the losses of a fleet that was never killed (1e-6 relative: CPU steps are
    deterministic, a resumed run reloads the same bytes)."""
    topo, out = topology(tmp_path), tmp_path / "run"
    fleet = ["--rounds", "3,1", *CONSTANT]
    proc = conductor(topo, out, "--steps", "400", "--checkpoint-every", "2", *fleet)
    deadline = time.monotonic() + FLEET_TIMEOUT_S
    while not (out / "step_000002" / "manifest.json").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    members = children(proc.pid)
    assert len(members) == 2
    os.kill(members[1], signal.SIGKILL)
    code, text = finished(proc)
    assert code == 1, text
    last = text.strip().splitlines()[-1]
    assert "member b (rank 1) exited with code -9" in last, text
    kept = sorted(p.name for p in out.glob("step_*"))[-1]
    assert f"last complete checkpoint: {out / kept}" in last
    done = int(kept.removeprefix("step_"))
    assert done < 400, "the member was killed after the run had ended"

    steps = done + 2
    code, text = finished(conductor(topo, out, "--steps", str(steps), "--resume", "auto", *fleet))
    assert code == 0, text
    assert f"resumed from {out / kept} (step {done})" in text
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    assert (out / f"step_{steps:06d}").is_dir()

    whole = tmp_path / "whole"
    code, text = finished(conductor(topology(tmp_path), whole, "--steps", str(steps), *fleet))
    assert code == 0, text
    expected = [json.loads(x)["loss"] for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == pytest.approx(expected, rel=1e-6)


def test_a_member_started_through_ssh(tmp_path):
    """Host b has an ``ssh`` alias: the conductor starts it as ``ssh ALIAS 'cd REPO &&
    env ... python -m dataflow train ...'``; a fake ``ssh`` on PATH logs its argv and
    runs the command here, and the fleet trains to the end. Both hosts set their own
    ``fast`` size and the command gives no ``--fast-budget``: every member gets them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ssh.log"
    fake = bin_dir / "ssh"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec sh -c "$2"\n')
    fake.chmod(0o755)
    repo = Path.cwd()
    b_extra = f'ssh = "boxB"\npython = "{sys.executable}"\nrepo = "{repo}"\nfast = "3MiB"\n'
    topo = topology(tmp_path, b_extra, a_extra='fast = "4MiB"\n')
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    try:
        code, text = finished(conductor(topo, tmp_path / "run", "--steps", "2"))
    finally:
        os.environ["PATH"] = os.environ["PATH"].split(os.pathsep, 1)[1]
    assert code == 0, text
    sent = log.read_text()
    assert sent.startswith(f"boxB cd {repo} && env RANK=1 ")
    assert "DATAFLOW_FLEET_HOST=b" in sent and "-m dataflow train" in sent
    assert "--topology" not in sent and "--steps 2" in sent
    assert "--fast-budget 4MiB,3MiB" in sent
    assert "fleet done: 2 member(s)" in text


def test_the_shipped_example_topology_loads():
    example = Path(__file__).resolve().parents[3] / "topology.example.toml"
    topo = Topology.load(example)
    a, b = topo.members("dp")
    assert (a.ssh, b.ssh, b.listen, topo.conductor) == (None, "boxB", "10.0.0.2:29500", "boxA")


def test_topology_errors_name_the_field(tmp_path):
    path = tmp_path / "t.toml"
    cases = {
        'conductor = "z"\n[hosts.a]\nlisten = "1.2.3.4:5"\n': "conductor",
        'conductor = "a"\n[hosts.a]\nlisten = "1.2.3.4"\n': "hosts.a.listen",
        'conductor = "a"\n[hosts.a]\nlisten = "h:1"\nsh = "x"\n': "hosts.a has unknown",
        'conductor = "a"\n[hosts.a]\nlisten = "h:1"\n[groups.g]\nmembers = ["q"]\n': (
            "groups.g.members names 'q'"
        ),
        'conductor = "a"\n[hosts.a]\nlisten = "h:1"\n[groups.g]\nmembers = ["a"]\n'
        'backend = "mpi"\n': "groups.g.backend",
        'conductor = "a"\n[hosts.a]\nlisten = "h:1"\nfast = "lots"\n': "hosts.a.fast is not a size",
    }
    for text, field in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=field):
            Topology.load(path)


def test_host_sizes_are_the_members_default_budgets(tmp_path):
    both = Topology.load(topology(tmp_path, 'fast = "3MiB"\nbacking = "1GiB"\n', 'fast = "4MiB"\n'))
    assert both.default_sizes("dp", "fast") == "4MiB,3MiB"
    with pytest.raises(ValueError, match=r"hosts \['a'\] of group 'dp' set no 'backing' size"):
        both.default_sizes("dp", "backing")
    assert Topology.load(topology(tmp_path)).default_sizes("dp", "fast") is None


def test_member_env_binds_a_local_fleet_to_loopback(tmp_path):
    topo = Topology.load(topology(tmp_path))
    env = member_env(topo, "dp", 1, 30)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("1", "2", "127.0.0.1")
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["LOCAL_RANK"] == "1"
    host = topo.hosts["a"]
    assert member_command(host, env, ["--steps", "2"])[1:5] == [
        "-m",
        "dataflow",
        "train",
        "--steps",
    ]


def test_version_skew_names_the_host():
    base = {"host": "a", "commit": "c1", "versions": {"torch": "2.5", "dataflow": "0.1"}}
    check_versions([base, dict(base, host="b")])  # the same: no error
    with pytest.raises(FleetError, match=r"host b \(rank 1\) runs commit c2; a \(rank 0\)"):
        check_versions([base, dict(base, host="b", commit="c2")])
    skewed = dict(base, host="c", versions={"torch": "2.4", "dataflow": "0.1"})
    with pytest.raises(FleetError, match=r"host c \(rank 2\) has torch 2.4; a \(rank 0\) has 2.5"):
        check_versions([base, base, skewed])


def test_torchrun_starts_a_fleet_on_one_host(tmp_path):
    """``torchrun --standalone --nproc-per-node 2 -m dataflow train`` with ``--rounds
    3,1``: both members join, rank 0 alone writes the metrics and the checkpoint, whose
    data position is the one-process stream's."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this python")
    out = tmp_path / "run"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "dataflow", "train"]
    cmd += [*TRAIN, "--out", str(out), "--steps", "2", "--rounds", "3,1"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=FLEET_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("done: step 2") == 1, done.stdout
    manifest = json.loads((out / "step_000002" / "manifest.json").read_text())
    assert manifest["fleet"] == {"rounds": [3, 1]}
    # the one-process stream's position: 2 steps of 4 rounds of 2 x 16 tokens
    assert manifest["feed"]["position"] == 2 * 4 * 2 * 16


def test_per_member_values_and_shares():
    from dataflow_training.drive.fleet import per_rank, token_shares

    assert per_rank("6,2", 2, "--rounds", int) == [6, 2]
    assert per_rank("4", 3, "--rounds", int) == [4, 4, 4]
    with pytest.raises(ValueError, match=r"--rounds '6,2,1' gives 3 values; the fleet has 2"):
        per_rank("6,2,1", 2, "--rounds", int)
    with pytest.raises(ValueError, match=r"--rounds 'x,2'"):
        per_rank("x,2", 2, "--rounds", int)
    assert token_shares([6, 2], batch=4, seq_len=16) == [0.75, 0.25]
