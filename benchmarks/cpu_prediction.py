"""The plan line's prediction on a CPU against the speed the run then measures.

    python -m benchmarks.cpu_prediction --out benchmarks/results/cpu_prediction.json

Each cell is the README main job (``dataflow train --preset gpt2_tiny ... --device cpu``)
with its shape and budget changed, run as a user runs it, in a profile cache of its own:

1. the step priced in this process by ``price_step`` with the cache empty (the quick
   profile: ``profile_s``), then again from the cache (``cached_s``); the step's tasks
   have run once before either, so torch's first-use start-up (seconds on a loaded
   machine, paid by a run's first step either way) is not counted;
2. ``dataflow train`` run twice in that cache (the profile, then reading it): each run's
   plan line (its predicted s/step) and the median of its measured step times after the
   first ``WARMUP_STEPS`` (``metrics.jsonl``'s ``step_s``); ``ratio`` is measured over
   predicted.

The machine's load is recorded beside every cell (``loadavg``): on a shared CPU the
measured steps, and the profile, are only as steady as the other processes are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from dataflow_training.drive.options import TrainOptions
from dataflow_training.plan.pricing import price_step
from dataflow_training.plan.profile import profile_program
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

from dataflow import parse_size, resolvers

#: the README main job, less its steps and output folder
MAIN_JOB = "dataflow train --preset gpt2_tiny --lr 2e-3 --warmup 20 --device cpu"
#: (name, extra options, budget): the main job's shape and budget, then larger shapes
CELLS = (
    ("main job", [], "2MiB"),
    ("batch 32", ["--batch", "32"], "8MiB"),
    ("batch 32, seq 128", ["--batch", "32", "--seq-len", "128"], "64MiB"),
)
#: steps whose times are not counted (the first ones start torch and the engine)
WARMUP_STEPS = 5
_PREDICTED = re.compile(r"predicted ([0-9.e+-]+) s/step")


def price_times(extra: list[str], budget: str) -> tuple[float, float, int]:
    """(profile_s, cached_s, signatures): ``price_step`` of the cell's step with the
    profile cache (``$DATAFLOW_PROFILE_CACHE``) empty, then from it."""
    options = dict(zip(extra[::2], extra[1::2], strict=True))
    o = TrainOptions(
        family="gpt2",
        preset="gpt2_tiny",
        steps=1,
        out=Path(tempfile.gettempdir()),
        batch=int(options.get("--batch", 8)),
        seq_len=int(options.get("--seq-len", 64)),
        budget_bytes=parse_size(budget),
        overrides={"vocab_size": 256},  # the embedded corpus' bytes
    )
    family = load_family("gpt2")
    step = lower(family, o.preset, o.train_config(family), overrides=o.overrides)
    # torch's first use of each op, as a run's first step pays it: not the profile's
    profile_program(step, resolvers().get("torch").build(step), device="cpu", repeats=1)
    began = time.perf_counter()
    price_step(step, "torch", device="cpu", search=True)
    profile_s = time.perf_counter() - began
    began = time.perf_counter()
    price_step(step, "torch", device="cpu", search=True)
    cached_s = time.perf_counter() - began
    return profile_s, cached_s, len(list(Path(os.environ["DATAFLOW_PROFILE_CACHE"]).iterdir()))


def run_job(extra: list[str], budget: str, steps: int, folder: Path) -> dict:
    """One ``dataflow train`` run of the cell: its predicted and measured step times."""
    command = [*MAIN_JOB.split(), *extra, "--budget", budget, "--steps", str(steps)]
    command += ["--out", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    plan = next(line for line in done.stdout.splitlines() if line.startswith("plan: "))
    predicted = float(_PREDICTED.search(plan).group(1))
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_s"] for line in lines][WARMUP_STEPS:]
    measured = statistics.median(times)
    return {
        "command": " ".join(command),
        "plan": plan,
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "ratio": measured / predicted,
        "loadavg": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_prediction.json"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for name, extra, budget in CELLS:
        with tempfile.TemporaryDirectory() as scratch:
            os.environ["DATAFLOW_PROFILE_CACHE"] = str(Path(scratch) / "profiles")
            profile_s, cached_s, entries = price_times(extra, budget)
            for entry in Path(os.environ["DATAFLOW_PROFILE_CACHE"]).iterdir():
                entry.unlink()  # the first run profiles again, in its own process
            runs = [run_job(extra, budget, args.steps, Path(scratch) / f"run{i}") for i in (1, 2)]
        row = {"cell": name, "budget": budget, "profile_s": profile_s, "cached_s": cached_s}
        row |= {"cache_entries": entries, "runs": runs}
        rows.append(row)
        print(
            f"{name}: profile {profile_s:.2f} s (cached {cached_s:.3f} s); "
            + "; ".join(
                f"predicted {r['predicted_step_s']:.4f} s, measured {r['measured_step_s']:.4f} s "
                f"(x{r['ratio']:.2f}, load {r['loadavg']:.1f})"
                for r in runs
            ),
            flush=True,
        )
    machine = {
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
