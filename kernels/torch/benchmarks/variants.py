"""Time each op's variants on CUDA, after checking they agree, and probe reproducibility.

    python kernels/torch/benchmarks/variants.py [--json PATH]

For ops with more than one variant (attention, adamw), every variant is first compared
with the default one on the same inputs (validated before benchmarked), then timed with
CUDA events (median of 20 after 5 warm-ups). The reproducibility probe runs
``attention/torch`` forward and backward 10 times on one input and counts distinct
results of each gradient: a count above 1 shows the nondeterminism its flag declares
(a count of 1 does not prove the opposite). Also times chunked_cross_entropy on a GPT-2
head (8 x 1024 tokens, dim 768, vocab 50257, chunks of 1024) with its peak extra memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from dataflow import get_plugin_manager


def median_ms(run: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    registry = get_plugin_manager(autoload=False, allow=["dataflow-kernels-torch"]).kernels()
    load = {v.key: v.load() for v in registry}
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }

    # attention, bf16, GPT-2 small shape, forward + backward
    q, k, v, up = (
        torch.randn(8, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )

    def attention(key: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = load[key](*leaves, causal=True)
            return (out.detach(), *torch.autograd.grad(out, leaves, up))

        return run

    default = attention("attention/torch")()
    math_result = attention("attention/torch-math")()
    results["attention_max_abs_diff"] = [
        float((a.float() - b.float()).abs().max())
        for a, b in zip(default, math_result, strict=True)
    ]
    for key in ("attention/torch", "attention/torch-math"):
        results[f"{key} fwd+bwd ms"] = median_ms(attention(key))
    distinct = [set() for _ in range(4)]
    for _ in range(10):
        for index, tensor in enumerate(attention("attention/torch")()):
            distinct[index].add(hash(tensor.float().cpu().numpy().tobytes()))
    results["attention/torch distinct results of (out, dq, dk, dv) over 10 runs"] = [
        len(d) for d in distinct
    ]

    # adamw, 64M parameters
    n = 1 << 26
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    for label, state_dtype in (("float32 states", torch.float32), ("bf16 states", torch.bfloat16)):
        param = torch.randn(n, device="cuda", generator=gen)
        grad = torch.randn(n, device="cuda", generator=gen)
        m = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(state_dtype)
        v = (torch.randn(n, device="cuda", generator=gen) ** 2).to(state_dtype)
        copies = {}
        for key in ("adamw/torch", "adamw/torch-reference"):
            copies[key] = [param.clone(), m.clone(), v.clone()]
            p2, m2, v2 = copies[key]
            load[key](p2, grad, m2, v2, step=3, **hyper)
        a, b = copies["adamw/torch"], copies["adamw/torch-reference"]
        results[f"adamw {label} max abs diff (param)"] = float((a[0] - b[0]).abs().max())
        for key in ("adamw/torch", "adamw/torch-reference"):
            p2, m2, v2 = copies[key]
            results[f"{key} {label} ms"] = median_ms(
                lambda key=key, p2=p2, g=grad, m2=m2, v2=v2: load[key](
                    p2, g, m2, v2, step=3, **hyper
                )
            )

    # chunked cross-entropy, GPT-2 head
    tokens, dim, vocab, chunk = 8 * 1024, 768, 50257, 1024
    hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    ce = load["chunked_cross_entropy/torch"]
    results["chunked_cross_entropy/torch gpt2 head ms"] = median_ms(
        lambda: ce(hidden, weight, targets, chunk)
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = ce(hidden, weight, targets, chunk)
    torch.cuda.synchronize()
    results["chunked_cross_entropy/torch gpt2 head peak extra MiB"] = (
        torch.cuda.max_memory_allocated() - before
    ) / 2**20
    results["  of which one chunk of float32 logits MiB"] = chunk * vocab * 4 / 2**20
    del out

    for key, value in results.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
