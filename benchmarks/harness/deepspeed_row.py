"""The DeepSpeed ZeRO-Offload row of benchmarks/compare.py: stage 2, AdamW on the CPU.

    python -m benchmarks.harness.deepspeed_row --out /tmp/deepspeed_row.json

One process, no launcher: the rendezvous is local (``MASTER_ADDR=127.0.0.1``, a free
port, rank 0 of 1), ``deepspeed.init_distributed`` then ``deepspeed.initialize`` with a
config dict. The model is benchmarks/harness/stock.py's GPT-2 (same math as every other row); the
optimizer is DeepSpeed's ``AdamW`` (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
matrices), which ZeRO-Offload runs as its CPU Adam op over float32 master weights in host
memory, while the GPU holds bf16 weights, activations and gradients (``"bf16":
{"enabled": true}``). The CPU Adam op is compiled on first use (a JIT C++ build with ninja
and the host compiler); when DeepSpeed is missing or the op does not build, the row says
so in its ``note``.

Batches are searched like the stock rows (largest first, stop once a smaller batch is
3 % slower). The row and its details are written to ``--out`` as
``{"row": {...}, "details": {...}}``; compare.py merges them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.compare_doc import make_row, searched_row
from benchmarks.harness.measure import (
    BatchSearch,
    RowTimeout,
    flops_per_token,
    measure_trial,
    one_line,
    time_limit,
)
from benchmarks.harness.stock import StockGPT2, _decay_groups

ENGINE, DTYPE = "deepspeed zero-offload", "bf16+fp32-master"


def local_rendezvous() -> None:
    """Rank 0 of a world of 1 on this host, on a free port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(name, value)


def ds_config(batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def trial(deepspeed: Any, config: Any, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """One batch: initialize the engine, warm up, measure, profile one more step."""
    torch.manual_seed(0)
    model = StockGPT2(
        config.vocab_size, config.n_positions, config.n_embd, config.n_layer, config.n_head
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=_decay_groups(model, 0.1), config=ds_config(batch)
    )
    generator = torch.Generator().manual_seed(0)
    data = [
        tuple(
            torch.randint(0, config.vocab_size, (batch, args.seq_len), generator=generator).to(
                engine.device
            )
            for _ in range(2)
        )
        for _ in range(4)
    ]

    def step(i: int) -> None:
        tokens, targets = data[i % len(data)]
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()

    try:
        return measure_trial(step, batch, args.seq_len, args.warmup, args.steps, args.device)
    finally:
        engine.destroy()


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The row and its details (a row with a note when DeepSpeed cannot run here)."""
    from dataflow.plugins import families

    config = families().get(args.family).load().config(args.preset)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    flops = {"flops_token": flops_per_token(config, args.seq_len), "peak": peak}
    try:
        import deepspeed
    except Exception as exc:  # not carried here, or its import fails: the row says so
        note = f"DeepSpeed cannot be imported here ({one_line(exc, 200)}); carry its wheels"
        return make_row(args.preset, ENGINE, DTYPE, None, note=note), {}
    local_rendezvous()
    backend = "nccl" if torch.device(args.device).type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    search, note = BatchSearch(args.batches, args.full_search), None

    def cleanup() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def will_repeat(exc: Exception) -> bool:  # the CPU Adam op does not build
        return "cpu_adam" in str(exc) or "building extension" in str(exc)

    try:
        with time_limit(args.seconds):
            search.run(lambda batch: trial(deepspeed, config, args, batch), cleanup, will_repeat)
    except RowTimeout as exc:
        note = f"{exc} reached in the batch search (finished: {list(search.tried)})"
    row, details = searched_row(args.preset, ENGINE, DTYPE, search, args.seq_len, note, **flops)
    return row, details | {"deepspeed": deepspeed.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="gpt2")
    p.add_argument("--preset", default="gpt2_124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--batches", type=lambda t: [int(b) for b in t.split(",") if b], default=[8, 16, 32, 64]
    )
    p.add_argument("--full-search", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seconds", type=float, default=180.0, help="time limit of the search")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    row, details = measure(args)
    args.out.write_text(json.dumps({"row": row, "details": details}, indent=1) + "\n")
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
