"""Training throughput of GPT-2 124M: stock PyTorch, DeepSpeed ZeRO-Offload and dataflow
inside fast-memory budgets, in one run on one GPU (issue 13).

    python -m benchmarks.compare --rows stock                       # about 5 minutes on an H200
    python -m benchmarks.compare --rows dataflow,deepspeed --append # adds to the same JSON
    python -m benchmarks.compare --table-only                       # JSON -> docs/throughput.md

Same math everywhere: GPT-2 (``--preset``), sequence ``--seq-len``, random tokens, AdamW
(lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices), full-vocabulary cross
entropy. Rows:

- **stock**: PyTorch eager and ``torch.compile``, each with bf16 autocast over float32
  master weights (``autocast``) and all in bfloat16 (``bf16``: weights, gradients, AdamW
  state), SDPA and ``AdamW(fused=True)`` (``benchmarks/harness/stock.py``), with the
  tricks a user applies (``StockTricks``: the vocabulary padded to a multiple of
  ``--stock-vocab-multiple``, 64 as nanoGPT's, the logits sliced back; TF32 unless
  ``--stock-no-tf32``; ``--stock-compile-mode``; ``--stock-ce``), each at the fastest
  batch of ``--batches`` that fits (largest first; an out-of-memory batch is skipped; the
  search stops once a smaller batch runs more than 3 % slower than the best, unless
  ``--full-search``); then the fastest of those four with every block under
  ``torch.utils.checkpoint``.
- **deepspeed**: ZeRO-Offload (stage 2, AdamW on the CPU), ``benchmarks/harness/deepspeed_row.py``
  in a child process, or a row whose note says why it could not run.
- **dataflow**: ``TrainingRun`` on the device at each of ``--budgets``, at least
  ``--min-tokens`` tokens per step (batch x accumulation rounds x seq-len), with the dtype
  policy nearest the fastest stock row and with pure bf16 (``--dataflow-dtypes``). The
  (batch, rounds) of each budget: every batch of ``--dataflow-batches`` is lowered and
  planned at the budget with roofline costs; they run in the order of the plans' predicted
  speed (larger batch first among those within 2 %) until one runs
  (``--dataflow-batch-order given``: in the order given, not planned first).

**LoRA** (``--mode lora --lora-rank 16``, issue 48): the same command fine-tunes instead
(every row ``"mode": "lora"``, rated against the stock LoRA row of its model and length).
The stock row is the family's ``transformers`` model under PEFT LoRA (rank, alpha
``--lora-alpha``, default twice the rank, on the projections dataflow adapts), compiled,
``AdamW(fused=True)`` over the adapters (``benchmarks/harness/stock_lora.py``), at the
fastest batch of ``--batches``; the dataflow rows train ``TrainConfig(lora=LoraConfig(rank,
alpha))`` at each budget, their details holding the host memory they took (the pinned slow
pool, the process's resident peak). No checkpointing or DeepSpeed row in this mode. MFU
counts a LoRA step's FLOPs: ``4 N + 6 N_A + 12 L a T`` (no weight gradient of the frozen
base; ``N_A`` the adapters' parameters).

    python -m benchmarks.compare --mode lora --lora-rank 16 --family llama3 --preset llama3_8b \
        --seq-len 4096 --budgets 16GiB,8GiB --append    # benchmarks/model_rows.sh llama3_8b_lora

Each row has a time limit (``--row-seconds``, compile rows ``--compile-row-seconds``) and
the whole command one (``--total-seconds``); a row that meets it keeps what it measured,
with a note. The JSON is written after every row, so a killed run keeps its rows;
``--append`` merges into the existing file and skips rows it already holds (``--redo``
runs them again). docs/throughput.md says what each field means.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from dataflow_training.step.config import UPDATES, parse_order
from dataflow_training.step.lora import LoraConfig, LoraError

from benchmarks.harness import ROOT
from benchmarks.harness.compare_doc import (
    MODES,
    finish,
    load_doc,
    make_row,
    row_key,
    save_doc,
    searched_row,
    write_table,
)
from benchmarks.harness.measure import (
    PEAK_SOURCE,
    BatchSearch,
    RowTimeout,
    attention_flops_per_token,
    device_name,
    flops_per_token,
    link_bandwidth,
    matmul_params,
    measure_trial,
    peak_flops,
    time_limit,
)
from benchmarks.harness.stock import (
    COMPILE_MODES,
    FUSED_CE,
    StockTricks,
    build_stock,
    is_gpt2,
    stock_settings,
)
from dataflow.units import parse_size

DTYPES = {
    "autocast": "stock: bf16 autocast over float32 master weights; float32 grads and AdamW state",
    "bf16": "weights, grads and AdamW state in bfloat16; bf16 compute",
    "mixed": (
        "dataflow: bf16 weights and activations, float32 grads and AdamW state (the nearest "
        "dataflow policy to autocast: dataflow keeps no float32 master copy of the weights)"
    ),
    "bf16-int8": (
        "dataflow: weights, grads and activations in bfloat16, AdamW's moments block-wise in "
        "8 bits (`dataflow train --optimizer-states int8`)"
    ),
    "bf16+fp32-master": (
        "DeepSpeed bf16: bf16 weights, activations and grads on the GPU; float32 master "
        "weights and AdamW state in host memory"
    ),
}
#: the dataflow dtype policy nearest each stock one
MATCHING_DATAFLOW = {"autocast": "mixed", "bf16": "bf16"}
ROWS = ("stock", "dataflow", "deepspeed")
#: the rows each ``--mode`` can run (its default ``--rows``)
MODE_ROWS = {"full": ROWS, "lora": ("stock", "dataflow")}
FLOP_FORMULAS = {
    "full": (
        "6 * N + 12 * L * a * T per token (N: parameters in matrix products: all but "
        "a position embedding and an untied token embedding, routed experts at their "
        "active share k / E; L layers; a the attention width; T seq_len); "
        "MFU = tok/s x this / peak"
    ),
    "lora": (
        "4 * N + 6 * N_A + 12 * L * a * T per token (N as for full training, whose weights "
        "get no gradient: forward and the input's gradient; N_A the adapters' parameters, "
        "rank x (in + out) of each adapted projection)"
    ),
}
DEEPSPEED = ("deepspeed zero-offload", "bf16+fp32-master")
STOCK_ENGINES = ("eager", "compile")


def free_device(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


class Bench:
    """One invocation: the options, the model's FLOPs, the results document (written after
    every row)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from dataflow.plugins import families

        self.args = args
        self.family = families().get(args.family).load()
        self.model = args.preset
        self.config = self.family.config(args.preset)
        self.flops_token = flops_per_token(self.config, args.seq_len)
        #: the same with attention counted causally (half the keys a query scores)
        self.causal_saving = attention_flops_per_token(self.config, args.seq_len) / 2
        #: the adapters of ``--mode lora`` (None: full training)
        self.lora = LoraConfig(args.lora_rank, args.lora_alpha) if args.mode == "lora" else None
        if self.lora is not None:
            from benchmarks.harness.stock_lora import adapter_params

            adapters = adapter_params(self.family, self.config, self.lora.rank)
            full = self.flops_token
            self.flops_token = full - 2.0 * matmul_params(self.config) + 6.0 * adapters
        self.device_name = device_name(args.device)
        self.peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(self.device_name)
        self.deadline = time.monotonic() + args.total_seconds
        self.mark = time.monotonic()  # when the last row was recorded
        self.doc = load_doc(args.out) if args.append else {"rows": [], "meta": {"models": {}}}
        self.details: dict[str, Any] = self.doc["meta"].setdefault("row_details", {})
        self.tricks = stock_tricks(args)
        self.describe()

    # -- bookkeeping ---------------------------------------------------------------------
    def row_kwargs(self) -> dict[str, Any]:
        return {"flops_token": self.flops_token, "peak": self.peak}

    def free(self) -> None:
        free_device(self.args.device)

    def have(self, engine: str, dtype: str, budget: int | None) -> bool:
        """Whether the document already holds this row measured (``--append``)."""
        key = row_key(
            make_row(
                self.model, engine, dtype, budget, seq_len=self.args.seq_len, mode=self.args.mode
            )
        )
        return not self.args.redo and any(
            row_key(r) == key and r["tok_s"] is not None for r in self.doc["rows"]
        )

    def limit(self, seconds: float) -> float:
        """A row's time limit: its own, or what the whole command has left."""
        return min(seconds, self.deadline - time.monotonic())

    def record(self, row: dict[str, Any], details: dict[str, Any]) -> None:
        if row["seq_len"] is None:  # every row of this command trains at --seq-len
            row["seq_len"] = self.args.seq_len
        row["mode"] = self.args.mode  # and in --mode
        key = row_key(row)
        now = time.monotonic()
        spent, self.mark = now - self.mark, now
        self.doc["rows"] = [r for r in self.doc["rows"] if row_key(r) != key] + [row]
        self.details[key] = details | {"row_wall_s": round(spent, 1)} | self.causal_mfu(row)
        finish(self.doc)
        save_doc(self.args.out, self.doc)
        fields = ("model", "engine", "dtype", "budget_bytes", "batch", "tok_s", "note")
        shown = {k: row[k] for k in fields}
        shown["row_wall_s"] = round(spent, 1)
        print(json.dumps(shown), flush=True)

    def causal_mfu(self, row: dict[str, Any]) -> dict[str, float]:
        """``mfu_causal``: the row's MFU with the attention FLOPs counted causally (the
        long-context rows' figure; ``mfu`` keeps the PaLM convention), where it has one."""
        if not row["tok_s"] or not self.peak:
            return {}
        return {"mfu_causal": row["tok_s"] * (self.flops_token - self.causal_saving) / self.peak}

    def skipped(self, engine: str, dtype: str, budget: int | None) -> bool:
        """Record a not-run row when the command's time is spent; True if so."""
        if self.deadline - time.monotonic() > 5:
            return False
        note = "not run: the command's --total-seconds were spent; run it again with --append"
        self.record(make_row(self.model, engine, dtype, budget, note=note), {})
        return True

    def fastest_stock(self, engines: list[str] | None = None) -> dict[str, Any] | None:
        """This model's fastest measured row without a budget (of ``engines``, when
        given)."""
        rows = [
            r
            for r in self.doc["rows"]
            if r["model"] == self.model
            and r["budget_bytes"] is None
            and r["tok_s"]
            and r["mode"] == self.args.mode
            and r["seq_len"] == self.args.seq_len
        ]
        rows = [r for r in rows if engines is None or r["engine"] in engines]
        return max(rows, key=lambda r: r["tok_s"], default=None)

    def describe(self) -> None:
        """The document's meta: this device and run, the dtypes, and this model's entry
        (family, sequence length, FLOP formula and peak, the run that measured it)."""
        meta, args = self.doc["meta"], self.args
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        run = {"date": date, "device": self.device_name, "torch": torch.__version__}
        meta.setdefault("runs", []).append(run | {"argv": sys.argv[1:]})
        meta |= run | {
            "flop_formula": FLOP_FORMULAS["full"],
            "link": link_bandwidth(args.device),
            "dtypes": DTYPES,
            "stock_tricks": self.tricks.described(),
        }
        model = run | {
            "family": args.family,
            "preset": args.preset,
            "peak_flops": self.peak,
            "peak_source": "--peak-tflops" if args.peak_tflops else self.peak and PEAK_SOURCE,
        }
        shape = {"seq_len": args.seq_len, "flops_per_token": self.flops_token}
        models = meta.setdefault("models", {})
        if self.lora is None:  # written anew, keeping the other modes' entries
            other = {k: v for k, v in models.get(self.model, {}).items() if k in MODES}
            models[self.model] = other | model | shape
        else:  # the model's full-training entry stays; this mode's goes under its name
            mode = shape | {
                "flop_formula": FLOP_FORMULAS[args.mode],
                "adapters": {"rank": self.lora.rank, "alpha": self.lora.lora_alpha},
            }
            models[self.model] = models.get(self.model, {}) | model | {args.mode: mode}
        if len({r["device"] for r in meta["runs"]}) > 1:
            meta["warning"] = "rows come from runs on different devices: compare with care"

    def model_meta(self) -> dict[str, Any]:
        """This model's entry of ``meta.models`` for this command's mode (a LoRA run's is
        the ``lora`` entry inside it)."""
        entry = self.doc["meta"]["models"][self.model]
        return entry if self.lora is None else entry[self.args.mode]

    # -- stock ---------------------------------------------------------------------------
    def stock_rows(self) -> None:
        """Eager and compile x autocast and bf16, then the fastest with checkpointing (not
        under ``--mode lora``). Where no batch of those fit (a 14B model, a long sequence),
        checkpointing is what a user turns to: the last engine given (compile) in the first
        dtype, over every batch."""
        args = self.args
        if not args.only_checkpoint_row:
            for engine in args.stock_engines:
                for dtype in args.stock_dtypes:
                    self.stock_row(engine, dtype, checkpoint=False)
        if self.lora is not None or args.no_checkpoint_row:
            return
        plain = [f"pytorch {engine}" for engine in STOCK_ENGINES]
        fastest = self.fastest_stock(plain)
        if fastest is None:
            engine, dtype = args.stock_engines[-1], args.stock_dtypes[0]
            self.stock_row(engine, dtype, checkpoint=True)
            return
        engine = fastest["engine"].removeprefix("pytorch ")
        # checkpointing only frees memory: batches below the fastest one's are slower
        batches = [b for b in args.batches if b >= fastest["batch"]]
        self.stock_row(engine, fastest["dtype"], checkpoint=True, batches=batches)

    def stock_row(
        self, engine: str, dtype: str, *, checkpoint: bool, batches: list[int] | None = None
    ) -> None:
        name = f"pytorch {engine}" + (" + checkpointing" if checkpoint else "")
        if self.have(name, dtype, None) or self.skipped(name, dtype, None):
            return
        args = self.args
        seconds = args.compile_row_seconds if engine == "compile" else args.row_seconds
        search, note = BatchSearch(args.batches, args.full_search), None
        try:
            with time_limit(self.limit(seconds)):
                search.run(
                    lambda batch: self.stock_trial(engine, dtype, checkpoint, batch), self.free
                )
        except RowTimeout as exc:
            note = f"{exc} reached in the batch search (finished: {list(search.tried)})"
            self.free()
        row, details = searched_row(
            self.model, name, dtype, search, args.seq_len, note, **self.row_kwargs()
        )
        if self.lora is None:
            details["stock_tricks"] = self.tricks.described()
        else:  # the transformers model: no padded vocabulary or fused loss of its own
            details["stock_tricks"] = {
                "tf32": self.tricks.tf32,
                "compile_mode": self.tricks.compile_mode,
            }
            details["peft"] = self.peft_details()
        self.record(row, details)

    def peft_details(self) -> dict[str, Any]:
        """What the stock LoRA rows train: PEFT's version and adapters."""
        import peft

        return {
            "peft": peft.__version__,
            "rank": self.lora.rank,
            "alpha": self.lora.lora_alpha,
            "dropout": 0.0,
            "adapters_dtype": "the base's (autocast_adapter_dtype=False)",
            "model": self.family.hf_class,
            "attention": "sdpa",
        }

    def stock_trial(self, engine: str, dtype: str, checkpoint: bool, batch: int) -> dict:
        """One batch: build, warm up (compiles), measure, profile one more step."""
        args = self.args
        if self.lora is not None:
            return self.stock_lora_trial(engine, dtype, batch)
        with stock_settings(self.tricks):
            step = build_stock(
                self.config,
                batch,
                args.seq_len,
                compile=engine == "compile",
                dtype=dtype,
                checkpoint=checkpoint,
                device=args.device,
                compile_backend=args.compile_backend,
                tricks=self.tricks,
            )
            return measure_trial(step, batch, args.seq_len, args.warmup, args.steps, args.device)

    def stock_lora_trial(self, engine: str, dtype: str, batch: int) -> dict:
        """One batch of the stock LoRA row (``harness/stock_lora.py``)."""
        from benchmarks.harness.stock_lora import build_stock_lora

        args = self.args
        with stock_settings(self.tricks):
            step, _ = build_stock_lora(
                self.family,
                self.config,
                batch,
                args.seq_len,
                rank=self.lora.rank,
                alpha=self.lora.lora_alpha,
                compile=engine == "compile",
                dtype=dtype,
                device=args.device,
                compile_backend=args.compile_backend,
                compile_mode=self.tricks.compile_mode,
            )
            return measure_trial(step, batch, args.seq_len, args.warmup, args.steps, args.device)

    # -- deepspeed -----------------------------------------------------------------------
    def deepspeed_rows(self) -> None:
        """``python -m benchmarks.harness.deepspeed_row`` in a child process, from the
        repository root (DeepSpeed sets up torch.distributed and builds its CPU Adam op:
        kept out of this process)."""
        engine, dtype = DEEPSPEED
        if self.have(engine, dtype, None) or self.skipped(engine, dtype, None):
            return
        args = self.args
        if not is_gpt2(self.config):
            note = "not run: deepspeed_row.py trains benchmarks/harness/stock.py's GPT-2 only"
            self.record(make_row(self.model, engine, dtype, None, note=note), {})
            return
        seconds = self.limit(args.deepspeed_seconds)
        out = args.out.with_name(args.out.stem + "_deepspeed_row.json")
        command = [
            *(sys.executable, "-m", "benchmarks.harness.deepspeed_row"),
            *("--family", args.family, "--preset", args.preset),
            *("--seq-len", str(args.seq_len), "--device", args.device),
            *("--batches", ",".join(map(str, args.batches))),
            *("--steps", str(args.steps), "--warmup", str(args.warmup)),
            *("--seconds", f"{max(1.0, seconds - 15):.0f}", "--out", str(out.resolve())),
        ]
        if args.full_search:
            command.append("--full-search")
        if self.peak:
            command += ["--peak-tflops", str(self.peak / 1e12)]
        out.unlink(missing_ok=True)
        try:
            done = subprocess.run(
                command, timeout=seconds, capture_output=True, text=True, cwd=ROOT
            )
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            tail, returncode = [f"killed at the row's time limit of {seconds:.0f} s"], None
        if out.exists():
            result = json.loads(out.read_text())
            out.unlink()
            self.record(result["row"], result["details"])
            return
        note = "deepspeed_row.py wrote no row: " + " | ".join(tail)
        row = make_row(self.model, engine, dtype, None, note=note[:600])
        self.record(row, {"returncode": returncode})

    # -- dataflow ------------------------------------------------------------------------
    def dataflow_dtypes(self) -> list[str]:
        """``auto``: the policy nearest the fastest stock row (when one is known), then
        pure bf16; both dataflow policies when no stock row is known."""
        if self.args.dataflow_dtypes != ["auto"]:
            return self.args.dataflow_dtypes
        fastest = self.fastest_stock()
        matching = MATCHING_DATAFLOW.get(fastest["dtype"]) if fastest else None
        self.model_meta()["dataflow_matches"] = (
            {"fastest_stock": row_key(fastest), "dataflow_dtype": matching} if matching else None
        )
        if matching is None:
            return ["mixed", "bf16"]
        return [matching] if matching == "bf16" else [matching, "bf16"]

    def dataflow_rows(self) -> None:
        from benchmarks.harness.compare_dataflow import dataflow_row

        for dtype in self.dataflow_dtypes():
            for budget in self.args.budgets:
                for order in self.args.dataflow_orders:
                    dataflow_row(self, dtype, budget, order)


