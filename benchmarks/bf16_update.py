"""Does the compensated bf16 update lose nothing? Three loss curves of one model on real
text, same seed and data: ``--precision bf16-plain`` (bf16 weights and AdamW moments, the
update rounded), ``bf16`` (the same, the update's rounding compensated) and ``mixed``
(bf16 compute, float32 master weights and moments). Feeds docs/throughput.md ("A pure-bf16
update that loses nothing") and writes ``benchmarks/results/bf16_update/``: each run's
``<precision>.metrics.jsonl`` and ``loss.svg`` (``benchmarks.loss_plot``) once all are
complete.

Each run is ``dataflow train`` (the command as a user types it, printed), one after the
other, in ``--runs`` (checkpoints stay there, outside git). The device's rules allow 9
minutes a call: the script stops itself before ``--minutes`` run out, sending the run
under way SIGTERM (the trainer finishes its step, writes a checkpoint and exits), and the
next call of the same command resumes it (``--resume auto``) and goes on with the rest; a
complete run is skipped. On an H100 at roughly 500k tok/s the default shape (32,768
tokens a step: batch 16 x seq 1024 x 2 rounds) takes about 66 ms a step, 2,000 steps
about 2.2 minutes a run: the three fit in one or two calls with the start of each run
(profiling, compiling, the graph capture)::

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
#: the curves, in the order they run and are drawn
POLICIES = ("bf16-plain", "bf16", "mixed")
#: seconds a cut run gets to write its checkpoint after SIGTERM
GRACE_S = 90


def train_command(args: argparse.Namespace, policy: str, folder: Path) -> list[str]:
    """The ``dataflow train`` of one curve: it resumes the newest checkpoint in ``folder``
    where there is one."""
    command = [
        "dataflow", "train", "--preset", args.preset, "--steps", str(args.steps),
        "--batch", str(args.batch), "--seq-len", str(args.seq_len),
        "--ga-rounds", str(args.ga_rounds), "--lr", str(args.lr), "--warmup", str(args.warmup),
        "--seed", "0", "--data", args.data, "--precision", policy,
        "--checkpoint-every", str(args.checkpoint_every), "--keep", "1", "--out", str(folder),
    ]  # fmt: skip
    if args.device is not None:
        command += ["--device", args.device]
    if args.budget is not None:
        command += ["--budget", args.budget]
    return [*command, "--resume", "auto"]  # a fresh start where there is no checkpoint


def steps_done(folder: Path) -> int:
    """The last step ``metrics.jsonl`` records (0: none)."""
    metrics = folder / "metrics.jsonl"
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
        "--minutes", type=float, default=8.5, help="stop (resumably) after this long"
    )
    args = parser.parse_args(argv)
    try:
        run_all(args)
    finally:
        if os.environ.get("OUT"):  # the device tool brings $OUT back
            shutil.copytree(
                args.results, Path(os.environ["OUT"]) / "bf16_update", dirs_exist_ok=True
            )


def run_all(args: argparse.Namespace) -> None:
    """Each policy's run to ``args.steps`` within the call's deadline, then the plot."""
    deadline = time.monotonic() + args.minutes * 60 - GRACE_S
    args.results.mkdir(parents=True, exist_ok=True)
    for policy in POLICIES:
        folder = args.runs / policy
        if steps_done(folder) < args.steps:
            finished = run_until(train_command(args, policy, folder), deadline)
            shutil.copyfile(folder / "metrics.jsonl", args.results / f"{policy}.metrics.jsonl")
            if not finished:
                print(f"bf16_update: stopped {policy} at step {steps_done(folder)} to stay "
                      "within the call; run the same command again to resume it")  # fmt: skip
                return
        print(f"bf16_update: {policy} complete ({args.steps} steps)", flush=True)
        shutil.copyfile(folder / "metrics.jsonl", args.results / f"{policy}.metrics.jsonl")
    curves = {p: args.results / f"{p}.metrics.jsonl" for p in POLICIES}
    write_plot(
        args.results / "loss.svg",
        curves,
        title=f"{args.preset}, {args.data}: loss by step",
    )
    summary = {p: summarize(path) for p, path in curves.items()}
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


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
