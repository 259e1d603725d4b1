"""Variants flagged ``deterministic=True`` give the same bits twice on CUDA.

Each case runs the variant (forward and, for differentiable ops, ``torch.autograd.grad``)
twice on the same inputs, at sizes where a kernel that accumulates with atomics would show
it, and compares every output bitwise. ``attention/torch`` is flagged False and is not
checked (plugin.py says why). CPU runs are not checked: the flags are about CUDA kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def twice(run: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    first = [t.clone() for t in run()]
    second = run()
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), f"output {index} differs between two runs"


def with_grads(kernel, inputs, upstream, **kwargs) -> Callable[[], tuple[torch.Tensor, ...]]:
    def run() -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = kernel(*leaves, **kwargs)
        return (out, *torch.autograd.grad(out, leaves, upstream))

    return run


def test_every_deterministic_variant_is_covered(manager) -> None:
    flagged = {v.key for v in manager.kernels() if v.deterministic}
    assert flagged <= set(CASES)
    # a case without a variant is only a Triton one where triton is not installed
    assert {key.split("/")[1] for key in set(CASES) - flagged} <= {"triton"}


def attention_math(kernel, randn):
    q, k, v, up = (randn(4, 8, 1024, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    return with_grads(kernel("attention", "torch-math"), [q, k, v], up, causal=True)


def layer_norm(kernel, randn):
    x, up = (randn(8192, 1024, device="cuda") for _ in range(2))
    w, b = randn(1024, device="cuda"), randn(1024, device="cuda")
    return with_grads(lambda *t: kernel("layer_norm", "torch")(*t, 1e-5), [x, w, b], up)


def rms_norm(kernel, randn):
    x, up = (randn(8192, 1024, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    w = randn(1024, dtype=torch.bfloat16, device="cuda")
    return with_grads(lambda *t: kernel("rms_norm", "torch")(*t, 1e-6), [x, w], up)


def elementwise(op):
    def case(kernel, randn):
        x, up = (randn(1 << 20, device="cuda") for _ in range(2))
        return with_grads(kernel(op, "torch"), [x], up)

    return case


def linear(kernel, randn):
    x, up = randn(4096, 1024, device="cuda"), randn(4096, 768, device="cuda")
    w, b = randn(768, 1024, device="cuda"), randn(768, device="cuda")
    return with_grads(kernel("linear", "torch"), [x, w, b], up)


def cross_entropy(name):
    def case(kernel, randn):
        return cross_entropy_case(kernel, randn, name)

    return case


def cross_entropy_case(kernel, randn, name):
    hidden = randn(4096, 256, dtype=torch.bfloat16, device="cuda")
    weight = randn(8192, 256, dtype=torch.bfloat16, device="cuda")
    targets = torch.randint(0, 8192, (4096,), generator=randn.generator).to("cuda")
    targets[::7] = -100
    ce = kernel("chunked_cross_entropy", name)
    return lambda: ce(hidden, weight, targets, 1000, grad_scale=0.5)


def adamw(name):
    def case(kernel, randn):
        param = randn(1 << 20, device="cuda")
        state = (randn(1 << 20, device="cuda", scale=0.1), randn(1 << 20, device="cuda") ** 2)
        grad = randn(1 << 20, device="cuda")

        def run() -> tuple[torch.Tensor, ...]:
            p, m, v = param.clone(), *(t.clone() for t in state)
            kernel("adamw", name)(
                p, grad, m, v, step=7, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1
            )
            return p, m, v

        return run

    return case


def explicit(op, make_args):
    """A case for an explicit (no autograd) op: ``make_args(randn)`` gives its arguments."""

    def for_variant(name):
        def case(kernel, randn):
            args, kwargs = make_args(kernel, randn)
            op_kernel = kernel(op, name)

            def run() -> tuple[torch.Tensor, ...]:
                result = op_kernel(*args, **kwargs)
                result = result if isinstance(result, tuple) else (result,)
                return tuple(t for t in result if t is not None)

            return run

        return case

    return for_variant


def bf16(randn, *shape):
    return randn(*shape, dtype=torch.bfloat16, device="cuda")


def attention_args(kernel, randn):
    q, k, v = (bf16(randn, 2, 8, 1024, 64) for _ in range(3))
    return (q, k, v), {"causal": True}


def attention_bwd_args(kernel, randn):
    (q, k, v), kwargs = attention_args(kernel, randn)
    out, lse = kernel("attention_fwd", "torch")(q, k, v, causal=True)
    return (bf16(randn, *q.shape), q, k, v, out, lse), kwargs


def layer_norm_args(kernel, randn):
    return (bf16(randn, 8192, 1024), bf16(randn, 1024), bf16(randn, 1024), 1e-5), {}


def layer_norm_bwd_args(kernel, randn):
    x, w, b, eps = layer_norm_args(kernel, randn)[0]
    _, mean, rstd = kernel("layer_norm_fwd", "torch")(x, w, b, eps)
    return (bf16(randn, *x.shape), x, mean, rstd, w, b), {}


def rms_norm_args(kernel, randn):
    return (bf16(randn, 8192, 1024), bf16(randn, 1024), 1e-6), {}


def rms_norm_bwd_args(kernel, randn):
    x, w, eps = rms_norm_args(kernel, randn)[0]
    _, rstd = kernel("rms_norm_fwd", "torch")(x, w, eps)
    return (bf16(randn, *x.shape), x, rstd, w), {}


def pointwise_args(count):
    return lambda kernel, randn: (tuple(bf16(randn, 1 << 20) for _ in range(count)), {})


def adamw_multi(name, op="adamw_multi"):
    """A case of ``op``: adamw_multi, or adamw_compensated_multi (a compensation per
    param, bf16 for bf16 params, float32 for float32 ones, as the two policies keep)."""

    def case(kernel, randn):
        sizes = (1 << 20, 4099)
        params = [bf16(randn, n) for n in sizes] + [randn(n, device="cuda") for n in sizes]
        grads = [randn(p.numel(), dtype=p.dtype, device="cuda") for p in params]
        states = [
            [randn(p.numel(), device="cuda", scale=0.1) for p in params],
            [randn(p.numel(), device="cuda") ** 2 for p in params],
        ]
        if op == "adamw_compensated_multi":
            states.append([randn(p.numel(), device="cuda", scale=1e-3).to(p.dtype) for p in params])

        def run() -> tuple[torch.Tensor, ...]:
            p, *rest = ([t.clone() for t in lst] for lst in (params, *states))
            kernel(op, name)(
                p, grads, *rest, step=7, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.1,
            )  # fmt: skip
            return (*p, *(t for lst in rest for t in lst))

        return run

    return case


def grouped_args(wgrad):
    def args(kernel, randn):
        rows, experts, width = 8192, 16, 512
        counts = torch.full((experts,), rows // experts, device="cuda")
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        x = bf16(randn, rows, width)
        second = bf16(randn, rows, width) if wgrad else bf16(randn, experts, width, width)
        return ((second, x) if wgrad else (x, second)) + (offsets,), {}

    return args


def rows_put_case(name):
    """``rows_put_masked`` into a fresh copy of one target each run: half the window valid."""

    def case(kernel, randn):
        values = bf16(randn, 8192, 512)
        index = torch.randperm(8192, device="cuda")
        valid = torch.arange(8192, device="cuda") < 4096
        target = bf16(randn, 8192, 512)
        op = kernel("rows_put_masked", name)

        def run() -> tuple[torch.Tensor, ...]:
            out = target.clone()
            op(values, index, valid, out)
            return (out,)

        return run

    return case


def rows_gather_case(name):
    """``rows_gather_masked`` of 8,192 rows of 512 from 1,024, half valid: the valid rows
    compared (the others hold whatever the new buffer held)."""

    def case(kernel, randn):
        source = bf16(randn, 1024, 512)
        index = torch.randint(0, 1024, (8192,), device="cuda")
        valid = torch.arange(8192, device="cuda") < 4096
        op = kernel("rows_gather_masked", name)

        def run() -> tuple[torch.Tensor, ...]:
            return (op(source, index, valid)[valid],)

        return run

    return case


def swiglu_rows_case(name):
    """``swiglu_rows_bwd`` over 8,192 rows of an inner width of 512, half valid: the
    valid rows compared."""

    def case(kernel, randn):
        gate_up, d_act = bf16(randn, 8192, 1024), bf16(randn, 8192, 512)
        weights = bf16(randn, 8192, 1).squeeze(1)
        valid = torch.arange(8192, device="cuda") < 4096
        op = kernel("swiglu_rows_bwd", name)

        def run() -> tuple[torch.Tensor, ...]:
            return tuple(t[valid] for t in op(gate_up, d_act, weights, valid))

        return run

    return case


def rows_add_args(kernel, randn):
    """The reference's adds (float64 on the CPU): 8,192 rows into 1,024 tokens, half valid."""
    into = torch.randint(0, 1024, (8192,), device="cuda")
    valid = torch.arange(8192, device="cuda") < 4096
    return (bf16(randn, 8192, 512), into, valid, randn(8192, device="cuda"), 1024), {}


