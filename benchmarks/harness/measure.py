"""What benchmarks/compare.py and its DeepSpeed row (``deepspeed_row``) measure, the same way
for every row: wall-clock steps, the device's own activity in one profiled step, the links'
bandwidth, model FLOPs and MFU, and a time limit per row.

- A step's time is wall clock with the device synchronised before and after it, so host
  dispatch, data feeding and read-back all count, whatever the engine.
- The device's activity comes from ``torch.profiler`` (CUDA activity only) over one extra
  step: the union of kernel intervals is the time the GPU computes; host<->device copies
  are counted per direction (bytes and the union of their intervals).
- Model FLOPs per token follow the PaLM / nanoGPT convention: ``6 * N + 12 * L * d * T``,
  N the parameters that take part in matrix products (every parameter except the position
  embedding; the tied token embedding counts once, as the LM head; an untied one is a
  lookup; routed experts count at their active share, experts per token / experts), L
  layers, d the attention width (heads x head size), T the sequence length (attention
  counted in full, not halved for the causal mask).
  Recomputation (activation checkpointing) is not model FLOPs and is not counted.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from dataflow.engine.backends.torch_graph import stream_activity, trace_activity

#: Dense BF16 tensor-core peak of an H200 SXM, NVIDIA's datasheet figure, "about 990
#: TFLOP/s", as the device notes (H200.md) record it; they say the H200's arithmetic and
#: matrix rates are the H100's, so the H100 80GB HBM3 (SXM) of the device machine has it too
PEAK_FLOPS = {"H200": 990e12, "H100": 990e12}
PEAK_SOURCE = (
    "NVIDIA H100/H200 SXM datasheet, dense BF16 tensor core ~990 TFLOP/s "
    "(as recorded in the project's device notes, H200.md)"
)


class RowTimeout(BaseException):
    """A row ran past its time limit. A BaseException, so that a framework's own
    ``except Exception`` (torch.compile wraps compiler errors) does not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``RowTimeout`` in the main thread once ``seconds`` have passed."""

    def expired(signum: int, frame: Any) -> None:
        raise RowTimeout(f"time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def wall_steps(
    step: Callable[[int], Any], warmup: int, steps: int, device: str
) -> tuple[list[float], list[Any]]:
    """Run ``warmup`` then ``steps`` steps; the measured steps' wall seconds and what each
    returned."""
    for i in range(warmup):
        step(i)
    synchronize(device)
    times, outputs = [], []
    for i in range(warmup, warmup + steps):
        began = time.perf_counter()
        outputs.append(step(i))
        synchronize(device)
        times.append(time.perf_counter() - began)
    return times, outputs


def measure_trial(
    step: Callable[[int], Any], batch: int, seq_len: int, warmup: int, steps: int, device: str
) -> dict[str, Any]:
    """One batch of a budget-free engine: ``warmup`` steps (compiling, building ops), the
    allocator's peak over ``steps`` measured ones, their median, one more profiled."""
    for i in range(warmup):
        step(i)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, _ = wall_steps(step, 0, steps, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    activity = profile_step(lambda: step(0), device)
    step_s = statistics.median(times)
    return {
        "batch": batch,
        "step_s": step_s,
        "tok_s": batch * seq_len / step_s,
        "peak": peak,
        "activity": activity,
    }


@attrs.frozen
class DeviceActivity:
    """One profiled step: seconds the GPU ran kernels, and per copy direction the bytes
    moved and the seconds the link was busy."""

    kernel_s: float
    h2d_bytes: int
    d2h_bytes: int
    h2d_s: float
    d2h_s: float

    @property
    def moved_bytes(self) -> int:
        return self.h2d_bytes + self.d2h_bytes


def device_activity(trace: dict[str, Any]) -> DeviceActivity:
    """Kernels and host<->device copies of a Chrome trace document from
    ``torch.profiler`` (the engine's ``trace_activity``: ``cat`` ``kernel`` and
    ``gpu_memcpy``; copies named ``HtoD`` / ``DtoH``; ``ts``/``dur`` in microseconds)."""
    return _activity(trace_activity(trace.get("traceEvents", [])))


def profile_step(step: Callable[[], Any], device: str, keep: Any = None) -> DeviceActivity | None:
    """The device's activity during one call of ``step`` (None off CUDA); with ``keep``,
    its torch.profiler trace is written there (gzipped JSON)."""
    if torch.device(device).type != "cuda":
        return None
    synchronize(device)
    return _activity(stream_activity(step, keep))


def _activity(found: dict[str, float]) -> DeviceActivity:
    return DeviceActivity(
        found["kernel_busy_us"] / 1e6,
        int(found["h2d_bytes"]),
        int(found["d2h_bytes"]),
        found["h2d_busy_us"] / 1e6,
        found["d2h_busy_us"] / 1e6,
    )


def idle_pct(busy_s: float, step_s: float) -> float:
    """Percent of a step the compute resource was not busy (never below 0)."""
    return max(0.0, 100.0 * (1.0 - busy_s / step_s)) if step_s > 0 else 0.0


def cuda_median_ms(run: Callable[[], object], *, warmup: int = 3, repeats: int = 20) -> float:
    """Median over ``repeats`` calls of ``run`` of its CUDA-event time (ms), each call timed
    and synchronized on its own, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def link_bandwidth(device: str, size_bytes: int = 256 * 2**20, repeats: int = 5) -> dict:
    """Measured pinned host<->device copy rates (bytes/s, median of ``repeats``); empty off
    CUDA."""
    if torch.device(device).type != "cuda":
        return {}
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    fast = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("h2d", fast, host), ("d2h", host, fast)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        rates[f"{name}_bytes_per_s"] = size_bytes / statistics.median(seconds)
    return rates


def matmul_params(config: Any) -> float:
    """Parameters one token multiplies by: GPT-2's all but the positions; a decoder's as
    ``stock_decoder.matmul_params`` counts them (routed experts at their active share)."""
    from benchmarks.harness.stock import StockGPT2, is_gpt2

    if not is_gpt2(config):
        from benchmarks.harness.stock_decoder import matmul_params as decoder_params

        return decoder_params(config)
    with torch.device("meta"):
        model = StockGPT2(
            config.vocab_size, config.n_positions, config.n_embd, config.n_layer, config.n_head
        )
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wpe"))


def flops_per_token(config: Any, seq_len: int, *, causal: bool = False) -> float:
    """Model FLOPs of one trained token (forward and backward): ``6 N + 12 L a T`` (``a``
    the attention width: GPT-2's ``n_embd``, a decoder's query heads x ``head_dim``);
    ``causal``: the attention term halved, ``6 N + 6 L a T`` (a causal query scores half
    the keys on average: what long-context MFU counts)."""
    return 6.0 * matmul_params(config) + attention_flops_per_token(config, seq_len, causal)


def attention_flops_per_token(config: Any, seq_len: int, causal: bool = False) -> float:
    """The attention term of ``flops_per_token``: ``12 L a T``, halved when ``causal``.
    Scores and the weighted values are ``6 T h (d_qk + d_v)`` a layer over forward and
    backward, ``12 T a`` where the query/key and value widths are the head's ``d``; MLA's
    heads score over ``qk_nope_head_dim + qk_rope_head_dim`` and weigh ``v_head_dim``
    (DeepSeek V3: 192 and 128), counted so. A lightning indexer's scores are left out."""
    from benchmarks.harness.stock import is_gpt2

    if is_gpt2(config):
        layers, width = config.n_layer, 2 * config.n_embd
    elif hasattr(config, "v_head_dim"):  # MLA (kit.mla.MLAFields)
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        layers, width = (
            config.num_hidden_layers,
            config.num_attention_heads * (qk + config.v_head_dim),
        )
    else:
        layers, width = config.num_hidden_layers, 2 * config.q_width
    return (3.0 if causal else 6.0) * layers * width * seq_len


def peak_flops(device_name: str) -> float | None:
    """The dense BF16 peak of a known device (by name), else None."""
    return next((peak for key, peak in PEAK_FLOPS.items() if key in device_name), None)


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its type and first line."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def link_busy_pct(activity: DeviceActivity, step_s: float) -> float:
    """Percent of a step the busier copy direction was moving bytes."""
    return 100.0 * max(activity.h2d_s, activity.d2h_s) / step_s if step_s > 0 else 0.0


@attrs.define
class BatchSearch:
    """The fastest batch of ``batches``: largest first; a batch that runs out of memory or
    fails is recorded and skipped; the search stops once a smaller batch runs more than
    3 % slower than the best so far (``full`` tries them all), or after a failure that
    ``give_up`` says will repeat. ``tried`` maps each batch to its tokens/s or failure;
    when a time limit interrupts ``run``, both stay as far as it got."""

    batches: list[int]
    full: bool = False
    tried: dict[str, Any] = attrs.field(factory=dict)
    best: dict[str, Any] | None = None

    def run(
        self,
        trial: Callable[[int], dict[str, Any]],
        cleanup: Callable[[], None],
        give_up: Callable[[Exception], bool] = lambda exc: False,
    ) -> None:
        for batch in sorted(self.batches, reverse=True):
            try:
                result = trial(batch)
            except torch.cuda.OutOfMemoryError:
                self.tried[str(batch)] = "out of memory"
                continue
            except Exception as exc:  # a failing batch is a result: say why, go on
                self.tried[str(batch)] = one_line(exc)
                if give_up(exc):
                    break
                continue
            finally:
                cleanup()
            self.tried[str(batch)] = round(result["tok_s"], 1)
            if self.best is None or result["tok_s"] > self.best["tok_s"]:
                self.best = result
            elif not self.full and result["tok_s"] < 0.97 * self.best["tok_s"]:
                break  # smaller batches only get slower from here
