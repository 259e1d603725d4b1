"""Plan and place the llama3_8b training step (seq 4096, bf16 weights, gradients and AdamW
state, the recompute planner, a cyclic plan) with the task costs and workspace measured on
the H200 (``--profiles``: a profile cache directory, or an archive of one; by default
``benchmarks/results/profiles_llama3_8b.tgz``, whose entries come from more than one run,
the last read winning), on the CPU.

With ``--counted`` it plans the way ``TrainingRun`` did before task workspace was planned
as a reserve beside the arena: each task's workspace counted within the budget while the
task runs, then ``place(..., workspace_in_arena=False)``. Otherwise it plans the step
without task workspace at the budget less the largest and places it with
``workspace_beside_bytes`` (what ``dataflow_training.cuda_plan.plan_for_cuda`` does now). Links are the
H200's pinned-host links as compare.json measured them; the CUDA libraries' reserve is
the 32 MiB the H200 run left.

``--order`` plans another task order (``TrainConfig.order``: ``layer``, ``layer:4``) and
``--backing`` under a slow-memory budget; the output gives the plan's slow peak and the
engine's slow pool (the host memory the run page-locks).

``--head-vocab-tiles`` plans the head with its weight gradient by vocabulary tiles
(``TrainConfig.head_vocab_tiles``) and the embedding's gradient as its rows (session 17),
before either was profiled on the device: both tasks are looked up under their untiled
signatures and re-priced from the archive's figures by what changed: the head's time
times 4/3 (a fourth matmul beside its three) and its workspace less the float32 (vocab,
dim) accumulator; the embedding backward's workspace less its float32 table plus
``ROWS_TEMPORARIES`` float32 (tokens, dim) buffers. An estimate, until the device
profiles them. ``--head-accumulate gradient`` (``TrainConfig.head_accumulate``) likewise
prices the head that adds into its bf16 gradient from the float32 head's profiles: the
same time, its workspace less the float32 (vocab, dim) accumulator. ``--block-row-groups
N`` (``TrainConfig.block_row_groups``) prices each block task from its whole-batch
profile: the same time, 1/N of its workspace.

``--resolver`` (default ``torch-compiled``, what compare.py's rows run) keeps only that
resolver's profiles, the newest of each signature. ``--preset`` (with ``--seq-len``)
places another preset the archive has profiles for, e.g. ``--preset gpt2_124m --seq-len
1024 --batch 8 --rounds 64 --budget 2GiB --profiles benchmarks/results/profiles_gpt2.tgz``.
``--updates`` places the optimizer's updates (``TrainConfig.updates``: auto, early, end).
``--workspace KEY=SIZE`` (repeatable) is a what-if: every task of compute key ``KEY`` (e.g.
``gpt2.head.loss``) priced with that workspace instead of its measured one, to see what a
task that held less would buy the plan; ``--cost KEY=FACTOR`` (repeatable) likewise
prices every task of ``KEY`` at that multiple of its time (what a faster task would
buy); ``--link-scale F`` multiplies both links' bandwidth by ``F`` (what a faster host link
would buy: where the step's recompute goes away, the link is what forces it). A
``--batch`` the archive has no profiles of is priced from its largest by the tokens a
task covers (time and workspace; an estimate), but for a task whose objects keep their
sizes (an update), priced as profiled. ``--expert-shards N`` runs the experts apart in N
shards on an archive profiled with them whole: each routing and shard task is priced as
its share of the whole block's measured phase by the kit's work (``routed_share``; an
estimate). ``place_row`` does the work and returns what came
of it (``plan_rows.py`` plans every throughput row with it).

Run: ``python -m benchmarks.place_llama3_8b --budget 8GiB [--batch 2 --rounds 16] [--counted]
[--order ORDER] [--backing SIZE] [--chunk TOKENS] [--profiles DIR] [--head-vocab-tiles]
[--preset PRESET --seq-len N] [--workspace KEY=SIZE ...] [--cost KEY=FACTOR ...]
[--link-scale F] [--vocab-pieces N] [--expert-shards N]``
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import tempfile
import time
from pathlib import Path

import attrs
from dataflow_training.cli.train_defaults import default_family
from dataflow_training.plan.profile import TaskProfile, apply_profile, signature, without_workspace
from dataflow_training.plan.recompute import measured_rewriter, step_planner
from dataflow_training.step.config import UPDATES, head_chunk_tokens
from dataflow_training.step.family import load_family
from dataflow_training.step.keys import parse
from dataflow_training.step.lowering import lower

from benchmarks.harness.compare_dataflow import train_config
from dataflow import DTYPE_BYTES
from dataflow.engine.backends.torch_storage import slow_pool_bytes
from dataflow.planning import PlanningError, place, plan
from dataflow.planning.arena import live_peak_bytes, residency_blocks
from dataflow.schema.program import Link, Links
from dataflow.units import format_size, parse_size

PROFILES = Path(__file__).parent / "results" / "profiles_llama3_8b.tgz"
RESERVE_BYTES = 33_556_480  # 8 GiB less the 7.97 GiB the H200 run planned for
LINKS = Links(h2d=Link(54_804.6, 10.0), d2h=Link(55_228.2, 10.0))  # compare.json's


def scaled_links(links: Links, factor: float) -> Links:
    """``links`` with each direction's bandwidth, and their total while both copy at once
    where it is set, times ``factor`` (latencies and the collective link unchanged)."""
    duplex = links.duplex_bytes_per_us
    return attrs.evolve(
        links,
        duplex_bytes_per_us=None if duplex is None else duplex * factor,
        h2d=attrs.evolve(links.h2d, bw_bytes_per_us=links.h2d.bw_bytes_per_us * factor),
        d2h=attrs.evolve(links.d2h, bw_bytes_per_us=links.d2h.bw_bytes_per_us * factor),
    )


def measured_profiles(source: Path, resolver: str | None = None) -> dict[str, TaskProfile]:
    """Signature (as JSON) -> profile, from a cache directory or an archive of one. With
    ``resolver``, only its entries (an archive may hold another resolver's, or an older
    code's, for the same signature); where several remain, the newest file wins."""
    if source.is_dir():
        return _read(source, resolver)
    with tempfile.TemporaryDirectory() as directory:
        with tarfile.open(source) as archive:
            archive.extractall(directory, filter="data")
        return _read(Path(directory), resolver)


def _read(directory: Path, resolver: str | None) -> dict[str, TaskProfile]:
    found = {}
    for path in sorted(directory.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name)):
        entry = json.loads(path.read_text())
        key = json.loads(entry["key"])
        if resolver is not None and f"resolver {resolver}" not in key["kernels"]:
            continue
        found[json.dumps(key["signature"])] = TaskProfile(
            entry["cost_us"], entry["workspace_bytes"]
        )
    return found


