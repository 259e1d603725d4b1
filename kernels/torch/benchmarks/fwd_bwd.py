"""Times the explicit forward/backward ops against the same math in stock PyTorch eager.

    python kernels/torch/benchmarks/fwd_bwd.py --out results.json      # needs CUDA

At GPT-2 124M shapes (seq 1024, 12 heads x 64, hidden 768, MLP 3072, vocab 50257,
bfloat16) for batch 8 and 32, each case first checks that the variant agrees with stock
(relative error ``||ours - stock|| / ||stock||`` of every output and gradient, recorded),
then times both with CUDA events after warm-up and records the medians:

- attention: ``attention_fwd`` + ``attention_bwd`` vs ``F.scaled_dot_product_attention``
  forward + ``torch.autograd.grad`` (the backend SDPA picks, and SDPA forced to flash);
  q, k, v as the transposed views of one (batch, seq, 3, heads, dim) projection
- layer_norm / rms_norm: ``*_fwd`` + ``*_bwd`` vs ``F.layer_norm`` / ``F.rms_norm`` autograd
- gelu: ``F.gelu`` + ``gelu_bwd`` vs ``F.gelu`` autograd; swiglu: ``swiglu_fwd`` +
  ``swiglu_bwd`` vs ``F.silu(gate) * up`` autograd
- head: ``chunked_cross_entropy`` (chunks of 1024 and 4096 tokens, with its peak extra
  memory) vs bf16-autocast ``F.linear`` + ``F.cross_entropy(reduction="sum")`` autograd
- adamw: ``torch.optim.AdamW(fused=True)`` over GPT-2's 124M float32 parameters (its own
  tensor list) vs ``adamw_multi`` over one flat buffer per layer (embeddings, 12 blocks,
  final norm): bfloat16 params and grads with float32 states, and all float32

Every case runs in its own try block: a failure is recorded in ``errors`` and the rest
still run. The whole run takes well under two minutes on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dataflow import get_plugin_manager

BF16 = torch.bfloat16
HYPER = {"lr": 6e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """GPT-2 124M by default; ``--smoke`` runs tiny ones on CPU to check the harness."""

    seq: int = 1024
    heads: int = 12
    head_dim: int = 64
    hidden: int = 768
    mlp: int = 3072
    vocab: int = 50257
    layers: int = 12
    chunks: tuple[int, ...] = (1024, 4096)


SMOKE = Shapes(seq=40, heads=2, head_dim=16, hidden=32, mlp=64, vocab=101, layers=2, chunks=(16,))
DEVICE = "cuda"


def median_ms(run: Callable[[], object], warmup: int = 3, repeats: int = 15) -> float:
    """Median over ``repeats`` of one call's CUDA-event time, after ``warmup`` calls (on
    CPU, for ``--smoke``, wall-clock time)."""
    for _ in range(warmup):
        run()
    if DEVICE == "cpu":
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    pairs = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        pairs.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in pairs)


def rel_err(ours: torch.Tensor, stock: torch.Tensor) -> float:
    ours, stock = ours.detach().double(), stock.detach().double()
    return float((ours - stock).norm() / stock.norm().clamp_min(1e-30))


def errors_of(ours: tuple, stock: tuple) -> list[float]:
    return [rel_err(a, b) for a, b in zip(ours, stock, strict=True)]


def randn(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype)


def grad_of(forward: Callable[..., torch.Tensor], inputs, upstream) -> Callable[[], tuple]:
    """Stock eager: forward on fresh leaves, then torch.autograd.grad (fwd + bwd)."""

    def run() -> tuple:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = forward(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, upstream))

    return run


class Bench:
    def __init__(self, registry, shapes: Shapes) -> None:
        self.registry = registry
        self.shapes = shapes
        self.rows: list[dict] = []
        self.errors: list[dict] = []

    def load(self, op: str, name: str | None = None) -> Callable:
        """Variant ``op/name``, or the one ``load_ops`` would pick on the device."""
        if name is not None:
            return self.registry.get(f"{op}/{name}").load()
        return self.registry.for_op(op, device=DEVICE)[0].load()

    def variant_names(self, op: str) -> list[str]:
        names = [v.name for v in self.registry.for_op(op, device=DEVICE)]
        return [n for n in names if n != "reference"]

    def case(self, name: str, batch: int, body: Callable[[], list[dict]]) -> None:
        began = time.perf_counter()
        try:
            for row in body():
                row.update(case=name, batch=batch)
                if row.get("ours_ms") and row.get("stock_ms"):
                    row["ratio_to_stock"] = row["ours_ms"] / row["stock_ms"]
                self.rows.append(row)
                print(json.dumps(row))
        except Exception as error:  # one failing case must not cost the others
            self.errors.append({"case": name, "batch": batch, "error": repr(error)})
            traceback.print_exc()
        finally:
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            print(f"# {name} batch {batch}: {time.perf_counter() - began:.1f} s", flush=True)

    # -- cases -------------------------------------------------------------------------------

    def attention(self, batch: int) -> list[dict]:
        sh = self.shapes
        qkv = randn(batch, sh.seq, 3, sh.heads, sh.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        dout = randn(batch, sh.seq, sh.heads, sh.head_dim).transpose(1, 2)
        fwd, bwd = self.load("attention_fwd"), self.load("attention_bwd")

        def ours() -> tuple:
            out, lse = fwd(q, k, v, causal=True)
            return (out, *bwd(dout, q, k, v, out, lse, causal=True))

        def sdpa(*t):
            return F.scaled_dot_product_attention(*t, is_causal=True)

        stock = grad_of(sdpa, (q, k, v), dout)

        def stock_flash() -> tuple:
            backend = SDPBackend.FLASH_ATTENTION if DEVICE == "cuda" else SDPBackend.MATH
            with sdpa_kernel(backend):
                return stock()

        rows = []
        errs = errors_of(ours(), stock())
        ours_ms = median_ms(ours)
        for label, run in (("sdpa default backend", stock), ("sdpa flash", stock_flash)):
            rows.append(
                {
                    "variant": f"fwd+bwd vs {label}",
                    "ours_ms": ours_ms,
                    "stock_ms": median_ms(run),
                    "rel_err (out, dq, dk, dv)": errs,
                }
            )
        rows.append(
            {
                "variant": "fwd only vs sdpa default (no grad)",
                "ours_ms": median_ms(lambda: fwd(q, k, v, causal=True)),
                "stock_ms": median_ms(lambda: sdpa(q, k, v)),
            }
        )
        return rows

    def norms(self, batch: int) -> list[dict]:
        hidden = self.shapes.hidden
        x, dy = (randn(batch * self.shapes.seq, hidden) for _ in range(2))
        w, b = randn(hidden) + 1, randn(hidden, scale=0.1)
        rows = []
        ln_fwd, ln_bwd = self.load("layer_norm_fwd"), self.load("layer_norm_bwd")

        def ln_ours() -> tuple:
            y, mean, rstd = ln_fwd(x, w, b, 1e-5)
            return (y, *ln_bwd(dy, x, mean, rstd, w, b))

        ln_stock = grad_of(
            lambda *t: F.layer_norm(t[0], (hidden,), t[1], t[2], 1e-5), (x, w, b), dy
        )
        rows.append(
            {
                "variant": "layer_norm fwd+bwd",
                "ours_ms": median_ms(ln_ours),
                "stock_ms": median_ms(ln_stock),
                "rel_err (y, dx, dw, db)": errors_of(ln_ours(), ln_stock()),
            }
        )
        rms_fwd, rms_bwd = self.load("rms_norm_fwd"), self.load("rms_norm_bwd")

        def rms_ours() -> tuple:
            y, rstd = rms_fwd(x, w, 1e-6)
            return (y, *rms_bwd(dy, x, rstd, w))

        rms_stock = grad_of(lambda *t: F.rms_norm(t[0], (hidden,), t[1], 1e-6), (x, w), dy)
        rows.append(
            {
                "variant": "rms_norm fwd+bwd",
                "ours_ms": median_ms(rms_ours),
                "stock_ms": median_ms(rms_stock),
                "rel_err (y, dx, dw)": errors_of(rms_ours(), rms_stock()),
            }
        )
        return rows

    def activations(self, batch: int) -> list[dict]:
        x, dy, up = (randn(batch * self.shapes.seq, self.shapes.mlp) for _ in range(3))
        rows = []
        gelu_bwd = self.load("gelu_bwd")

        def gelu_ours() -> tuple:
            return F.gelu(x, approximate="tanh"), gelu_bwd(dy, x)

        gelu_stock = grad_of(lambda t: F.gelu(t, approximate="tanh"), (x,), dy)
        rows.append(
            {
                "variant": "gelu fwd+bwd",
                "ours_ms": median_ms(gelu_ours),
                "stock_ms": median_ms(gelu_stock),
                "rel_err (y, dx)": errors_of(gelu_ours(), gelu_stock()),
            }
        )
        swiglu_stock = grad_of(lambda g, u: F.silu(g) * u, (x, up), dy)
        stock_ms = median_ms(swiglu_stock)
        for name in self.variant_names("swiglu_fwd"):
            fwd, bwd = self.load("swiglu_fwd", name), self.load("swiglu_bwd", name)

            def swiglu_ours(fwd=fwd, bwd=bwd) -> tuple:
                return (fwd(x, up), *bwd(dy, x, up))

            rows.append(
                {
                    "variant": f"swiglu fwd+bwd ({name})",
                    "ours_ms": median_ms(swiglu_ours),
                    "stock_ms": stock_ms,
                    "rel_err (y, dgate, dup)": errors_of(swiglu_ours(), swiglu_stock()),
                }
            )
        return rows

    def head(self, batch: int) -> list[dict]:
        sh = self.shapes
        tokens = batch * sh.seq
        hidden = randn(tokens, sh.hidden)
        weight = randn(sh.vocab, sh.hidden, scale=0.02)
        targets = torch.randint(0, sh.vocab, (tokens,), device=DEVICE)

        def stock() -> tuple:
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            with torch.autocast(DEVICE, dtype=BF16):
                loss = F.cross_entropy(F.linear(h, w), targets, reduction="sum")
            return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

        want = stock()
        stock_ms = median_ms(stock, warmup=2, repeats=7)
        stock_peak = peak_extra_mib(stock)
        ce = self.load("chunked_cross_entropy")
        rows = []
        for chunk in sh.chunks:
            got = ce(hidden, weight, targets, chunk)
            rows.append(
                {
                    "variant": f"chunked_cross_entropy chunk {chunk}",
                    "ours_ms": median_ms(lambda c=chunk: ce(hidden, weight, targets, c), 2, 7),
                    "stock_ms": stock_ms,
                    "ours_peak_extra_MiB": peak_extra_mib(
                        lambda c=chunk: ce(hidden, weight, targets, c)
                    ),
                    "stock_peak_extra_MiB": stock_peak,
                    "rel_err (loss, d_hidden, d_weight)": errors_of(got, want),
                }
            )
            del got
        return rows

    def adamw(self, batch: int) -> list[dict]:
        del batch  # the optimizer step does not depend on it
        sh = self.shapes
        d, f = sh.hidden, sh.mlp
        block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, f), (f,), (f, d)]
        block.append((d,))
        shapes = [(sh.vocab, d), (sh.seq, d), *block * sh.layers, (d,), (d,)]
        params = [torch.nn.Parameter(randn(*s, dtype=torch.float32)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(
            params,
            lr=HYPER["lr"],
            betas=(HYPER["beta1"], HYPER["beta2"]),
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            fused=DEVICE == "cuda",
        )
        optimizer.step()  # creates the states
        stock_ms = median_ms(optimizer.step)
        count = sum(p.numel() for p in params)
        del optimizer, params
        per_layer = sum(torch.Size(s).numel() for s in block)
        sizes = [(sh.vocab + sh.seq) * d, *[per_layer] * sh.layers, 2 * d]
        rows = []
        for label, param_dtype in (("bf16 params+grads, fp32 states", BF16), ("all fp32", None)):
            p_dtype = param_dtype or torch.float32
            flat = [
                [randn(n, dtype=p_dtype) for n in sizes],
                [randn(n, dtype=p_dtype) for n in sizes],
                [torch.zeros(n, device=DEVICE) for n in sizes],
                [torch.zeros(n, device=DEVICE) for n in sizes],
            ]
            for name in self.variant_names("adamw_multi"):
                step = self.load("adamw_multi", name)
                copies = [[t.clone() for t in lst] for lst in flat]
                rows.append(
                    {
                        "variant": f"adamw_multi ({name}) {label}",
                        "params": count,
                        "ours_ms": median_ms(lambda s=step, c=copies: s(*c, step=3, **HYPER)),
                        "stock_ms": stock_ms,
                        "stock": "torch.optim.AdamW(fused=True), fp32 params and states",
                    }
                )
                del copies
            del flat
        return rows


def peak_extra_mib(run: Callable[[], object]) -> float | None:
    """Peak device memory one call adds above what was allocated before it, in MiB."""
    if DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    del result
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the results here (JSON)")
    parser.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU: checks the harness only"
    )
    args = parser.parse_args()
    DEVICE = "cpu" if args.smoke else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fwd_bwd.py needs a CUDA device (or --smoke)")
    torch.manual_seed(0)
    registry = get_plugin_manager(autoload=False, allow=["dataflow-kernels-torch"]).kernels()
    bench = Bench(registry, SMOKE if args.smoke else Shapes())
    began = time.perf_counter()
    for batch in (int(b) for b in args.batches.split(",")):
        bench.case("attention", batch, lambda b=batch: bench.attention(b))
        bench.case("norms", batch, lambda b=batch: bench.norms(b))
        bench.case("activations", batch, lambda b=batch: bench.activations(b))
        bench.case("head", batch, lambda b=batch: bench.head(b))
    bench.case("adamw", 0, lambda: bench.adamw(0))
    results = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "shapes": dataclasses.asdict(bench.shapes),
        "picked": {
            op: registry.for_op(op, device=DEVICE)[0].key for op in sorted({v.op for v in registry})
        },
        "seconds": time.perf_counter() - began,
        "rows": bench.rows,
        "errors": bench.errors,
    }
    with open(args.out, "w") as file:
        json.dump(results, file, indent=2)
    print(f"\n{'case':<12} {'batch':>5} {'ours ms':>9} {'stock ms':>9} {'ratio':>6}  variant")
    for row in bench.rows:
        ours, stock = row.get("ours_ms", float("nan")), row.get("stock_ms", float("nan"))
        print(
            f"{row['case']:<12} {row['batch']:>5} {ours:>9.3f} {stock:>9.3f} "
            f"{row.get('ratio_to_stock', float('nan')):>6.2f}  {row['variant']}"
        )
    print(f"{len(bench.errors)} case(s) failed; wrote {args.out}")


if __name__ == "__main__":
    main()