def delta_rule_args(kernel, randn):
    """Two sequences of 256 tokens, 2 key heads for 4 value heads of 64."""
    q, k = (
        torch.nn.functional.normalize(randn(2, 256, 2, 64, device="cuda"), dim=-1) for _ in "qk"
    )
    v = randn(2, 256, 4, 64, device="cuda")
    g = -torch.nn.functional.softplus(randn(2, 256, 4, device="cuda"))
    beta = torch.sigmoid(randn(2, 256, 4, device="cuda"))
    return (q, k, v, g, beta), {}


def delta_rule_bwd_args(kernel, randn):
    inputs, _ = delta_rule_args(kernel, randn)
    return (randn(*inputs[2].shape, device="cuda"), *inputs), {}


def sparse_attention_args(kernel, randn):
    """Two sequences of 256 tokens, 4 heads of 64, each query's 32 keys the top-k of random
    scores with itself first and later keys last (as an indexer's top-k of an early query)."""
    q, k, v = (bf16(randn, 2, 4, 256, 64) for _ in "qkv")
    scores = randn(2, 256, 256, device="cuda")
    later = torch.ones(256, 256, dtype=torch.bool, device="cuda").triu(1)
    scores = scores.masked_fill(later, float("-inf"))
    scores.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    indices = scores.topk(32, dim=-1).indices.to(torch.int32)
    return (q, k, v, indices), {}