#: float32 (tokens, dim) buffers ``RowGradient.summed`` and ``add_into`` hold at once at
#: most (the values, the row sums, their gather per token), for ``--head-vocab-tiles``
ROWS_TEMPORARIES = 3


def estimated_accumulate(known: dict[str, TaskProfile], vocab: int, dim: int) -> dict:
    """``known`` with the head's signatures as they lower with ``head_accumulate=
    "gradient"`` (module doc): the same time, no float32 (vocab, dim) accumulator."""
    table = vocab * dim * 4
    found = dict(known)
    for key, profile in known.items():
        signature = json.loads(key)
        if signature[0].endswith(".head.loss") and ["vocab_tiles", "True"] not in signature[1]:
            signature[1] = sorted([*signature[1], ["accumulate", "'gradient'"]])
            found[json.dumps(signature)] = TaskProfile(
                profile.cost_us, max(0, profile.workspace_bytes - table)
            )
    return found


#: the block phases ``block_row_groups`` cuts into groups of sequences
ROW_GROUP_PHASES = (".forward", ".recompute", ".backward")


def estimated_row_groups(known: dict[str, TaskProfile], groups: int) -> dict:
    """``known`` with the block tasks' signatures as they lower with ``block_row_groups=
    groups`` (module doc): the same time (each group's tasks cost the same per token:
    qwen3_5_cut's batch-2 tasks summed to 1.536 s a step, batch 4's 1.542 s, session 41),
    the workspace a group's, ``1/groups`` of the whole batch's (an estimate: what scales
    with the tokens; the device's profile says what the split holds)."""
    found = dict(known)
    for key, profile in known.items():
        signature = json.loads(key)
        name = signature[0]
        if name.endswith(ROW_GROUP_PHASES) and ".head." not in name and ".embed." not in name:
            signature[1] = sorted([*signature[1], ["row_groups", repr(groups)]])
            found[json.dumps(signature)] = TaskProfile(
                profile.cost_us, profile.workspace_bytes // groups
            )
    return found


