"""The dataflow rows of benchmarks/compare.py: ``TrainingRun`` inside each budget.

For a budget, the batches of ``--dataflow-batches`` (with as many accumulation rounds as
reach ``--min-tokens`` per step) are lowered and planned at the budget with the lowering's
roofline costs, on the host, largest first until a plan reaches its lower bound
(``ranked_shapes``). The shapes run in the order of those plans' predicted tokens/s, a
larger batch first among those within 2 % of the best (fewer, larger launches); the first
that plans and runs on the device, with its tasks profiled there, is the row. Shapes the
roofline plan already finds infeasible are not tried. What each shape did is kept in the
row's details. Under ``--mode lora`` every shape trains the bench's ``LoraConfig``
(``TrainConfig.lora``: adapters on a frozen base) and its rows are of that mode.

What a row reports comes from the engine: the measured step is the wall time of
``TrainingRun.step`` (feeding, the engine run, the loss read-back); moved bytes and link
busy time are the transfers in the step's ``RunResult`` trace; compute idle is the part of
the measured step not covered by the trace's task spans; predicted is
``TrainingRun.predicted()``; the allocator peak is the engine's (checked against the
budget by the engine itself). The host memory a row took is in its details: the
slow pool page-locked for it (``pinned_bytes``, the plan's ``predicted_slow_peak_bytes``)
and the process's resident peak so far (``host_peak_rss_bytes``).
"""

from __future__ import annotations

import gzip
import json
import math
import resource
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import cattrs
import torch
from dataflow_training.drive.run import TrainingRun
from dataflow_training.plan.compiled_step import available_host_bytes
from dataflow_training.step.config import (
    DtypePolicy,
    TrainConfig,
    head_chunk_tokens,
    optimizer_states,
)
from dataflow_training.step.lora import LoraConfig
from dataflow_training.step.lowering import lower

from benchmarks.harness.compare_doc import make_row
from benchmarks.harness.measure import RowTimeout, idle_pct, one_line, profile_step, time_limit
from dataflow.planning import PlanningError, plan
from dataflow.units import format_size

ENGINE = "dataflow"
#: name -> (storage dtypes, AdamW states: ``--optimizer-states`` of ``dataflow train``)
POLICIES = {
    "bf16": (DtypePolicy.named("bf16"), "bf16"),
    "mixed": (DtypePolicy("bfloat16", "float32", "bfloat16"), "fp32"),
    "bf16-int8": (DtypePolicy.named("bf16"), "int8"),
}


def train_config(
    dtype: str,
    batch: int,
    rounds: int,
    seq_len: int,
    chunk: int,
    order: str = "round",
    tiles: bool = False,
    updates: str = "auto",
    lora: LoraConfig | None = None,
    pieces: int = 1,
    accumulate: str = "float32",
    row_groups: int = 1,
) -> TrainConfig:
    """A row's step: ``dtype`` (``POLICIES``), the shape, the head's chunk, the order and
    the updates; ``lora``: adapters on a frozen base (None: full training); ``pieces``:
    the vocabulary tables' row pieces (``TrainConfig.vocab_pieces``); ``accumulate``:
    ``TrainConfig.head_accumulate``; ``row_groups``: ``TrainConfig.block_row_groups``."""
    policy, state = POLICIES[dtype]
    return TrainConfig(
        seq_len=seq_len,
        batch=batch,
        rounds=rounds,
        dtype=policy,
        optimizer=optimizer_states(state),
        chunk_tokens=chunk,
        order=order,
        updates=updates,
        head_vocab_tiles=tiles,
        lora=lora,
        vocab_pieces=pieces,
        head_accumulate=accumulate,
        block_row_groups=row_groups,
    )


def model_overrides(args: Any) -> dict[str, Any]:
    """The model overrides of the dataflow rows: ``--expert-shards`` where given."""
    return {"expert_shards": args.expert_shards} if args.expert_shards else {}


def engine_name(order: str) -> str:
    """A dataflow row's engine: ``dataflow`` in round order, ``dataflow by layer`` in
    layer order (``TrainConfig.order``)."""
    return ENGINE if order == "round" else f"{ENGINE} by {order}"


