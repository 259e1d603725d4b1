"""Probe, 2026-12-07 (session 43; run in session 45): which tiny MoE runs of test_expert_shards turn NaN on CUDA?

Two gpu tests of ``plugins/training/tests/test_expert_shards.py`` failed on an H100 in
session 43 with the reference run's second-step losses NaN (olmoe_tiny's float32 saving
run at 2 shards; deepseek_v3_tiny's bf16 unsharded run), where the sharded runs beside
them were finite. Each configuration here runs three steps of two rounds (the tests'
shapes and seeds) with and without CUDA graphs, and prints its losses, the weights that
are not finite afterwards and the engine's graph note (with session 43's engine, a
failed capture names the task's own error):

    python -m benchmarks.probes.moe_nan [--families olmoe,deepseek_v3] [--pins "A;B"]

First, unless ``--no-kernels``, the MoE kernels alone on a caching allocator whose free
blocks hold NaN (a block freed by an earlier op holds anything; a fresh one reads as
zeros): the grouped GEMMs with an empty expert and rows past the last offset, and the
Triton row ops with NaN in the rows not valid, each against its reference; a kernel that
reads or leaves bytes it should not shows NaN here.

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


def poison_allocator(device: str) -> None:
    """Leave NaN in the caching allocator's free blocks of the sizes the checks take."""
    for n in (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20):
        for _ in range(4):
            junk = torch.full((n,), float("nan"), device=device)
            del junk


def kernel_checks(device: str) -> list[str]:
    """Each MoE kernel against its reference with NaN where nothing may be read."""
    from dataflow_kernels_torch import grouped, rows, triton_kernels

    g = torch.Generator().manual_seed(3)
    said = []

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def report(name, got, want):
        finite = bool(torch.isfinite(got).all())
        diff = (got.float() - want.float()).abs().max().item() if finite else float("nan")
        said.append(f"{name}: finite {finite}, max |diff| {diff:.3g}")

    for tail in (True, False):  # rows past the last offset (a shard's window), or none
        n, e = 64, 5
        ends = [0, 16, 16, 48, 48, 56 if tail else 64]
        offsets = torch.tensor(ends, device=device)
        x, dy, w = rand(n, 128), rand(n, 256), rand(e, 256, 128)
        x[ends[-1] :], dy[ends[-1] :] = float("nan"), float("nan")
        poison_allocator(device)
        y = grouped.grouped_mm_cuda(x, w, offsets)[: ends[-1]]
        report(
            f"grouped_mm (tail {tail})", y, grouped.grouped_mm_reference(x, w, offsets)[: ends[-1]]
        )
        poison_allocator(device)
        dw = grouped.grouped_mm_wgrad_cuda(dy, x, offsets)
        report(
            f"grouped_mm_wgrad, empty experts 1 and 3 (tail {tail})",
            dw,
            grouped.grouped_mm_wgrad_reference(dy, x, offsets),
        )
    r, hidden, tokens = 64, 128, 16
    valid = torch.arange(r, device=device) < 40
    into = torch.randint(0, tokens, (r,), generator=g).to(device)
    weights = rand(r, dtype=torch.float32)
    values = rand(r, hidden)
    values[~valid] = float("nan")
    poison_allocator(device)
    got = triton_kernels.rows_add_masked_triton(values, into, valid, weights, tokens)
    report(
        "rows_add_masked", got, rows.rows_add_masked_reference(values, into, valid, weights, tokens)
    )
    source = rand(tokens, hidden)
    index = torch.randperm(r, generator=g).to(device) % tokens
    poison_allocator(device)
    got = triton_kernels.rows_gather_masked_triton(source, index, valid)[valid]
    report("rows_gather_masked (valid rows)", got, source[index][valid])
    gate_up, d_act = rand(r, 2 * hidden), rand(r, hidden)
    gate_up[~valid], d_act[~valid] = float("nan"), float("nan")
    poison_allocator(device)
    act, d_gate_up, d_weights = triton_kernels.swiglu_rows_bwd_triton(
        gate_up, d_act, weights, valid
    )
    want = rows.swiglu_rows_bwd_reference(gate_up, d_act, weights, valid)
    for name, a, b in zip(
        ("act", "d_gate_up", "d_weights"), (act, d_gate_up, d_weights), want, strict=True
    ):
        report(f"swiglu_rows_bwd {name} (valid rows)", a[valid], b[valid])
    return said


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="olmoe,deepseek_v3")
    p.add_argument("--device", default="cuda", help="cpu: a check of the probe itself")
    p.add_argument("--pins", default="", help="DATAFLOW_KERNELS settings, ';' between")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel checks")
    args = p.parse_args()
    if not args.no_kernels:
        try:
            for line in kernel_checks(args.device):
                print(f"kernels | {line}", flush=True)
        except Exception:  # noqa: BLE001 - a probe reports and goes on
            print("kernels | raised:\n" + traceback.format_exc(), flush=True)
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
