"""Does the compensated bf16 update lose nothing, and do 8-bit moments? Four loss curves of
one model on real text, same seed and data: ``--precision bf16-plain`` (bf16 weights and
AdamW moments, the update rounded), ``bf16`` (the same, the update's rounding compensated),
``mixed`` (bf16 compute, float32 master weights and moments) and ``int8`` (``--dtype bf16
--optimizer-states int8``: bf16-plain with the moments block-wise in 8 bits, issue 50;
the curve to hold against bf16-plain's, the one other thing alike). Feeds
docs/throughput.md ("A pure-bf16 update that loses nothing", "8-bit AdamW moments") and
writes ``benchmarks/results/bf16_update/``: each run's ``<curve>.metrics.jsonl``, and once
all are complete ``loss.svg`` (``benchmarks.loss_plot``), ``summary.json`` and
``summary.md`` (a Markdown table of the curves' ends and speeds). ``--curves`` runs some
of them (``--curves int8`` adds the int8 curve beside three already run); the summary
takes every curve whose metrics are complete.

Each run is ``dataflow train`` (the command as a user types it, printed), one after the
other, in ``--runs`` (checkpoints stay there, outside git). The device's rules allow 9
minutes a call: the script stops itself before ``--minutes`` run out, sending the run
under way SIGTERM (the trainer finishes its step, writes a checkpoint and exits), and the
next call of the same command resumes it (``--resume auto``) and goes on with the rest; a
complete run is skipped. On an H100 at roughly 500k tok/s the default shape (32,768
tokens a step: batch 16 x seq 1024 x 2 rounds) takes about 66 ms a step, 2,000 steps
about 2.2 minutes a run: the four fit in two or three calls with the start of each run
(profiling, compiling, the graph capture; the int8 update runs as torch ops, tensor by
tensor, so its steps are slower)::

    source benchmarks/device_setup.sh && python -m benchmarks.bf16_update   # call 1
    source benchmarks/device_setup.sh && python -m benchmarks.bf16_update   # call 2, 3...

The checkpoints live in ``--runs`` on the device machine: the calls must come while it is
still held (a fresh machine starts the runs over). Where ``$OUT`` is set (the device
tool's folder that comes back), the results folder is copied into ``$OUT/bf16_update``
after each call.

(on the CPU, for a check of the script: ``--preset gpt2_tiny --steps 4 --device cpu
--batch 2 --seq-len 16 --ga-rounds 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.loss_plot import write_plot

RESULTS = Path("benchmarks/results/bf16_update")
#: the curves, in the order they run and are drawn: name -> its dtype options
CURVES = {
    "bf16-plain": ("--precision", "bf16-plain"),
    "bf16": ("--precision", "bf16"),
    "mixed": ("--precision", "mixed"),
    "int8": ("--dtype", "bf16", "--optimizer-states", "int8"),
}
#: bytes of AdamW state per parameter of each curve (docs/throughput.md; the int8 scales:
#: a float32 per 256 elements of each moment)
STATE_BYTES = {"bf16-plain": 4, "bf16": 6, "mixed": 12, "int8": 2 + 8 / 256}
#: seconds a cut run gets to write its checkpoint after SIGTERM
GRACE_S = 90


def train_command(args: argparse.Namespace, curve: str, folder: Path) -> list[str]:
    """The ``dataflow train`` of one curve: it resumes the newest checkpoint in ``folder``
    where there is one."""
    command = [
        "dataflow", "train", "--preset", args.preset, "--steps", str(args.steps),
        "--batch", str(args.batch), "--seq-len", str(args.seq_len),
        "--ga-rounds", str(args.ga_rounds), "--lr", str(args.lr), "--warmup", str(args.warmup),
        "--seed", "0", "--data", args.data, *CURVES[curve],
        "--checkpoint-every", str(args.checkpoint_every), "--keep", "1", "--out", str(folder),
    ]  # fmt: skip
    if args.device is not None:
        command += ["--device", args.device]
    if args.budget is not None:
        command += ["--budget", args.budget]
    return [*command, "--resume", "auto"]  # a fresh start where there is no checkpoint


def steps_done(folder: Path) -> int:
    """The last step ``folder``'s ``metrics.jsonl`` records (0: none)."""
    return last_step(folder / "metrics.jsonl")


