"""The conductor of ``dataflow train --topology topology.toml --group dp``: it reads the
topology, starts every member of the group (a local process for a host without ``ssh``,
``ssh ALIAS 'cd REPO && env ... PYTHON -m dataflow train ...'`` for one with it), each
with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``:
rank 0's ``listen`` address), and watches them: when one exits with an error the others
are stopped and the fleet fails with one line naming the member and the checkpoint to
resume from. The members find each other, check versions and train
(``dataflow_training.drive.fleet``).

``topology.toml``::

    conductor = "boxA"
    [hosts.boxA]
    python = "/opt/venv/bin/python"
    repo = "/srv/dataflow"
    listen = "10.0.0.1:29500"
    [hosts.boxB]
    ssh = "boxB"          # an ssh alias from the conductor
    python = "/opt/venv/bin/python"
    repo = "/srv/dataflow"
    listen = "10.0.0.2:29500"
    [groups.dp]
    members = ["boxA", "boxB"]
    backend = "auto"       # auto | nccl | gloo
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

import attrs

from dataflow.cli import BUDGET
from dataflow_training.drive.fleet import ENV_HOST, ENV_TIMEOUT, FleetError

BACKENDS = ("auto", "nccl", "gloo")
HOST_FIELDS = ("ssh", "python", "repo", "listen", "nic", "fast", "backing")
#: seconds the conductor gives the other members to stop before it kills them
STOP_GRACE_S = 10.0
#: the environment variable with the backend the members use (from the group)
ENV_BACKEND = "DATAFLOW_FLEET_BACKEND"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@attrs.frozen
class Host:
    name: str
    listen: str
    python: str = sys.executable
    repo: str | None = None
    ssh: str | None = None
    nic: str | None = None
    #: default fast-memory and backing budgets of the member on this host (sizes as
    #: ``--fast-budget`` takes them, e.g. ``"14GiB"``): used when the command gives none
    fast: str | None = None
    backing: str | None = None

    @property
    def address(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> str:
        return self.listen.rpartition(":")[2]


@attrs.frozen
class Topology:
    conductor: str
    hosts: dict[str, Host]
    groups: dict[str, tuple[tuple[str, ...], str]]  # name -> (members, backend)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read and check ``path``; an error names the file and the field."""
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--topology {path}: {exc}") from None

        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"--topology {path}: {field} {why}")

        hosts = {}
        for name, entry in raw.get("hosts", {}).items():
            unknown = set(entry) - set(HOST_FIELDS)
            if unknown:
                raise bad(f"hosts.{name}", f"has unknown field(s) {sorted(unknown)}")
            listen = entry.get("listen")
            if not listen or ":" not in listen or not listen.rpartition(":")[2].isdigit():
                raise bad(f"hosts.{name}.listen", "must be ADDRESS:PORT")
            fields = {k: entry[k] for k in ("python", "repo", "ssh", "nic") if k in entry}
            for size in ("fast", "backing"):
                if size in entry:
                    fields[size] = _size(entry[size], bad(f"hosts.{name}.{size}", "is not a size"))
            hosts[name] = Host(name, listen, **fields)
        conductor = raw.get("conductor")
        if conductor not in hosts:
            raise bad("conductor", f"{conductor!r} is not one of [hosts]: {sorted(hosts)}")
        groups = {}
        for name, entry in raw.get("groups", {}).items():
            members = tuple(entry.get("members", ()))
            if not members:
                raise bad(f"groups.{name}.members", "is empty")
            for member in members:
                if member not in hosts:
                    raise bad(f"groups.{name}.members", f"names {member!r}, not a host")
            backend = entry.get("backend", "auto")
            if backend not in BACKENDS:
                raise bad(f"groups.{name}.backend", f"is {backend!r}; one of {BACKENDS}")
            groups[name] = (members, backend)
        return cls(conductor, hosts, groups)

    def default_sizes(self, group: str, field: str) -> str | None:
        """The group's members' ``field`` (``fast`` or ``backing``) as a ``--fast-budget``
        / ``--backing-budget`` value, one per member in rank order; None when no member
        sets it; an error naming the hosts that lack it when only some do."""
        members = self.members(group)
        sizes = [getattr(host, field) for host in members]
        if all(size is None for size in sizes):
            return None
        lacking = [host.name for host, size in zip(members, sizes, strict=True) if size is None]
        if lacking:
            raise ValueError(
                f"hosts {lacking} of group {group!r} set no {field!r} size while others do: "
                f"set it on every member or give the budgets on the command line"
            )
        return ",".join(sizes)

    def members(self, group: str) -> list[Host]:
        if group not in self.groups:
            raise ValueError(f"--group {group!r} is not in the topology: {sorted(self.groups)}")
        return [self.hosts[name] for name in self.groups[group][0]]


