"""The data-parallel fleet measured: 1 rank, 2 ranks and a weighted 3:1 split (issue 18).

    python -m benchmarks.fleet --out benchmarks/results/fleet.json        # 2 GPUs: NCCL
    python -m benchmarks.fleet --preset gpt2_tiny --device cpu --budget 64MiB \
        --seq-len 16 --batch 2 --steps 3 --warmup 1 --out /tmp/fleet.json  # CPU smoke: gloo

Each configuration is a fleet of local processes (rank *i* on GPU *i*, or all on the CPU),
started as the conductor starts a local fleet (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
on loopback) and training ``--preset`` inside ``--budget`` a rank for ``--steps`` steps on
random tokens; the first ``--warmup`` steps are not measured. Configurations (rounds a
rank a step): ``1 rank`` [2], ``2 ranks`` [2, 2], ``3:1`` [3, 1].

Per configuration: tokens/s of the fleet (the fleet's tokens a step over the median step
time of rank 0; every member waits for the others at the all-reduce), scaling efficiency
(tokens/s over twice the 1-rank tokens/s, for the 2-rank fleets), and the all-reduce: on
the collective lane, the time it was busy and the part of that during which compute was
idle (exposed), measured from the engine's task spans of each member's last step and
predicted from its plan's simulated step (the collective link of the ``h200`` hardware
entry on CUDA, the lowering's assumed link on the CPU). Predicted step time: the slowest
member's planned step. The rows go to ``--out`` as JSON and as a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

CONFIGS = {"1 rank": [2], "2 ranks": [2, 2], "3:1": [3, 1]}
#: seconds a configuration may take before its members are killed
TIMEOUT_S = 1800


def run_config(name: str, rounds: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Start the members of one configuration, wait for them, combine their reports."""
    from dataflow_training.drive.fleet import run_on_loopback

    world = len(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, __file__, "--member", tmp, "--rounds", ",".join(map(str, rounds))]
        done = run_on_loopback([argv + member_options(args)] * world, TIMEOUT_S)
        for rank, (code, text) in enumerate(done):
            if code != 0:
                raise SystemExit(f"{name}: rank {rank} exited with {code}:\n{text}")
        members = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return combine(name, rounds, members, args)


def member_options(args: argparse.Namespace) -> list[str]:
    return [
        "--preset", args.preset, "--device", args.device, "--budget", args.budget,
        "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps),
        "--warmup", str(args.warmup),
    ]  # fmt: skip


def combine(name: str, rounds: list[int], members: list[dict], args) -> dict[str, Any]:
    tokens = sum(rounds) * args.batch * args.seq_len
    step_s = members[0]["step_s"]
    predicted_s = max(m["predicted_step_s"] for m in members)
    return {
        "config": name,
        "ranks": len(rounds),
        "rounds": rounds,
        "preset": args.preset,
        "device": args.device,
        "budget": args.budget,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "tok_s": tokens / step_s,
        "predicted_step_s": predicted_s,
        "predicted_tok_s": tokens / predicted_s,
        "measured_over_predicted": step_s / predicted_s,
        "members": members,
    }


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    single = next(row for row in rows if row["ranks"] == 1)
    for row in rows:
        for key in ("tok_s", "predicted_tok_s"):
            eff = row[key] / (row["ranks"] * single[key])
            row["scaling_efficiency" if key == "tok_s" else "predicted_scaling_efficiency"] = eff


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | ranks | rounds | step s | tok/s | scaling eff | predicted step s | "
        "measured/predicted | all-reduce ms (rank 0) | exposed ms measured / predicted |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        m = row["members"][0]
        lines.append(
            f"| {row['config']} | {row['ranks']} | {','.join(map(str, row['rounds']))} | "
            f"{row['step_s']:.4f} | {row['tok_s']:,.0f} | {row['scaling_efficiency']:.3f} | "
            f"{row['predicted_step_s']:.4f} | {row['measured_over_predicted']:.3f} | "
            f"{m['allreduce_ms']:.2f} | {m['exposed_ms']:.2f} / {m['predicted_exposed_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# -- one member ------------------------------------------------------------------------
def member(out: str, rounds: list[int], args: argparse.Namespace) -> None:
    import torch
    from dataflow_training.drive.fleet import join
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.drive.trainer import fleet_links
    from dataflow_training.step.config import DtypePolicy, TrainConfig

    from dataflow.sim.result import exposed_us
    from dataflow.units import parse_size

    fleet = join(rounds, args.batch, args.seq_len, device=args.device)
    device = args.device  # join() made GPU LOCAL_RANK the current one
    mine = rounds[fleet.rank]
    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    train = TrainConfig(
        seq_len=args.seq_len, batch=args.batch, rounds=mine, dtype=DtypePolicy.named(dtype)
    )
    run = TrainingRun.of(
        "gpt2",
        args.preset,
        train,
        budget_bytes=parse_size(args.budget),
        device=device,
        grad_share=fleet.share,
        links=fleet_links(fleet, args.device),
    )
    vocab = run.vocab_size
    times = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + fleet.rank)
        batches = []
        for _ in range(mine):
            tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen)
            batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        stats = run.step(batches)
        if step >= args.warmup:
            times.append(stats.step_s)
    trace = run.last_result.steps[-1]
    collective = {t.id for t in run.compiled.program.tasks if t.collective}
    on_link = [(t.start_us, t.end_us) for t in trace.tasks if t.task in collective]
    computing = [(t.start_us, t.end_us) for t in trace.tasks if t.task not in collective]
    sim = run.compiled.plan.sim
    planned = run.compiled.plan
    predicted_us = planned.cycle.iteration_us if planned.cycle is not None else sim.makespan_us
    report = {
        "rank": fleet.rank,
        "rounds": mine,
        "step_s": statistics.median(times),
        "predicted_step_s": predicted_us / 1e6,
        "allreduce_ms": sum(end - start for start, end in on_link) / 1e3,
        "exposed_ms": exposed_us(on_link, computing) / 1e3,
        "predicted_allreduce_ms": sim.collective.busy_us / 1e3,
        "predicted_exposed_ms": sim.collective_exposed_us / 1e3,
        "collective_link": {
            "bw_bytes_per_us": run.compiled.program.links.collective.bw_bytes_per_us,
            "latency_us": run.compiled.program.links.collective.latency_us,
        },
    }
    run.close()
    Path(out, f"rank{fleet.rank}.json").write_text(json.dumps(report))
    fleet.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--device", default="cuda", help="cuda (NCCL, a GPU a rank) or cpu")
    parser.add_argument("--budget", default="4GiB", help="fast budget a rank")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet.json"))
    parser.add_argument("--member", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no measured step of --steps {args.steps}")
    if args.member is not None:
        member(args.member, [int(r) for r in args.rounds.split(",")], args)
        return
    names = args.configs.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or "1 rank" not in names:
        parser.error(f"--configs: known {', '.join(CONFIGS)}, and '1 rank' is needed")
    rows = []
    for name in names:
        print(f"{name}: rounds {CONFIGS[name]}", file=sys.stderr)
        rows.append(run_config(name, CONFIGS[name], args))
    add_efficiency(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", "-m", "benchmarks.fleet", *(argv or sys.argv[1:])])}
    args.out.write_text(json.dumps({**document, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
