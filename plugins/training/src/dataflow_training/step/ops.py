"""The ops a family's math calls, by name, and how to get implementations of them.

Math functions call ``env.ops[NAME]`` instead of torch directly, so a kernel package can
swap in faster variants (a Triton attention, a fused norm) without touching the family.
The op set is open: an implementation is a ``KernelVariant(op=NAME, ...)`` registered
through the ``dataflow_kernels`` hook, by a kernel package or by a family that brings an
op of its own (then it registers at least a reference variant of it). A family lists
every op its math calls in ``Family.ops``; ``load_ops`` hands it exactly those.

The standard ops (``STANDARD_OPS``; ``dataflow-kernels-torch`` provides a fast and a
reference variant of each). Tensors are torch tensors; "stats" are float32 (float64 for
float64 inputs). Backward ops never rebuild autograd graphs and never re-run a forward.

- ``linear(x, weight, bias=None) -> y``: ``x @ weight.T + bias``, weight (out, in).
- ``attention_fwd(q, k, v, *, causal, scale=None) -> (out, lse)``: q, k, v (batch, heads,
  seq, head_dim), equal head counts; lse stats (batch, heads, seq). A family with a
  sliding window passes ``window=W`` too (causal, query ``i`` sees keys ``i - W < j <=
  i``), only where ``W`` is below the sequence length, so a variant that never meets a
  windowed family need not take it; likewise ``mask=`` (a (seq, seq) bool keep-mask) and
  ``segments=`` (per-token sequence ids of a padded or packed batch), each only where it
  cuts something (docs/kernel_registry.md has the contract).
- ``attention_bwd(dout, q, k, v, out, lse, *, causal, scale=None) -> (dq, dk, dv)``, and
  ``window``, ``mask``, ``segments`` as the forward.
- ``layer_norm_fwd(x, weight, bias, eps) -> (y, mean, rstd)`` over the last dimension;
  mean and rstd stats of shape ``x.shape[:-1]``.
- ``layer_norm_bwd(dy, x, mean, rstd, weight, bias) -> (dx, dweight, dbias)``.
- ``rms_norm_fwd(x, weight, eps) -> (y, rstd)``; ``rms_norm_bwd(dy, x, rstd, weight)
  -> (dx, dweight)``.
- ``gelu(x) -> y`` (tanh approximation, GPT-2's ``gelu_new``); ``gelu_bwd(dy, x) -> dx``.
- ``swiglu_fwd(gate, up) -> silu(gate) * up``; ``swiglu_bwd(dy, gate, up) -> (dgate, dup)``.
- ``chunked_cross_entropy(hidden, weight, targets, chunk_tokens, *, grad_scale=1.0,
  vocab_tiles=False, vocab=None, d_weight_into=None, scale_by=None) -> (loss_sum,
  d_hidden, d_weight)``: logits = hidden @ weight.T chunk
  by chunk of ``chunk_tokens`` rows (matmuls in the input dtype, the loss in float32);
  returns the summed loss (0-d float32) and ``grad_scale`` times its gradients, never
  holding more than one chunk's logits. hidden (tokens, dim), weight (vocab, dim), targets
  int64 (tokens,); a target of -100 is ignored. ``vocab_tiles=True`` asks for d_weight
  one vocabulary tile at a time (the logits made again per tile) instead of summed over
  the chunks in a float32 (vocab, dim) table; the head passes it only when
  ``TrainConfig.head_vocab_tiles`` is set, so a variant may leave it out. ``vocab=V``
  (V below weight's rows) says the vocabulary is weight's first V rows, the rest padding
  (a config's ``vocab_multiple``): the logits past V take no part in the softmax or the
  loss and d_weight is zero in those rows. The kit's heads pass it whenever the stored
  weight is padded, so a variant must take it. ``d_weight_into`` (16-bit tensors shaped
  as weight or its pieces) and ``scale_by`` (a 0-d float32 device tensor every gradient
  is also multiplied by): each chunk's d_weight product added into those tensors, which
  come back as d_weight, no float32 (vocab, dim) sum made; passed only with
  ``TrainConfig.head_accumulate="gradient"``.
- ``grouped_mm(x, weight, offsets) -> y`` and ``grouped_mm_wgrad(dy, x, offsets) ->
  d_weight``: a matmul per expert over rows sorted by expert (MoE FFNs; ``offsets`` int32
  ``(E + 1,)``): x (N, in), weight (E, out, in), y (N, out); d_weight (E, out, in). Not in
  ``STANDARD_OPS``: the MoE families list them in their ``ops``.
- ``rows_add_masked(rows, into, valid, weights, count, *, slices=1) -> out``,
  ``rows_put_masked(values, index, valid, target) -> None`` and
  ``rows_gather_masked(source, index, valid) -> rows``: an expert shard's window rows
  (``kit.moe.ShardWindow``) summed into their tokens ((count, hidden) float32, each valid
  row times its weight), written into their places, or gathered from their sources; the
  rows ``valid`` does not mark are never read (and, gathered, hold anything); and
  ``swiglu_rows_bwd(gate_up, d_act, weights, valid) -> (act, d_gate_up, d_weights)``,
  the SwiGLU part of a shard's backward over its window rows (the activation times each
  row's routing weight, the gate and up gradients, the weights' gradients in float32).
  Not in ``STANDARD_OPS``: the MoE families list them.
- ``gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None) -> out`` and
  ``gated_delta_rule_bwd(d_out, q, k, v, g, beta, *, scale=None) -> (dq, dk, dv, dg,
  dbeta)``: Gated DeltaNet's recurrence (linear attention; ``dataflow_kernels_torch.
  delta_rule`` says it in full): q, k (batch, seq, k_heads, k_dim), v (batch, seq,
  v_heads, v_dim), g (log decay) and beta (batch, seq, v_heads); the backward takes the
  forward's inputs and re-derives the chunk states itself. Not in ``STANDARD_OPS``: the
  families with linear attention list them.
- ``dequantize_int8(codes, scale, dtype) -> weight`` and ``dequantize_nf4(codes, absmax,
  dtype) -> weight``: a LoRA base stored in 8 or 4 bits as the dense (out, in) weight in
  ``dtype`` (``dataflow_training.kit.lora_base`` has the formats; the training plugin
  registers their reference variants). Not in ``STANDARD_OPS``: loaded for a LoRA run
  with ``--lora-base int8`` or ``nf4``.
- ``adamw_multi(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
  weight_decay) -> None``: one AdamW step over lists of tensors (one multi-tensor launch
  where the device has one), float32 math whatever the storage dtypes.

Older per-call ops (``attention``, ``layer_norm``, ``rms_norm``, ``silu``, ``adamw``:
differentiable forwards and a single-tensor AdamW) stay registered for code that uses
autograd; the builtin families do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from dataflow import UnknownNameError, kernels

STANDARD_OPS = (
    "linear",
    "attention_fwd",
    "attention_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "gelu",
    "gelu_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "chunked_cross_entropy",
    "adamw_multi",
)

Ops = Mapping[str, Callable]


class MissingOpError(LookupError):
    """No installed kernel package provides an op a family or optimizer needs."""


def load_ops(
    device: str = "cpu", names: Iterable[str] = STANDARD_OPS, *, deterministic: bool = False
) -> dict[str, Callable]:
    """One implementation of every op in ``names`` for ``device``, from the kernel
    registry: the highest-priority variant supporting the device (only deterministic
    ones when asked). Raises ``MissingOpError`` naming each op nobody provides."""

    registry = kernels()
    chosen: dict[str, Callable] = {}
    missing = []
    for op in dict.fromkeys(names):
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
        raise MissingOpError(
            f"no kernel variant for op(s) {', '.join(missing)} on {device!r}"
            f"{' (deterministic)' if deterministic else ''}; install dataflow-kernels-torch "
            "or see `dataflow kernels list`"
        )
    return chosen


def autograd_ops(base: Mapping[str, Callable]) -> dict[str, Callable]:
    """``base`` with every standard forward op replaced by a differentiable plain-torch
    formula, so autograd through a family's forward is a truth its hand-written backward
    can be checked against (``dataflow verify``'s task level). Statistics the forwards
    return (logsumexp, mean, rstd) carry no gradient. Ops other than the standard
    forwards stay as ``base`` has them."""

    # the step stage lowers and plans without torch: torch loads when a task runs
    import torch
    import torch.nn.functional as F

    def stats(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.promote_types(t.dtype, torch.float32))

    def attention_fwd(q, k, v, *, causal, scale=None, window=None, mask=None):
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        group = q.shape[1] // k.shape[1]  # grouped key/value heads: each for its query heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2)) * scale
        keep = mask  # the pairs a mask keeps, then causal and the window
        if causal:
            seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            if window is not None:  # and at most ``window`` keys back, itself included
                seen = seen & ~seen.tril(-window)
            keep = seen if keep is None else keep & seen
        if keep is not None:
            scores = scores.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(scores, -1)
        return torch.softmax(scores, -1) @ v, stats(lse)

    def layer_norm_fwd(x, weight, bias, eps):
        mean = x.mean(-1)
        rstd = torch.rsqrt(x.var(-1, unbiased=False) + eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), stats(mean), stats(rstd)

    def rms_norm_fwd(x, weight, eps):
        rstd = torch.rsqrt((x * x).mean(-1) + eps)
        return x * rstd.unsqueeze(-1) * weight, stats(rstd)

    def grouped_mm(x, weight, offsets):
        bounds = offsets.tolist()
        parts = [x[bounds[e] : bounds[e + 1]] @ weight[e].t() for e in range(weight.shape[0])]
        return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])

    def gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None):
        # the recurrence token by token: S = a S + beta k (v - (a S)^T k)^T, o = scale S^T q
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        group = v.shape[2] // k.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        outs = []
        for t in range(q.shape[1]):
            state = state * g[:, t].exp()[..., None, None].to(state)
            delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, ..., None]
            state = state + k[:, t, ..., None] * delta[..., None, :]
            outs.append(scale * (state * q[:, t, ..., None]).sum(-2))
        return torch.stack(outs, 1)

    return {
        **base,
        "linear": F.linear,
        "gated_delta_rule_fwd": gated_delta_rule_fwd,
        "grouped_mm": grouped_mm,
        "attention_fwd": attention_fwd,
        "layer_norm_fwd": layer_norm_fwd,
        "rms_norm_fwd": rms_norm_fwd,
        "gelu": lambda x: F.gelu(x, approximate="tanh"),
        "swiglu_fwd": lambda gate, up: F.silu(gate) * up,
    }
