"""The ops a family's math may call, by name, and how to get implementations of them.

Math functions take ``ops``, a mapping from the names below to callables, instead of
calling torch directly, so a kernel package can swap in faster variants (a Triton
attention, a fused norm) without touching the family. Implementations are registered as
``KernelVariant(op=NAME, ...)`` through the ``dataflow_kernels`` hook; the
``dataflow-kernels-torch`` package provides the reference variant of every op.

Every variant must be differentiable through torch autograd (a math function's backward
may rebuild a small graph and call ``torch.autograd.grad``), except ``adamw`` and
``chunked_cross_entropy``, which compute their gradients themselves.

Signatures (tensors are torch tensors; shapes as named):

- ``attention(q, k, v, *, causal: bool) -> out``: q, k, v (batch, heads, seq, head_dim).
- ``layer_norm(x, weight, bias, eps: float) -> y`` over the last dimension.
- ``rms_norm(x, weight, eps: float) -> y`` over the last dimension.
- ``gelu(x) -> y``: the tanh approximation (GPT-2's ``gelu_new``).
- ``silu(x) -> y``.
- ``linear(x, weight, bias=None) -> y``: ``x @ weight.T + bias``, weight (out, in).
- ``chunked_cross_entropy(hidden, weight, targets, chunk_tokens: int)
  -> (loss_sum, d_hidden, d_weight)``: logits = hidden @ weight.T chunk by chunk of
  ``chunk_tokens`` rows; returns the summed loss (0-d float32), d loss_sum / d hidden and
  d loss_sum / d weight, never holding more than one chunk's logits. hidden (tokens, dim),
  weight (vocab, dim), targets int64 (tokens,); a target of -100 is ignored.
- ``adamw(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
  beta2: float, eps: float, weight_decay: float) -> None``: one decoupled-weight-decay
  Adam step, in place on param, exp_avg, exp_avg_sq (states may be a lower precision than
  param: math in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

OP_NAMES = (
    "attention",
    "layer_norm",
    "rms_norm",
    "gelu",
    "silu",
    "linear",
    "chunked_cross_entropy",
    "adamw",
)

Ops = Mapping[str, Callable]


def load_ops(device: str = "cpu", *, deterministic: bool = False) -> dict[str, Callable]:
    """One implementation of every op for ``device``, from the kernel registry: the
    highest-priority variant supporting the device (only deterministic ones when asked).
    Raises an error naming each op that no installed kernel package provides."""
    from dataflow.plugins import kernels
    from dataflow.registry import UnknownNameError

    registry = kernels()
    chosen: dict[str, Callable] = {}
    missing = []
    for op in OP_NAMES:
        try:
            variants = registry.for_op(op, device=device)  # highest priority first
        except UnknownNameError:
            variants = []
        variants = [v for v in variants if v.deterministic or not deterministic]
        if not variants:
            missing.append(op)
            continue
        chosen[op] = variants[0].load()
    if missing:
        raise LookupError(
            f"no kernel variant for op(s) {', '.join(missing)} on {device!r}"
            f"{' (deterministic)' if deterministic else ''}; install dataflow-kernels-torch "
            "or see `dataflow kernels list`"
        )
    return chosen