def sparse_attention_bwd_args(kernel, randn):
    (q, k, v, indices), _ = sparse_attention_args(kernel, randn)
    out, lse = kernel("sparse_attention_fwd", "reference")(q, k, v, indices)
    return (bf16(randn, *out.shape), q, k, v, out, lse, indices), {}


def sparse_attention_probs_args(kernel, randn):
    (q, k, v, indices), _ = sparse_attention_args(kernel, randn)
    _, lse = kernel("sparse_attention_fwd", "reference")(q, k, v, indices)
    return (q, k, lse, indices), {}


EXPLICIT_CASES = {
    "sparse_attention_fwd": explicit("sparse_attention_fwd", sparse_attention_args),
    "sparse_attention_bwd": explicit("sparse_attention_bwd", sparse_attention_bwd_args),
    "sparse_attention_probs": explicit("sparse_attention_probs", sparse_attention_probs_args),
    "gated_delta_rule_fwd": explicit("gated_delta_rule_fwd", delta_rule_args),
    "gated_delta_rule_bwd": explicit("gated_delta_rule_bwd", delta_rule_bwd_args),
    "grouped_mm": explicit("grouped_mm", grouped_args(False)),
    "grouped_mm_wgrad": explicit("grouped_mm_wgrad", grouped_args(True)),
    "attention_fwd": explicit("attention_fwd", attention_args),
    "attention_bwd": explicit("attention_bwd", attention_bwd_args),
    "layer_norm_fwd": explicit("layer_norm_fwd", layer_norm_args),
    "layer_norm_bwd": explicit("layer_norm_bwd", layer_norm_bwd_args),
    "rms_norm_fwd": explicit("rms_norm_fwd", rms_norm_args),
    "rms_norm_bwd": explicit("rms_norm_bwd", rms_norm_bwd_args),
    "gelu_bwd": explicit("gelu_bwd", pointwise_args(2)),
    "swiglu_fwd": explicit("swiglu_fwd", pointwise_args(2)),
    "swiglu_bwd": explicit("swiglu_bwd", pointwise_args(3)),
    "adamw_multi": adamw_multi,
    "adamw_compensated_multi": lambda name: adamw_multi(name, "adamw_compensated_multi"),
}

CASES = {
    "attention/torch-math": attention_math,
    "layer_norm/torch": layer_norm,
    "rms_norm/torch": rms_norm,
    "gelu/torch": elementwise("gelu"),
    "silu/torch": elementwise("silu"),
    "linear/torch": linear,
    "chunked_cross_entropy/torch": cross_entropy("torch"),
    "chunked_cross_entropy/reference": cross_entropy("reference"),
    "chunked_cross_entropy/triton": cross_entropy("triton"),
    "attention_fwd/cudnn": explicit("attention_fwd", attention_args)("cudnn"),
    "adamw/torch": adamw("torch"),
    # rows_add_masked's torch and triton variants are flagged False (atomics)
    "rows_add_masked/reference": explicit("rows_add_masked", rows_add_args)("reference"),
    **{f"rows_put_masked/{name}": rows_put_case(name) for name in ("torch", "reference", "triton")},
    **{
        f"rows_gather_masked/{name}": rows_gather_case(name)
        for name in ("torch", "reference", "triton")
    },
    **{
        f"swiglu_rows_bwd/{name}": swiglu_rows_case(name)
        for name in ("torch", "reference", "triton")
    },
    "adamw/torch-reference": adamw("torch-reference"),
    # attention_bwd/torch and sparse_attention_bwd/torch are flagged False (atomics), like
    # attention/torch
    **{
        f"{op}/{name}": make(name)
        for op, make in EXPLICIT_CASES.items()
        for name in ("torch", "reference", "triton")
        if f"{op}/{name}" not in {"attention_bwd/torch", "sparse_attention_bwd/torch"}
    },
}


@pytest.mark.gpu
@pytest.mark.parametrize("key", sorted(CASES))
def test_two_runs_give_the_same_bits(manager, kernel, randn, key) -> None:
    if key not in {v.key for v in manager.kernels()}:
        pytest.skip(f"{key} is not registered here (triton not installed)")
    twice(CASES[key](kernel, randn))
