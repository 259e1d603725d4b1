"""Probe, 2026-12-07 (session 43, not yet run): which tiny MoE runs of test_expert_shards turn NaN on CUDA?

Two gpu tests of ``plugins/training/tests/test_expert_shards.py`` failed on an H100 in
session 43 with the reference run's second-step losses NaN (olmoe_tiny's float32 saving
run at 2 shards; deepseek_v3_tiny's bf16 unsharded run), where the sharded runs beside
them were finite. Each configuration here runs three steps of two rounds (the tests'
shapes and seeds) with and without CUDA graphs, and prints its losses, the weights that
are not finite afterwards and the engine's graph note (with session 43's engine, a
failed capture names the task's own error):

    python -m benchmarks.probes.moe_nan [--families olmoe,deepseek_v3] [--pins "A;B"]

``--pins`` repeats every case under each ``DATAFLOW_KERNELS`` setting it lists (``;``
between settings, an empty one for the defaults), e.g. the rows ops' torch variants or
the expert-loop grouped GEMMs beside the defaults: which kernel the NaN follows.
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
from dataflow_training import TrainingRun
from dataflow_training.step.config import DtypePolicy, TrainConfig

PRESETS = {
    "olmoe": "olmoe_tiny",
    "deepseek_v3": "deepseek_v3_tiny",
    "qwen3_5_moe": "qwen3_5_moe_tiny",
}
BF16 = DtypePolicy("bfloat16", "bfloat16", "bfloat16")
#: (label, expert shards, TrainingRun.of options): the two failing tests' reference runs
#: and the sharded run beside each
CASES = (
    ("float32 saving, 2 shards", 2, {"recompute": False}),
    ("bf16 whole", 1, {"dtype": BF16}),
    ("bf16, 2 shards", 2, {"dtype": BF16}),
)


def batches(vocab: int, steps: int = 3, rounds: int = 2) -> list:
    """The tests' batches (``test_expert_shards._batches``: seed 5, (2, 8) tokens)."""
    g = torch.Generator().manual_seed(5)
    return [
        [
            tuple(torch.randint(0, vocab, (2, 8), generator=g) for _ in range(2))
            for _ in range(rounds)
        ]
        for _ in range(steps)
    ]


def one(family: str, shards: int, options: dict, graph: bool, device: str = "cuda") -> str:
    options = dict(options)
    dtype = options.pop("dtype", DtypePolicy())
    train = TrainConfig(seq_len=8, batch=2, rounds=2, dtype=dtype)
    run = TrainingRun.of(
        family, PRESETS[family], train, overrides={"expert_shards": shards}, budget_bytes=None,
        device=device, seed=1, graph=graph, **options,
    )  # fmt: skip
    losses = [run.step(b).losses for b in batches(run.vocab_size)]
    bad = [name for name, value in run.state()[0].items() if not torch.isfinite(value).all()]
    shown = [tuple(round(x, 4) for x in step) for step in losses]
    return f"losses {shown}; not finite after: {bad[:5]}; graph note: {run.graph_note}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="olmoe,deepseek_v3")
    p.add_argument("--device", default="cuda", help="cpu: a check of the probe itself")
    p.add_argument("--pins", default="", help="DATAFLOW_KERNELS settings, ';' between")
    args = p.parse_args()
    for pins in args.pins.split(";"):
        os.environ["DATAFLOW_KERNELS"] = pins  # read when each run loads its ops
        for family in args.families.split(","):
            for label, shards, options in CASES:
                for graph in (True, False):
                    try:
                        said = one(family, shards, options, graph, args.device)
                    except Exception:  # noqa: BLE001 - a probe reports every case
                        said = "raised:\n" + traceback.format_exc()
                    print(
                        f"{pins or 'defaults'} | {family} | {label} | graph {graph} | {said}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