def estimated_tiles(known: dict[str, TaskProfile], tokens: int, vocab: int, dim: int) -> dict:
    """``known`` with the head and embedding-backward signatures as they lower with
    ``head_vocab_tiles`` (module doc): the head's under its ``vocab_tiles`` parameter, the
    embedding backward's workspace re-estimated."""
    table = vocab * dim * 4
    found = dict(known)
    for key, profile in known.items():
        signature = json.loads(key)  # [compute key, [[param, repr], ...], shape, sizes...]
        if signature[0].endswith(".head.loss"):
            signature[1] = sorted([*signature[1], ["vocab_tiles", "True"]])
            found[json.dumps(signature)] = TaskProfile(
                profile.cost_us * 4 / 3, max(0, profile.workspace_bytes - table)
            )
        elif signature[0].endswith(".embed.backward"):
            rows = ROWS_TEMPORARIES * tokens * dim * 4
            found[key] = TaskProfile(
                profile.cost_us, max(0, profile.workspace_bytes - table) + rows
            )
    return found


#: a routed phase (a block whose experts run apart) -> the whole block's phase it is a part of
WHOLE_PHASE = {
    "route_forward": "forward",
    "experts_forward": "forward",
    "route_recompute": "recompute",
    "route_backward": "backward",
    "experts_backward": "backward",
}


def routed_share(step, task) -> tuple[str, float] | None:
    """For a task of a block whose experts run apart (``--expert-shards``; an archive
    profiled with the experts whole has none): (the whole block's compute key of that
    phase, the task's share of its floating-point work by the kit's cost model), which
    prices it as that share of the whole block's measured time and workspace (an
    estimate: the router, the dispatch and the shards' gathers are not matmul-bound).
    A shard's backward re-deriving its rows' ``gate_up`` (its experts' object without
    them) adds that work; the routing ``rec`` is the routing forward's share of the
    whole block's ``rec``. None for any other task."""
    key = parse(task.compute_key)
    family, kind, phase = key.family, key.kind, key.phase
    if family is None or phase not in WHOLE_PHASE:
        return None
    train, config = step.layout.train, step.config
    math_ = step.family.math(kind)
    act = DTYPE_BYTES[train.dtype.activation]
    whole = math_.cost(config, train.batch, train.seq_len, act)
    shards = math_.experts_apart(config)
    route, one = math_.apart_cost(config, train.batch, train.seq_len, act, shards)
    part = {
        "route_forward": route.forward.flops,
        "experts_forward": one.forward.flops,
        "route_recompute": route.forward.flops,
        "route_backward": route.backward.flops,
        "experts_backward": one.backward.flops,
    }[phase]
    if phase == "experts_backward" and one.recompute is not None:
        (experts,) = step.layout.tasks[task.id].inputs["saved"]
        if [e.name for e in step.layout.packed[experts].layout.entries] == ["moe_in"]:
            part += one.recompute.flops
    base = (whole.recompute or whole.forward) if phase == "route_recompute" else None
    total = {"forward": whole.forward, "backward": whole.backward}.get(WHOLE_PHASE[phase], base)
    return f"{family}.{kind}.{WHOLE_PHASE[phase]}", part / total.flops


def _without_shape(signature: list) -> str:
    """A signature (parsed) as JSON with its (batch, seq_len) shape left out."""
    return json.dumps([*signature[:2], *signature[3:]])