def stock_tricks(args: argparse.Namespace) -> StockTricks:
    """The stock rows' ``StockTricks`` from the ``--stock-*`` options."""
    return StockTricks(
        vocab_multiple=args.stock_vocab_multiple,
        tf32=not args.stock_no_tf32,
        compile_mode=args.stock_compile_mode,
        fused_ce=args.stock_ce,
    )


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _words(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        words = [part for part in text.split(",") if part]
        unknown = [w for w in words if w not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(known)}")
        return words

    return parse


def _orders(text: str) -> list[str]:
    words = [part for part in text.split(",") if part]
    try:
        for word in words:
            parse_order(word)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return words


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rows",
        type=_words(ROWS),
        default=None,
        help="stock,dataflow,deepspeed (--mode lora: stock,dataflow; the default: all of the mode's)",
    )
    p.add_argument(
        "--mode",
        choices=MODES[:2],
        default="full",
        help="full: pretraining's step; lora: LoRA adapters on a frozen base (--lora-rank)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="--mode lora: the adapters' rank")
    p.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="--mode lora: the adapters' alpha (default twice the rank: scale 2, as dataflow "
        "train --lora)",
    )
    p.add_argument("--budgets", default="16GiB,8GiB,4GiB,2GiB,1GiB", help="dataflow budgets")
    p.add_argument("--family", default="gpt2")
    p.add_argument("--preset", default="gpt2_124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batches", type=_ints, default=[8, 16, 32, 64], help="stock batch search")
    p.add_argument("--full-search", action="store_true", help="try every stock batch")
    checkpoint = p.add_mutually_exclusive_group()
    checkpoint.add_argument(
        "--no-checkpoint-row",
        action="store_true",
        help="skip the stock row with activation checkpointing",
    )
    checkpoint.add_argument(
        "--only-checkpoint-row",
        action="store_true",
        help="the stock row with activation checkpointing alone (the last engine and first "
        "dtype given), e.g. at a sequence no plain stock batch fits",
    )
    p.add_argument("--stock-engines", type=_words(STOCK_ENGINES), default=list(STOCK_ENGINES))
    p.add_argument(
        "--stock-dtypes", type=_words(("autocast", "bf16")), default=["autocast", "bf16"]
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--stock-vocab-multiple",
        type=int,
        default=64,
        help="stock rows: the vocabulary's rows padded to a multiple of this (nanoGPT's 64; "
        "1: as it is)",
    )
    p.add_argument(
        "--stock-no-tf32", action="store_true", help="stock rows: leave TF32 matmuls off"
    )
    p.add_argument(
        "--stock-compile-mode",
        default=None,
        choices=COMPILE_MODES[1:],
        help="stock compile rows: torch.compile's mode (its compile takes many minutes)",
    )
    p.add_argument(
        "--stock-ce",
        default="auto",
        choices=FUSED_CE,
        help="stock rows' loss: cce (cut_cross_entropy's fused linear cross-entropy), torch "
        "(matmul + F.cross_entropy), auto (cce where installed)",
    )
    p.add_argument(
        "--dataflow-dtypes",
        type=_words(("auto", "mixed", "bf16", "bf16-int8")),
        default=["auto"],
        help="auto: nearest the fastest stock row, then bf16; bf16-int8: bf16 with AdamW's "
        "moments in 8 bits",
    )
    p.add_argument("--dataflow-batches", type=_ints, default=[64, 32, 16, 8, 4, 2, 1])
    p.add_argument(
        "--dataflow-batch-order",
        choices=("roofline", "given"),
        default="roofline",
        help="roofline: try --dataflow-batches in the order of their roofline plans' speed; "
        "given: in the order given (shapes chosen from measured profiles on the host, e.g. "
        "by place_llama3_8b.py, where the roofline misranks them)",
    )
    p.add_argument(
        "--dataflow-orders",
        type=_orders,
        default=["round"],
        help="the dataflow rows' task orders, e.g. round,layer,layer:4 (TrainConfig.order; "
        "a layer-order row's engine is 'dataflow by layer', 'dataflow by layer:4')",
    )
    p.add_argument("--min-tokens", type=int, default=65536, help="dataflow tokens per step")
    p.add_argument(
        "--head-vocab-tiles",
        action="store_true",
        help="dataflow rows: the head's weight gradient by vocabulary tiles "
        "(TrainConfig.head_vocab_tiles)",
    )
    p.add_argument(
        "--head-accumulate",
        choices=["float32", "gradient"],
        default="float32",
        help="dataflow rows: how the head sums its weight gradient over chunks "
        "(TrainConfig.head_accumulate)",
    )
    p.add_argument(
        "--block-row-groups",
        type=int,
        default=1,
        help="dataflow rows: each block task over the batch in N groups of sequences "
        "(TrainConfig.block_row_groups)",
    )
    p.add_argument(
        "--vocab-pieces",
        type=int,
        default=1,
        help="dataflow rows: the vocabulary tables in row pieces (TrainConfig.vocab_pieces)",
    )
    p.add_argument(
        "--expert-shards",
        type=int,
        default=0,
        help="dataflow rows: each layer's routed experts in N shards (the model override "
        "expert_shards, kit.moe.expert_shards; 0: the preset's)",
    )
    p.add_argument(
        "--updates",
        default="auto",
        choices=UPDATES,
        help="dataflow rows: where the optimizer's updates run (TrainConfig.updates)",
    )
    p.add_argument("--resolver", default="torch", help="dataflow resolver")
    p.add_argument(
        "--backing",
        default=None,
        help="dataflow: pinned host memory the slow pool may take (the plan's slow budget)",
    )
    p.add_argument(
        "--host-reserve",
        default="8GiB",
        help="dataflow: host memory kept free beside the pinned pool (weights' host copy, "
        "the process)",
    )
    p.add_argument("--steps", type=int, default=10, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    p.add_argument("--row-seconds", type=float, default=60.0)
    p.add_argument("--compile-row-seconds", type=float, default=150.0)
    p.add_argument("--deepspeed-seconds", type=float, default=200.0)
    p.add_argument("--total-seconds", type=float, default=540.0, help="for the whole command")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU peak (default: known GPUs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compare.json"))
    p.add_argument("--doc", type=Path, default=Path("docs/throughput.md"), help="table page")
    p.add_argument("--append", action="store_true", help="merge into --out, skip rows it has")
    p.add_argument("--redo", action="store_true", help="with --append: run rows it has again")
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="write each dataflow row's profiled step (torch.profiler) and simulated step here",
    )
    p.add_argument("--table-only", action="store_true", help="--out -> the table in --doc")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.table_only:
        if not args.out.exists():
            print(f"--table-only: {args.out} does not exist", file=sys.stderr)
            return 2
        write_table(finish(load_doc(args.out)), args.doc)
        return 0
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(
            "compare.py: --device cuda but no CUDA device here (--device cpu for a smoke run)",
            file=sys.stderr,
        )
        return 2
    args.budgets = [parse_size(text) for text in args.budgets.split(",") if text]
    allowed = MODE_ROWS[args.mode]
    if args.rows is None:
        args.rows = list(allowed)
    if not set(args.rows) <= set(allowed):
        others = ", ".join(r for r in args.rows if r not in allowed)
        print(
            f"compare.py: --rows {others}: not run under --mode {args.mode} (its rows: "
            f"{', '.join(allowed)})",
            file=sys.stderr,
        )
        return 2
    if args.mode == "lora":
        try:
            LoraConfig(args.lora_rank, args.lora_alpha)
        except LoraError as exc:
            print(f"compare.py: {exc}".replace("--lora ", "--lora-rank "), file=sys.stderr)
            return 2
    args.backing = None if args.backing is None else parse_size(args.backing)
    args.host_reserve = parse_size(args.host_reserve)
    if args.warmup < 1 or args.steps < 1:
        print("compare.py: --warmup and --steps must be >= 1", file=sys.stderr)
        return 2
    if args.stock_vocab_multiple < 1:
        print("compare.py: --stock-vocab-multiple must be >= 1 (1: no padding)", file=sys.stderr)
        return 2
    if args.stock_ce == "cce" and "stock" in args.rows:
        try:
            stock_tricks(args).described()
        except ValueError:
            print(
                "compare.py: --stock-ce cce but cut_cross_entropy is not installed (pip install "
                "cut-cross-entropy, or --stock-ce auto/torch)",
                file=sys.stderr,
            )
            return 2
    bench = Bench(args)
    for rows in ROWS:  # stock first: the dataflow rows' dtype follows the fastest stock row
        if rows in args.rows:
            getattr(bench, f"{rows}_rows")()
    write_table(finish(bench.doc), args.doc)
    save_doc(args.out, bench.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