def last_step(metrics: Path) -> int:
    """The last step a ``metrics.jsonl`` records (0: none, or no such file)."""
    if not metrics.is_file():
        return 0
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def run_until(command: list[str], deadline: float) -> bool:
    """Run ``command``; True when it ended by itself (its exit status checked), False when
    the deadline came first and it was stopped with SIGTERM (a checkpoint written)."""
    print("$ " + " ".join(command), flush=True)
    process = subprocess.Popen(command)
    try:
        status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return False
    if status != 0:
        raise SystemExit(f"bf16_update: {command[1]} exited with {status}")
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--ga-rounds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--data", default="embedded:python-stdlib")
    parser.add_argument("--device", default=None, help="default: dataflow train's (cuda)")
    parser.add_argument("--budget", default=None, help="default: dataflow train's")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bf16_update"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--curves",
        default=",".join(CURVES),
        help=f"the curves to run, comma-separated (default: all of {', '.join(CURVES)})",
    )
    parser.add_argument(
        "--minutes", type=float, default=8.5, help="stop (resumably) after this long"
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.curves.split(",") if c not in CURVES]
    if unknown:
        parser.error(f"--curves: {', '.join(unknown)}: each one of {', '.join(CURVES)}")
    try:
        run_all(args)
    finally:
        if os.environ.get("OUT"):  # the device tool brings $OUT back
            shutil.copytree(
                args.results, Path(os.environ["OUT"]) / "bf16_update", dirs_exist_ok=True
            )


def run_all(args: argparse.Namespace) -> None:
    """Each chosen curve's run to ``args.steps`` within the call's deadline, then the plot
    and the summary of every curve that is complete."""
    deadline = time.monotonic() + args.minutes * 60 - GRACE_S
    args.results.mkdir(parents=True, exist_ok=True)
    for curve in args.curves.split(","):
        folder = args.runs / curve
        if steps_done(folder) < args.steps:
            finished = run_until(train_command(args, curve, folder), deadline)
            shutil.copyfile(folder / "metrics.jsonl", args.results / f"{curve}.metrics.jsonl")
            if not finished:
                print(f"bf16_update: stopped {curve} at step {steps_done(folder)} to stay "
                      "within the call; run the same command again to resume it")  # fmt: skip
                return
        print(f"bf16_update: {curve} complete ({args.steps} steps)", flush=True)
        shutil.copyfile(folder / "metrics.jsonl", args.results / f"{curve}.metrics.jsonl")
    curves = {
        c: args.results / f"{c}.metrics.jsonl"
        for c in CURVES
        if last_step(args.results / f"{c}.metrics.jsonl") >= args.steps
    }
    write_plot(
        args.results / "loss.svg",
        curves,
        title=f"{args.preset}, {args.data}: loss by step",
    )
    summary = {c: summarize(path) for c, path in curves.items()}
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.results / "summary.md").write_text(markdown_table(summary))
    print(json.dumps(summary, indent=1))


def markdown_table(summary: dict[str, dict[str, float]], tail: int = 100) -> str:
    """The curves' ends as the Markdown table docs/throughput.md quotes: each curve's
    state bytes a parameter, last loss, mean and spread of the last ``tail`` losses, and
    its mean's distance from bf16-plain's in those spreads."""
    base = summary.get("bf16-plain")
    lines = [
        f"| curve | AdamW state B/param | last loss | mean of last {tail} | std of last {tail} "
        "| mean - bf16-plain's | median tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for curve, row in summary.items():
        mean, std = row[f"mean_loss_last_{tail}"], row[f"std_loss_last_{tail}"]
        delta = "" if base is None else f"{mean - base[f'mean_loss_last_{tail}']:+.4f}"
        lines.append(
            f"| {curve} | {STATE_BYTES[curve]:.4g} | {row['last_loss']:.4f} | {mean:.4f} | "
            f"{std:.4f} | {delta} | {row['median_tok_s']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def summarize(metrics: Path, tail: int = 100) -> dict[str, float]:
    """The last step's loss, the mean and standard deviation of the last ``tail`` steps'
    (the noise two runs' ends are compared within) and the median tok/s."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r["loss"] for r in rows[-tail:]]
    speeds = sorted(r["tok_s"] for r in rows[1:] if r.get("tok_s")) or [0.0]
    return {
        "steps": rows[-1]["step"],
        "last_loss": rows[-1]["loss"],
        f"mean_loss_last_{tail}": statistics.fmean(last),
        f"std_loss_last_{tail}": statistics.pstdev(last),
        "median_tok_s": speeds[len(speeds) // 2],
    }


if __name__ == "__main__":
    sys.exit(main())
