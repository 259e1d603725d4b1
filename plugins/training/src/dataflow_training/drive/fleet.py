"""The data-parallel fleet: one ``dataflow train`` over several processes, on
``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

Every member (a rank) runs its own ``TrainingRun`` for its own budget and its own number
of accumulation rounds per step (``--rounds 6,2``: rank 0 runs 6, rank 1 runs 2, a 3:1
split of the data). The step of a member is lowered with ``grad_share`` = its tokens over
the fleet's, so after its last backward round an ``allreduce`` task per parameter group
scales the group's gradient by that share and sums it over the fleet
(``tasks.GradAllReduce``): every member then holds the token-weighted mean gradient, the
same gradient one process would have after running all the rounds, and applies the same
update (clipping and the gradient norm are taken after the sum, so they are global too).

The data is dealt, not sliced: every member reads the stream one process would read, with
the same seed and order, and a step's ``sum(rounds)`` rounds are those one process
running them all would read; round ``r`` of the step goes to the member that owns ``r``
(``deal``: rank 0 the first ``rounds[0]``, rank 1 the next ``rounds[1]``, and so on;
``DealtFeed``). So a fleet's step is one process's step, and every member's feed stands
at the same position after it: the one-process position, which the checkpoint keeps, so
a run resumes at another world size or split, or as one process, where it stopped.

Members find each other as ``torchrun`` members do: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment, the c10d TCP store at the master
address (``init_method="env://"``). ``torchrun --nproc-per-node N -m dataflow train`` sets
them; so does the conductor (``dataflow_training.drive.conductor``) for ``--topology``.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

#: what a member waits for a collective (or the rendezvous) before it gives up
DEFAULT_TIMEOUT_S = 60.0
#: environment variables a member reads (torchrun's names)
ENV_RANK, ENV_WORLD, ENV_ADDR, ENV_PORT = "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
#: the host name a member reports itself by (set by the conductor; default: the hostname)
ENV_HOST = "DATAFLOW_FLEET_HOST"
#: seconds a member waits on a collective (set by the conductor)
ENV_TIMEOUT = "DATAFLOW_FLEET_TIMEOUT_S"


class FleetError(RuntimeError):
    """The fleet cannot run or stopped: the message names the member and what to do."""


def in_fleet() -> bool:
    """Whether this process was started as a fleet member (torchrun or the conductor)."""
    return int(os.environ.get(ENV_WORLD, "1")) > 1 or ENV_RANK in os.environ


def per_rank(text: str | None, world: int, option: str, convert: Any) -> list[Any] | None:
    """``"6,2"`` as one value per rank (``convert`` each); one value alone stands for every
    rank. None stays None. A count that is neither 1 nor ``world`` is an error naming
    ``option``."""
    if text is None:
        return None
    items = [item.strip() for item in str(text).split(",")]
    if len(items) == 1:
        items = items * world
    if len(items) != world:
        raise ValueError(
            f"{option} {text!r} gives {len(items)} values; the fleet has {world} member(s)"
        )
    try:
        return [convert(item) for item in items]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{option} {text!r}: {exc}") from None


def token_shares(rounds: Sequence[int], batch: int, seq_len: int) -> list[float]:
    """Each member's tokens per step over the fleet's (every member has the same
    ``batch`` x ``seq_len`` rounds, so this is its share of the rounds)."""
    tokens = [r * batch * seq_len for r in rounds]
    if any(r < 1 for r in rounds):
        raise ValueError(f"--rounds {','.join(map(str, rounds))}: every member needs a round")
    return [t / sum(tokens) for t in tokens]


def deal(rounds: Sequence[int], rank: int) -> range:
    """The rounds of every step that ``rank`` owns: of the step's ``sum(rounds)`` rounds
    (in the order one process reads them), the ``rounds[rank]`` after the first
    ``sum(rounds[:rank])``. ``deal((3, 1), 1)`` is ``range(3, 4)``."""
    if not 0 <= rank < len(rounds):
        raise ValueError(f"rank {rank} is not in 0..{len(rounds) - 1}")
    first = sum(rounds[:rank])
    return range(first, first + rounds[rank])


class DealtFeed:
    """A step's ``(tokens, targets)`` of the rounds this process owns (``owned``), dealt
    from ``feed``'s one-process stream: ``next_step`` reads all ``total`` rounds of the
    step in order, as one process running them all does, and keeps those in ``owned``.
    Every member reads the whole step (a round it does not own is read and dropped: the
    feed protocol has no skip, and a round of ``batch x seq_len`` tokens costs little
    beside a step), so every member's feed, and its ``state()``, is the one process's.
    One process is the fleet of one: ``DealtFeed(feed, rounds, range(rounds))``.

    With ``documents`` (``dataflow train --pack-documents``) each round is read with
    where its documents start (the feed's ``next_documents``: the same tokens, the same
    position) and dealt as ``(tokens, targets, segments)`` (``kit.packed_documents``)."""

    def __init__(self, feed: Any, total: int, owned: range, *, documents: bool = False) -> None:
        if not (0 <= owned.start < owned.stop <= total and owned.step == 1):
            raise ValueError(f"rounds {owned.start}..{owned.stop - 1} are not of 0..{total - 1}")
        self.feed, self.total, self.owned, self.documents = feed, total, owned, documents

    def next_step(self) -> list[tuple[Any, ...]]:
        """This process's rounds of the next step, in the stream's order."""
        # torch loads when a step is dealt: `dataflow train` reads this module without it
        from dataflow_training.kit.segments import packed_documents

        batches = []
        for round_ in range(self.total):
            if self.documents:
                batch = packed_documents(*self.feed.next_documents())
            else:
                batch = self.feed.next()
            if round_ in self.owned:
                batches.append(batch)
        return batches


def stream_difference(theirs: Any, ours: Any) -> str:
    """What differs between two feed states, as ``position 512 (rank 0: 0)``; a nested
    value (the dataset's fingerprint) by its name alone."""
    if not (isinstance(theirs, dict) and isinstance(ours, dict)):
        return f"state is {theirs!r} (rank 0: {ours!r})"
    keys = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    return ", ".join(
        k if isinstance(ours.get(k), dict) else f"{k} {theirs.get(k)!r} (rank 0: {ours.get(k)!r})"
        for k in keys
    )


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


@attrs.frozen
class Fleet:
    """This process's place in an initialised fleet: ``rank`` of ``world``, every
    member's ``rounds``, this member's token ``share``, and on how many ``hosts`` the
    members run (by the host names they report)."""

    rank: int
    world: int
    rounds: tuple[int, ...]
    share: float
    hosts: int = 1

    @property
    def scope(self) -> str:
        """Where the all-reduce runs (``HardwareEntry.collective_link``): within one host,
        or over the network."""
        return "nvlink" if self.hosts == 1 else "network"

    @property
    def owned(self) -> range:
        """The rounds of every step this member owns (``deal``)."""
        return deal(self.rounds, self.rank)

    @property
    def writes(self) -> bool:
        """Rank 0 writes checkpoints and metrics; every member reads checkpoints."""
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` (picklable), in rank order, on every member."""
        # torch loads when a fleet joins: `dataflow train` reads this module's options without it
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def check_stream(self, state: Any) -> None:
        """Every member's feed must stand where rank 0's does (``state``: this member's
        ``feed.state()``): the same data, seed and position. The first that differs is one
        ``FleetError`` naming its rank (another ``--data`` on its host, a folder of other
        files under the same path)."""
        states = self.gather(state)
        for rank, theirs in enumerate(states[1:], start=1):
            if theirs != states[0]:
                raise FleetError(
                    f"rank {rank} reads another stream than rank 0: its feed's "
                    f"{stream_difference(theirs, states[0])}; every member needs the same "
                    "--data, with the same files"
                )

    def mean_loss(self, losses: Sequence[float]) -> float:
        """The fleet's mean loss over all its rounds (what one process that ran them all
        reports): the sum of every member's round losses over the fleet's rounds."""
        # torch loads when a fleet joins: `dataflow train` reads this module's options without it
        import torch
        import torch.distributed as dist

        # NCCL reduces device tensors only; gloo takes host ones.
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor([float(sum(losses))], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return float(total) / sum(self.rounds)

    def barrier(self) -> None:
        # torch loads when a fleet joins: `dataflow train` reads this module's options without it
        import torch.distributed as dist

        dist.barrier()

    def close(self, *, finished: bool = False) -> None:
        """Leave the fleet. ``finished`` (every member ran to the end): first wait at a
        barrier, so no member tears its process group down while another still talks to
        it, then collect the garbage, so no cycle keeps a gloo or store thread alive into
        the interpreter's teardown (where its destructor aborts the process: "terminate
        called without an active exception", exit -6, seen once in CI on a run that had
        finished). After a failure there is no barrier: the others may be gone."""

        # torch loads when a fleet joins: `dataflow train` reads this module's options without it
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def join(
    rounds: Sequence[int], batch: int, seq_len: int, *, device: str = "cpu", backend: str = "auto"
) -> Fleet:
    """Join the fleet this process was started in (the environment, as torchrun sets it):
    initialise the default process group, check that every member runs the same code
    (``check_versions``) and return this member's ``Fleet``."""
    # torch loads when a fleet joins: `dataflow train` reads this module's options without it
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get(ENV_RANK, "0")), int(os.environ.get(ENV_WORLD, "1"))
    if len(rounds) != world:
        raise FleetError(
            f"--rounds {','.join(map(str, rounds))} gives {len(rounds)} member(s); the fleet "
            f"has {world} ({ENV_WORLD})"
        )
    if backend == "auto":
        backend = default_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world, timeout=timeout
        )
    fleet = Fleet(rank, world, tuple(rounds), token_shares(rounds, batch, seq_len)[rank])
    reports = fleet.gather(version_report())
    check_versions(reports)
    return attrs.evolve(fleet, hosts=len({report["host"] for report in reports}))


def host_name() -> str:
    return os.environ.get(ENV_HOST) or socket.gethostname()


def git_commit(path: Path | None = None) -> str | None:
    """The commit checked out where this package's source is (None outside a git tree)."""
    where = path or Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def version_report() -> dict[str, Any]:
    """What a member reports before training: its host, git commit, package versions."""
    # torch loads when a fleet joins: `dataflow train` reads this module's options without it
    from dataflow_training.drive.checkpoint import package_versions

    return {"host": host_name(), "commit": git_commit(), "versions": package_versions()}


def check_versions(reports: Sequence[dict[str, Any]]) -> None:
    """Every member must run what rank 0 runs: the same git commit and package versions.
    The first difference is one ``FleetError`` naming the host and what differs."""
    first = reports[0]
    for rank, report in enumerate(reports[1:], start=1):
        if report["commit"] != first["commit"]:
            raise FleetError(
                f"version skew: host {report['host']} (rank {rank}) runs commit "
                f"{report['commit']}; {first['host']} (rank 0) runs {first['commit']}"
            )
        theirs, ours = report["versions"], first["versions"]
        for name in sorted(set(theirs) | set(ours)):
            if theirs.get(name) != ours.get(name):
                raise FleetError(
                    f"version skew: host {report['host']} (rank {rank}) has {name} "
                    f"{theirs.get(name)}; {first['host']} (rank 0) has {ours.get(name)}"
                )


def run_on_loopback(
    argvs: Sequence[Sequence[str]], timeout_s: float, env: dict[str, str] | None = None
) -> list[tuple[int, str]]:
    """Start one process per argv as the ranks of a fleet on this host (rank *i* takes
    GPU *i*; rendezvous and collectives on loopback), wait for all of them and return
    each one's ``(exit code, output)``; any still running after ``timeout_s`` are killed.
    For tests and benchmarks; ``dataflow train --topology`` is the user's way."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(argvs)
    procs = []
    for rank, argv in enumerate(argvs):
        member_env = dict(
            env if env is not None else os.environ,
            **{ENV_RANK: str(rank), ENV_WORLD: str(world), ENV_ADDR: "127.0.0.1"},
            **{ENV_PORT: str(port), "LOCAL_RANK": str(rank)},
            GLOO_SOCKET_IFNAME="lo",
            NCCL_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                list(argv),
                env=member_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [(proc.returncode, text) for proc, text in zip(procs, outputs, strict=True)]