def member_env(topology: Topology, group: str, rank: int, timeout_s: float) -> dict[str, str]:
    """torchrun's variables for member ``rank``, plus the fleet's own."""
    members = topology.members(group)
    master = members[0]
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(sum(1 for m in members[:rank] if m.ssh == members[rank].ssh)),
        "WORLD_SIZE": str(len(members)),
        "MASTER_ADDR": master.address,
        "MASTER_PORT": master.port,
        ENV_HOST: members[rank].name,
        ENV_TIMEOUT: str(timeout_s),
        ENV_BACKEND: topology.groups[group][1],
    }
    nic = members[rank].nic or ("lo" if master.address in LOOPBACK else None)
    if nic:  # collectives on the configured interface only (a local fleet: loopback)
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = nic
    return env


def member_command(host: Host, env: dict[str, str], train_args: Sequence[str]) -> list[str]:
    """The argv that starts a member on ``host``: ``python -m dataflow train ...`` here,
    or the same through ``ssh ALIAS`` (cd into ``repo`` first) for a remote host."""
    argv = [host.python, "-m", "dataflow", "train", *train_args]
    if host.ssh is None:
        return argv
    assigns = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    remote = " ".join(["env", *assigns, *map(shlex.quote, argv)])
    if host.repo:
        remote = f"cd {shlex.quote(host.repo)} && {remote}"
    return ["ssh", host.ssh, remote]


def conduct(
    topology: Topology,
    group: str,
    train_args: Sequence[str],
    *,
    out: Path,
    timeout_s: float = 60.0,
    poll_s: float = 0.2,
) -> None:
    """Start every member, wait for all of them; a member that fails stops the fleet with
    one ``FleetError`` naming it and the checkpoint to resume from."""
    # torch loads when a fleet member stops: `dataflow train` reads this module without it
    from dataflow_training.drive.checkpoint import latest_checkpoint

    procs = []
    for rank, host in enumerate(topology.members(group)):
        env = member_env(topology, group, rank, timeout_s)
        cmd = member_command(host, env, train_args)
        cwd = host.repo if host.ssh is None and host.repo else None
        procs.append((host, subprocess.Popen(cmd, env=dict(os.environ, **env), cwd=cwd)))
    failed = None
    try:
        while failed is None and any(p.poll() is None for _h, p in procs):
            failed = next(((h, p) for h, p in procs if p.poll() not in (None, 0)), None)
            time.sleep(poll_s)
        failed = failed or next(((h, p) for h, p in procs if p.returncode != 0), None)
    finally:
        _stop(procs)
    if failed is not None:
        host, proc = failed
        rank = [h for h, _p in procs].index(host)
        kept = latest_checkpoint(out)
        raise FleetError(
            f"member {host.name} (rank {rank}) exited with code {proc.returncode}; the fleet "
            f"stopped. Resume with the same command and --resume auto (last complete "
            f"checkpoint: {kept or 'none'})"
        )


def _stop(procs: list[tuple[Host, subprocess.Popen]]) -> None:
    running = [p for _h, p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _size(value: object, error: ValueError) -> str:
    """A host's size as written (``"14GiB"``), checked to parse as a budget."""

    try:
        BUDGET.convert(str(value), None, None)
    except Exception:  # click's BadParameter, or anything the parser raises
        raise error from None
    return str(value)
