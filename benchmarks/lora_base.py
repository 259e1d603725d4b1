"""What a quantized LoRA base saves (docs/finetuning.md, "A base in 8 or 4 bits").

For each ``--lora-base`` (the run's bf16, ``int8``, ``nf4``), one LoRA step (rank 16,
bf16 weights and activations):

- ``llama3_tiny`` run on the CPU at one budget for 3 steps: the planned and the engine's
  measured fast peak, and the bytes moved over the host link in the last step (the
  engine's transfers) beside the plan's prediction;
- ``l3_1b`` planned on the CPU (roofline prices, nothing run) at one budget: the blocks'
  base bytes, the planned fast peak, the bytes the cyclic plan moves a step and its
  predicted step time.

    python -m benchmarks.lora_base            # writes results/lora_base.json and .md
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dataflow_training.drive.run import TrainingRun
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.step.config import DtypePolicy, OptimizerPolicy, TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.lora import LoraConfig

from dataflow import format_size

RESULTS = Path(__file__).parent / "results"
BASES = (None, "int8", "nf4")
#: llama3_tiny's step: 4 x 64 tokens; the budget about 60 % of the bf16 base's
#: unconstrained peak, so every base streams weights
TINY = {"seq_len": 64, "batch": 4, "rounds": 1}
TINY_BUDGET = 700_000
#: Llama 3.2 1B: 1 x 2048 tokens at 2 GiB
L1B = {"seq_len": 2048, "batch": 1, "rounds": 1}
L1B_BUDGET = 2 * 1024**3


def _train(shape: dict, base: str | None) -> TrainConfig:
    return TrainConfig(
        **shape,
        dtype=DtypePolicy.named("bf16"),
        optimizer=OptimizerPolicy(lr=1e-3),
        lora=LoraConfig(16, base=base),
    )


def _base_bytes(program) -> int:
    return sum(
        o.size_bytes for o in program.objects if o.id.startswith("W_") and o.id[2:].isdigit()
    )


def _planned(compiled) -> dict:
    plan = compiled.placement.plan
    cycle = plan.cycle
    return {
        "base_bytes": _base_bytes(compiled.program),
        "planned_fast_peak_bytes": plan.sim.fast_peak_bytes,
        # a steady-state step's: the cyclic check's iterations, averaged
        "planned_moved_bytes": (cycle.sim.h2d.bytes + cycle.sim.d2h.bytes) // cycle.iterations,
        "predicted_step_us": cycle.iteration_us,
    }


def tiny(base: str | None) -> dict:
    train = _train(TINY, base)
    compiled = compile_step(
        "llama3", "llama3_tiny", train, budget_bytes=TINY_BUDGET, cost=RooflineCost()
    )
    row = _planned(compiled)
    run = TrainingRun(compiled)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.vocab_size, (train.batch, train.seq_len + 1), generator=g)
    batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    losses = [run.step(batch).loss for _ in range(3)]
    last = run.last_result.steps[-1]
    row |= {
        "measured_fast_peak_bytes": run.last_result.fast_peak_bytes,
        "measured_moved_bytes": sum(t.size_bytes for t in last.transfers),
        "losses": losses,
    }
    run.close()
    return row


def l3_1b(base: str | None) -> dict:
    compiled = compile_step(
        "llama3", "l3_1b", _train(L1B, base), budget_bytes=L1B_BUDGET, cost=RooflineCost()
    )
    return _planned(compiled)


def main() -> None:
    rows = {"llama3_tiny": {}, "l3_1b": {}}
    for base in BASES:
        name = base or "bf16"
        rows["llama3_tiny"][name] = tiny(base)
        rows["l3_1b"][name] = l3_1b(base)
        print(name, rows["llama3_tiny"][name], rows["l3_1b"][name], flush=True)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "command": "python -m benchmarks.lora_base",
        "device": "cpu",
        "torch": torch.__version__,
        "tiny": {**TINY, "budget_bytes": TINY_BUDGET},
        "l3_1b": {**L1B, "budget_bytes": L1B_BUDGET},
    }
    (RESULTS / "lora_base.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "| model | base | base bytes | fast peak planned / measured | moved a step planned / "
        "measured | predicted step |",
        "|---|---|---|---|---|---|",
    ]
    for model, by_base in rows.items():
        for name, r in by_base.items():
            measured = r.get("measured_fast_peak_bytes")
            peak = format_size(r["planned_fast_peak_bytes"])
            moved = format_size(r["planned_moved_bytes"])
            if measured is not None:
                peak += f" / {format_size(measured)}"
                moved += f" / {format_size(r['measured_moved_bytes'])}"
            lines.append(
                f"| {model} | {name} | {format_size(r['base_bytes'])} | {peak} | {moved} | "
                f"{r['predicted_step_us'] / 1000:.3g} ms |"
            )
    (RESULTS / "lora_base.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