def given_shapes(batches: list[int], min_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """``(batch, rounds)`` of each batch in the order given, with as many rounds as reach
    ``min_tokens`` (``--dataflow-batch-order given``)."""
    return [(batch, max(1, math.ceil(min_tokens / (batch * seq_len)))) for batch in batches]


def ranked_shapes(
    family: Any,
    preset: str,
    dtype: str,
    budget_bytes: int,
    seq_len: int,
    batches: list[int],
    min_tokens: int,
    chunk: int,
    order: str = "round",
    tiles: bool = False,
    updates: str = "auto",
    lora: LoraConfig | None = None,
    pieces: int = 1,
    overrides: dict[str, Any] | None = None,
    accumulate: str = "float32",
) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """``(batch, rounds)`` in the order to try, and what the roofline plan said of each
    (``overrides``: the model's, e.g. ``expert_shards``).

    The ranking plans with PressureFit alone on the lowering's default (H200) roofline
    costs: one run of the step, no recompute, so it is quick. Where recompute decides the
    speed it can misrank: at gpt2_124m 1 GiB it put 4 x 128 first, where `dataflow predict`
    (recompute, steady state) ranks 8 x 64 first (session 9); pass the batches to try then.

    Batches are planned largest first, and planning stops at the first plan within 2 %
    of its compute-only lower bound: a smaller batch has the same FLOPs per token and
    more weight reads per token, so it cannot be predicted faster. The batches not
    planned come last, largest first, for when every planned shape fails on the device."""
    predicted: dict[tuple[int, int], float] = {}
    said: dict[str, Any] = {}
    unplanned: list[tuple[int, int]] = []
    for batch in sorted(batches, reverse=True):
        rounds = max(1, math.ceil(min_tokens / (batch * seq_len)))
        if any(v.get("at_bound") for v in said.values() if isinstance(v, dict)):
            unplanned.append((batch, rounds))
            continue
        train = train_config(
            dtype, batch, rounds, seq_len, chunk, order, tiles, updates, lora, pieces, accumulate
        )
        program = lower(family, preset, train, overrides=overrides).program
        try:
            planned = plan(program, budget_bytes)
        except PlanningError as exc:
            said[str(batch)] = f"roofline plan: {one_line(exc)}"
            continue
        makespan_us = planned.sim.makespan_us
        tok_s = batch * rounds * seq_len / (makespan_us / 1e6)
        predicted[(batch, rounds)] = tok_s
        at_bound = makespan_us <= 1.02 * planned.lower_bound_us
        said[str(batch)] = {
            "rounds": rounds,
            "roofline_tok_s": round(tok_s, 1),
            "at_bound": at_bound,
        }
    best = max(predicted.values(), default=0.0)
    near = sorted((s for s, v in predicted.items() if v >= 0.98 * best), reverse=True)
    rest = sorted((s for s in predicted if s not in near), key=lambda s: -predicted[s])
    return near + rest + unplanned, said


def random_batches(vocab: int, batch: int, rounds: int, seq_len: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq_len), generator=generator),
            torch.randint(0, vocab, (batch, seq_len), generator=generator),
        )
        for _ in range(rounds)
    ]