class Lookup:
    """A profiling pass for lowered programs, answered from ``known`` (signature as JSON
    -> profile): ``lookup(program)`` returns each task signature's profile; with
    ``strip`` the tasks' workspace is taken out (``without_workspace``) and the largest
    kept in ``largest_bytes``."""

    def __init__(
        self,
        known: dict[str, TaskProfile],
        strip: bool = True,
        caps: dict[str, int] | None = None,
        scales: dict[str, float] | None = None,
    ) -> None:
        self.known, self.strip, self.largest_bytes = known, strip, 0
        self.caps, self.scales = caps or {}, scales or {}
        #: signatures the archive lacks (the partial saves' tasks came after it), priced
        #: as the costliest profile of their compute key at their token shape, or, where
        #: the archive has the key at other shapes only (another batch), the costliest of
        #: the largest shape scaled by the tokens (time and workspace alike: an estimate);
        #: a task whose objects are all of the sizes it was profiled with (an optimizer
        #: update) is taken as it is
        self.stand_ins: set[str] = set()
        self.scaled: set[str] = set()
        #: the compute keys of tasks of a block whose experts run apart, priced as a share
        #: of the whole block's (``routed_share``)
        self.apart: set[str] = set()
        self.by_key: dict[str, TaskProfile] = {}
        self.shapes: dict[str, list[int]] = {}
        self.same_sizes: dict[str, TaskProfile] = {}
        #: each optimizer key's largest profiled update: (bytes read and written, profile)
        self.largest_update: dict[str, tuple[int, TaskProfile]] = {}
        for text, profile in known.items():
            signature = json.loads(text)
            self.same_sizes[_without_shape(signature)] = profile
            if signature[0].startswith("optim."):
                size = sum(map(sum, signature[3:5]))
                if size > self.largest_update.get(signature[0], (0, None))[0]:
                    self.largest_update[signature[0]] = (size, profile)
            key = json.dumps([signature[0], signature[2]])
            if key not in self.by_key or profile.cost_us > self.by_key[key].cost_us:
                self.by_key[key] = profile
            shape = self.shapes.setdefault(signature[0], signature[2])
            if math.prod(signature[2]) > math.prod(shape):
                self.shapes[signature[0]] = signature[2]

    def _stand_in(self, compute_key: str, shape: list[int]) -> TaskProfile:
        exact = self.by_key.get(json.dumps([compute_key, shape]))
        if exact is not None:
            return exact
        if compute_key not in self.shapes:
            raise KeyError(f"the archive has no profile of {compute_key}")
        other = self.shapes[compute_key]
        profile = self.by_key[json.dumps([compute_key, other])]
        ratio = math.prod(shape) / math.prod(other)
        self.scaled.add(compute_key)
        return TaskProfile(profile.cost_us * ratio, int(profile.workspace_bytes * ratio))

    def _update_by_bytes(self, signature: list) -> TaskProfile | None:
        """An optimizer update of objects of other sizes (a vocabulary table's row piece,
        ``--vocab-pieces``): the largest profiled update of its compute key, its time
        scaled by the bytes (an update reads and writes each byte once: the archive's
        updates of 0.42 and 2.03 GB gradients took 4.07 and 4.08 us a MB), no workspace."""
        if signature[0] not in self.largest_update:
            return None
        size, profile = self.largest_update[signature[0]]
        self.scaled.add(signature[0])
        return TaskProfile(profile.cost_us * sum(map(sum, signature[3:5])) / size, 0)

    def profile_of(self, text: str) -> TaskProfile:
        """The profile of a signature (as JSON): the archive's, else a stand-in; with its
        compute key's workspace and cost what-ifs."""
        signature = json.loads(text)
        profile = self.known.get(text)
        if profile is None:
            self.stand_ins.add(text)
            # every object the same size (an update): tokens do not count
            profile = self.same_sizes.get(_without_shape(signature))
        if profile is None:
            profile = self._update_by_bytes(signature)
        if profile is None:
            profile = self._stand_in(signature[0], signature[2])
        compute_key = signature[0]
        if compute_key in self.caps:
            profile = TaskProfile(profile.cost_us, self.caps[compute_key])
        if compute_key in self.scales:
            profile = TaskProfile(
                profile.cost_us * self.scales[compute_key], profile.workspace_bytes
            )
        return profile

    def __call__(self, step) -> dict:
        found = {}
        for task in step.program.tasks:
            key = signature(step, task)
            text = json.dumps(json.loads(json.dumps(key, default=repr)))
            routed = routed_share(step, task)
            if routed is not None and text not in self.known:
                whole, share = routed
                profile = self.profile_of(json.dumps([whole, *json.loads(text)[1:]]))
                self.apart.add(task.compute_key)
                found[key] = TaskProfile(
                    profile.cost_us * share, int(profile.workspace_bytes * share)
                )
                continue
            found[key] = self.profile_of(text)
        if not self.strip:
            return found
        found, most = without_workspace(found)
        self.largest_bytes = max(self.largest_bytes, most)
        return found


def _positive(text: str) -> float:
    """A positive number (``--link-scale``)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line (module doc); ``plan_rows.py`` parses its rows with it too."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--counted", action="store_true")
    parser.add_argument("--profiles", type=Path, default=PROFILES)
    parser.add_argument("--order", default="round")
    parser.add_argument("--backing", default=None)
    parser.add_argument("--chunk", type=int, default=None, help="head tokens a chunk")
    parser.add_argument("--head-vocab-tiles", action="store_true", help="estimated (module doc)")
    parser.add_argument(
        "--block-row-groups",
        type=int,
        default=1,
        help="TrainConfig.block_row_groups (the block tasks' profiles with 1/N of their "
        "workspace: estimated, module doc)",
    )
    parser.add_argument(
        "--head-accumulate",
        default="float32",
        choices=["float32", "gradient"],
        help="TrainConfig.head_accumulate (gradient: estimated, module doc)",
    )
    parser.add_argument(
        "--vocab-pieces", type=int, default=1, help="TrainConfig.vocab_pieces (updates by bytes)"
    )
    parser.add_argument(
        "--resolver", default="torch-compiled", help="whose profiles (compare.py's rows' default)"
    )
    parser.add_argument("--updates", default="auto", choices=UPDATES, help="TrainConfig.updates")
    parser.add_argument("--preset", default="llama3_8b")
    parser.add_argument(
        "--vocab-multiple",
        type=int,
        default=None,
        help="the config's vocab_multiple (default the preset's, 64): 1 for an archive "
        "profiled before the vocabulary was stored padded",
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--expert-shards",
        type=int,
        default=0,
        help="the config's expert_shards (0: the preset's); tasks the archive lacks priced "
        "as shares of the whole block's (routed_share)",
    )
    parser.add_argument(
        "--cost", action="append", default=[], help="KEY=FACTOR, a what-if (module doc)"
    )
    parser.add_argument(
        "--workspace", action="append", default=[], help="KEY=SIZE, a what-if (module doc)"
    )
    parser.add_argument(
        "--link-scale",
        type=_positive,
        default=1.0,
        help="both links' bandwidth times F (a what-if)",
    )
    return parser


def place_row(args: argparse.Namespace, say=print) -> dict:
    """Plan and place one step as the module doc says; ``say`` gets each line of the
    report. -> what came of it: ``planned_s`` and ``placed_s`` (steady-state iterations;
    ``placed_s`` None where it does not place, ``planned_s`` None where it cannot be
    planned, ``error`` then says why), the slow pool and peak, the bytes each way, the
    units re-derived (whole and partial) and their time, the sum of the step's tasks."""
    backing = None if args.backing is None else parse_size(args.backing)
    budget = parse_size(args.budget)
    family = load_family(default_family(args.preset))
    config = family.presets[args.preset]
    vocab = config.vocab_size
    dim = getattr(config, "hidden_size", None) or config.n_embd
    known = measured_profiles(args.profiles, args.resolver)
    if args.head_vocab_tiles:
        known = estimated_tiles(known, args.batch * args.seq_len, vocab, dim)
    if args.head_accumulate == "gradient":
        known = estimated_accumulate(known, vocab, dim)
    if args.block_row_groups > 1:
        known = estimated_row_groups(known, args.block_row_groups)
    caps = dict(item.split("=", 1) for item in args.workspace)
    caps = {key: parse_size(size) for key, size in caps.items()}
    scales = {key: float(f) for key, f in (item.split("=", 1) for item in args.cost)}
    measured = Lookup(known, strip=not args.counted, caps=caps, scales=scales)

    chunk = args.chunk or head_chunk_tokens(budget, vocab)  # (the 8B archive has 2048's)
    train = train_config(
        "bf16",
        args.batch,
        args.rounds,
        args.seq_len,
        chunk,
        args.order,
        args.head_vocab_tiles,
        args.updates,
        None,
        args.vocab_pieces,
        args.head_accumulate,
        args.block_row_groups,
    )
    multiple = {} if args.vocab_multiple is None else {"vocab_multiple": args.vocab_multiple}
    if args.expert_shards:
        multiple["expert_shards"] = args.expert_shards
    step = lower(family, args.preset, train, overrides=multiple)
    profiles = measured(step)
    program = attrs.evolve(
        apply_profile(step, profiles), links=scaled_links(LINKS, args.link_scale)
    )
    spec = step_planner(measured_rewriter(step.with_program(program), measured, known=profiles))
    beside = measured.largest_bytes
    row: dict = {"planned_s": None, "placed_s": None, "error": None}
    arena = budget - RESERVE_BYTES - beside
    if arena < 1:
        error = (
            f"the budget of {format_size(budget)} leaves no room beside the largest task "
            f"workspace ({format_size(beside)}) and the CUDA libraries' reserve"
        )
        say(f"cannot be planned: {error}")
        return row | {"error": error}
    started = time.perf_counter()
    try:
        planned = plan(
            program,
            arena,
            planner=spec,
            cyclic=True,
            slow_budget_bytes=backing,
        )
    except PlanningError as exc:
        say(f"cannot be planned ({time.perf_counter() - started:.1f} s): {exc}")
        return row | {"error": str(exc)}
    if measured.stand_ins:
        missing = len(measured.stand_ins)
        say(f"{missing} signatures not in the archive, priced as their key's costliest")
    if measured.scaled:
        say(
            f"scaled by tokens from another shape: {', '.join(sorted(measured.scaled))} "
            "(their workspace too, though a part of it may not follow the tokens, such as "
            "the head's float32 weight-gradient sum: --workspace KEY=SIZE sets it)"
        )
    if measured.apart:
        say(f"shares of the whole block's: {', '.join(sorted(measured.apart))}")
    held = live_peak_bytes([b for b in residency_blocks(planned) if b.obj_id is not None])
    iteration = planned.cycle.iteration_us / 1e6
    say(f"planned at {planned.budget_bytes} bytes in {time.perf_counter() - started:.1f} s:")
    say(f"  objects held at once {held}, iteration {iteration:.3f} s")
    sim = planned.sim
    pool = slow_pool_bytes(planned.program)
    say(
        f"  slow peak {format_size(sim.slow_peak_bytes)}, slow pool "
        f"{format_size(pool)}, h2d {sim.h2d.bytes / 1e9:.0f} GB, "
        f"d2h {sim.d2h.bytes / 1e9:.0f} GB a step"
    )
    recs = [t for t in planned.program.tasks if t.kind == "rec"]
    row |= {
        "planned_s": iteration,
        "tasks_s": sum(t.cost_us for t in planned.program.tasks) / 1e6,
        "rederived_whole": sum(1 for t in recs if "partial" not in t.params),
        "rederived_partial": sum(1 for t in recs if "partial" in t.params),
        "rederive_s": sum(t.cost_us for t in recs) / 1e6,
        "slow_peak_bytes": sim.slow_peak_bytes,
        "slow_pool_bytes": pool,
        "h2d_gb": sim.h2d.bytes / 1e9,
        "d2h_gb": sim.d2h.bytes / 1e9,
        "stand_ins": len(measured.stand_ins),
    }
    started = time.perf_counter()
    try:
        placed = (
            place(planned, workspace_in_arena=False)
            if args.counted
            else place(planned, workspace_beside_bytes=beside)
        )
    except PlanningError as exc:
        say(f"does not place ({time.perf_counter() - started:.1f} s): {exc}")
        return row | {"error": f"does not place: {exc}"}
    say(
        f"placed in {time.perf_counter() - started:.1f} s: arena {placed.arena_bytes} + "
        f"{placed.workspace_outside_bytes} beside, plan at {placed.plan.budget_bytes}, "
        f"iteration {placed.plan.cycle.iteration_us / 1e6:.3f} s (simulated: measured "
        "task costs, modelled links)"
    )
    return row | {
        "placed_s": placed.plan.cycle.iteration_us / 1e6,
        "arena_bytes": placed.arena_bytes,
        "beside_bytes": placed.workspace_outside_bytes,
    }


def main() -> None:
    place_row(parser().parse_args())


if __name__ == "__main__":
    main()