def host_peak_rss_bytes() -> int:
    """The process's peak resident host memory so far (Linux reports kilobytes): the
    pinned pool, the starting weights' host copy and everything the command held before."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def close_quietly(run: TrainingRun) -> None:
    """Close the run (its engine's memory goes back; its state is not copied out) without
    letting an error of the close hide the one that ended the trial (a time limit in the
    middle of a step)."""
    try:
        run.close(keep_state=False)
    except Exception:  # noqa: BLE001, S110  (the trial's own outcome is what is reported;
        pass  # the run and its engine are collected by the next gc.collect)


def initial_state(config: Any, device: str, param_dtype: str) -> dict[str, torch.Tensor] | None:
    """A decoder family's starting weights drawn on ``device`` by the stock model (same
    keys as the family's reference state, N(0, 0.02) matrices, unit norms) and brought to
    the host in the run's parameter dtype: an 8B model's weights are not drawn in float32
    on the host. None for GPT-2 (its reference model initialises the run, as before)."""
    from benchmarks.harness.stock import is_gpt2, stock_model

    if is_gpt2(config):
        return None
    dtype = "bf16" if param_dtype == "bfloat16" else "autocast"
    torch.manual_seed(0)
    model = stock_model(config, 1, device=device, dtype=dtype)
    state = {
        k: v.detach().to("cpu", getattr(torch, param_dtype)) for k, v in model.state_dict().items()
    }
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the engine's budget starts from an empty device
    return state


def pinned_limit(device: str, reserve_bytes: int) -> int | None:
    """The most pinned memory a run's slow pool may take here: the host's available memory
    less ``reserve_bytes`` (the process, the starting weights' host copy). Page-locking
    past the host's memory stalls the machine rather than failing, so a larger pool is
    refused before it is allocated (``TrainingRun.check_backing``). None off CUDA."""
    available = available_host_bytes()
    if available is None or not device.startswith("cuda"):
        return None
    return max(0, available - reserve_bytes)


def row_run(
    family: Any,
    preset: str,
    train: TrainConfig,
    budget: int,
    *,
    device: str,
    resolver: str,
    **options: Any,
) -> TrainingRun:
    """The ``TrainingRun`` of one dataflow row: ``train`` inside ``budget``, from a fresh
    initial state (``initial_state``); ``options`` go to ``TrainingRun``."""
    state = initial_state(family.config(preset), device, train.dtype.param)
    return TrainingRun.of(
        family,
        preset,
        train,
        budget_bytes=budget,
        device=device,
        resolver=resolver,
        state=state,
        **options,
    )


def write_simulated(run: TrainingRun, path: Path) -> None:
    """The simulated step of ``run``'s placed plan as gzipped JSON: each task's and each
    transfer's span (microseconds from the step's start), to set beside the profiled
    step's trace (``--trace-dir``)."""
    sim = run.compiled.plan.sim
    path.parent.mkdir(parents=True, exist_ok=True)
    timeline = {
        "makespan_us": sim.makespan_us,
        "links": cattrs.unstructure(run.compiled.program.links),
        "tasks": [[t.task_id, t.start_us, t.end_us] for t in sim.tasks],
        "transfers": [
            [t.obj_id, t.direction, t.size_bytes, t.enqueue_us, t.start_us, t.end_us]
            for t in sim.transfers
        ],
    }
    with gzip.open(path, "wt") as f:
        json.dump(timeline, f)


def trial(
    bench: Any, dtype: str, budget: int, batch: int, rounds: int, chunk: int, order: str
) -> dict:
    """One shape on the device: build (profile, plan, place), warm up, measure."""
    args = bench.args
    began = time.perf_counter()
    train = train_config(
        dtype,
        batch,
        rounds,
        args.seq_len,
        chunk,
        order,
        args.head_vocab_tiles,
        args.updates,
        bench.lora,
        args.vocab_pieces,
        args.head_accumulate,
        args.block_row_groups,
    )
    run = row_run(
        bench.family,
        args.preset,
        train,
        budget,
        device=args.device,
        resolver=args.resolver,
        backing_bytes=args.backing,
        pinned_limit_bytes=pinned_limit(args.device, args.host_reserve) or args.backing,
        overrides=model_overrides(args),
    )
    shape = f"{format_size(budget)} batch {batch} x {rounds}"
    print(
        f"{shape}: profiled, planned, placed in {time.perf_counter() - began:.0f} s; "
        f"loading (a slow pool of {format_size(run.compiled.pinned_bytes)} to page-lock) and the "
        "first step next",
        flush=True,
    )
    try:
        data = [random_batches(run.vocab_size, batch, rounds, args.seq_len, s) for s in (0, 1)]
        for i in range(args.warmup):
            first = run.step(data[i % 2])
            if i == 0:  # profiling, planning, placing, the engine's load, the first step
                setup_s = time.perf_counter() - began
                load = run.load_seconds
                phases = ", ".join(f"{name} {secs:.1f}" for name, secs in load.items())
                print(
                    f"{shape}: first step done at {setup_s:.0f} s (load: {phases} s; the "
                    f"step itself {first.step_s - sum(load.values()):.1f} s)",
                    flush=True,
                )
        measured = []
        for i in range(args.steps):
            stats = run.step(data[i % 2])
            measured.append((stats, run.last_result.steps[-1]))
        keep = None
        if args.trace_dir is not None:  # the profiled step beside the simulated one
            size = format_size(budget).replace(" ", "")
            stem = args.trace_dir / f"{args.preset}_{size}_{batch}x{rounds}"
            keep = stem.with_suffix(".trace.json.gz")
            write_simulated(run, stem.with_suffix(".sim.json.gz"))
        activity = profile_step(lambda: run.step(data[0]), args.device, keep)
        predicted = run.compiled.predicted()
        links = cattrs.unstructure(run.compiled.program.links)  # as measured for the plan
        graph_note = run.graph_note
        pinned = run.compiled.pinned_bytes
    finally:
        close_quietly(run)
    step_s = [stats.step_s for stats, _ in measured]
    median_s = statistics.median(step_s)
    peaks = [stats.allocator_peak_bytes for stats, _ in measured]
    replayed = all(trace.replayed for _, trace in measured)
    details = {
        "rounds": rounds,
        "order": order,
        "chunk_tokens": chunk,
        "head_vocab_tiles": args.head_vocab_tiles,
        "head_accumulate": args.head_accumulate,
        "vocab_pieces": args.vocab_pieces,
        **({"block_row_groups": args.block_row_groups} if args.block_row_groups > 1 else {}),
        **({"expert_shards": args.expert_shards} if args.expert_shards else {}),
        "updates": args.updates,
        "replayed": replayed,
        "graph_note": graph_note,
        "engine_makespan_s": statistics.median(t.makespan_us for _, t in measured) / 1e6,
        "ledger_peak_bytes": max(stats.fast_peak_bytes for stats, _ in measured),
        "predicted_moved_bytes": predicted["moved_bytes"],
        "losses": [stats.loss for stats, _ in measured],
        "pinned_bytes": pinned,
        "host_peak_rss_bytes": host_peak_rss_bytes(),
        "predicted_slow_peak_bytes": predicted["slow_peak_bytes"],
        "setup_s": setup_s,
        "load_s": load,
        "links": links,
    }
    # which resource the simulator mispriced, where measured and predicted differ: the
    # kernels' busy time against the tasks' summed costs, each link's busy time and bytes
    details["predicted_compute_s"] = predicted["compute_busy_s"]
    for way in ("h2d", "d2h"):
        details[f"predicted_{way}_s"] = predicted[f"{way}_busy_s"]
        details[f"predicted_{way}_bytes"] = predicted[f"{way}_bytes"]
    if activity is not None:
        details["kernel_s"] = activity.kernel_s
        for way in ("h2d", "d2h"):
            details[f"{way}_s"] = getattr(activity, f"{way}_s")
            details[f"{way}_bytes"] = getattr(activity, f"{way}_bytes")
        details["kernel_idle_pct"] = idle_pct(activity.kernel_s, median_s)
    if replayed:
        # A step replayed from a CUDA graph has no per-task spans: what the device did
        # comes from the profiled step (kernels, and each copy direction's busy time).
        if activity is None:
            raise RuntimeError("a replayed step needs the profiled step (CUDA) to be measured")
        idle = idle_pct(activity.kernel_s, median_s)
        moved = activity.moved_bytes
        details["link_busy_pct"] = 100.0 * max(activity.h2d_s, activity.d2h_s) / median_s
    else:
        busy_s = [sum(t.end_us - t.start_us for t in trace.tasks) / 1e6 for _, trace in measured]
        idle = statistics.median(idle_pct(b, s) for b, s in zip(busy_s, step_s, strict=True))
        moved = statistics.median(
            sum(t.size_bytes for t in trace.transfers) for _, trace in measured
        )
        link_s = [
            max(
                sum(
                    t.end_us - t.start_us
                    for t in trace.transfers
                    if t.direction == way and t.end_us is not None and t.start_us is not None
                )
                / 1e6
                for way in ("h2d", "d2h")
            )
            for _, trace in measured
        ]
        details["link_busy_pct"] = 100.0 * statistics.median(link_s) / median_s
    return {
        "step_s": median_s,
        "peak": None if None in peaks else max(peaks),
        "moved": int(moved),
        "idle_pct": idle,
        "predicted_s": predicted["step_s"],
        "details": details,
    }


def dataflow_row(bench: Any, dtype: str, budget: int, order: str = "round") -> None:
    """Measure (or explain) one dataflow row and record it."""
    engine = engine_name(order)
    if bench.have(engine, dtype, budget) or bench.skipped(engine, dtype, budget):
        return
    args = bench.args
    chunk = head_chunk_tokens(budget, bench.config.vocab_size)
    tried: dict[str, Any] = {}
    result, note, current = None, None, ""  # current: the shape on the device
    try:
        with time_limit(bench.limit(args.row_seconds)):
            if args.dataflow_batch_order == "given":
                shapes = given_shapes(args.dataflow_batches, args.min_tokens, args.seq_len)
                tried["given"] = [f"{batch} x {rounds}" for batch, rounds in shapes]
            else:
                shapes, tried["roofline"] = ranked_shapes(
                    bench.family,
                    args.preset,
                    dtype,
                    budget,
                    args.seq_len,
                    args.dataflow_batches,
                    args.min_tokens,
                    chunk,
                    order,
                    args.head_vocab_tiles,
                    args.updates,
                    bench.lora,
                    args.vocab_pieces,
                    model_overrides(args),
                    args.head_accumulate,
                )
            for batch, rounds in shapes:
                current = f"while trying batch {batch} x {rounds}"
                try:
                    result = trial(bench, dtype, budget, batch, rounds, chunk, order)
                    result |= {"batch": batch, "rounds": rounds}
                    break
                except Exception as exc:  # infeasible after profiling, breach, ...: go on
                    tried[f"batch {batch} x {rounds}"] = one_line(exc)
                    traceback.print_exc()  # the whole story in the log, one line in the row
                finally:
                    bench.free()
    except RowTimeout as exc:
        # which limit: a row that stops in its setup wants a larger --row-seconds (a
        # 1B-parameter model's profiling and planning take 40-80 s on the H200)
        note = f"{exc} (--row-seconds / --total-seconds) reached {current}".rstrip()
        traceback.print_exc()  # where the limit stopped it (the engine's load, a step, ...)
        bench.free()
    details = {"tried": tried}
    if result is None:
        failures = "; ".join(f"{k}: {v}" for k, v in tried.items() if k != "roofline")
        roofline = next(iter(tried.get("roofline", {}).items()), None)
        reason = note or failures
        if not reason and roofline:  # e.g. "... the smallest budget that works is ..."
            reason = f"no batch plans here; batch {roofline[0]}'s {roofline[1]}"
        bench.record(
            make_row(bench.model, engine, dtype, budget, note=f"{format_size(budget)}: {reason}"),
            details,
        )
        return
    if tried.keys() - {"roofline"}:
        note = "; ".join(f"{k}: {v}" for k, v in tried.items() if k != "roofline")
    row = make_row(
        bench.model,
        engine,
        dtype,
        budget,
        batch=result["batch"],
        tokens_per_step=result["batch"] * result["rounds"] * args.seq_len,
        measured_step_s=result["step_s"],
        allocator_peak_bytes=result["peak"],
        moved_bytes_per_step=result["moved"],
        compute_idle_pct=result["idle_pct"],
        predicted_step_s=result["predicted_s"],
        note=note,
        **bench.row_kwargs(),
    )
    bench.record(row, details | result["details"])
