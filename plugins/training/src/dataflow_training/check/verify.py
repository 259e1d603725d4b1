"""The correctness ladder: ops, tasks and whole training steps against independent truths.

- **op**: every op the kernel registry picks for the device, against a float64 formula
  written here (softmax attention, the norm formulas, full cross-entropy with autograd,
  the AdamW update).
- **task**: every layer kind's math: recompute (and each partial save's rederive) equals
  what forward saved; the hand
  backward equals autograd through the family's own forward; the fused head gives the
  same loss and gradients whatever its chunk size.
- **step**: the lowered program, planned into a budget and run on the engine for several
  steps of several accumulation rounds, against the family's plain-autograd reference
  model trained with ``torch.optim.AdamW`` in float64, each step from the weights and
  AdamW moments the engine's step starts from: every round's loss, every weight gradient
  and every weight after the step. A reference that
  ``follows_routing`` (mixture of experts) routes with the engine's recorded expert
  choices, and ``routing_checks`` holds those choices to the reference's own top-k up to
  near ties.

Errors are relative, ``||out - ref|| / ||ref||`` (METHOD.md), with the largest absolute
difference beside it; tolerances per dtype policy are in ``TOLERANCES`` and explained in
docs/correctness_compare.md. In bf16 a step's gradient check may also pass within
``YARDSTICK_FACTOR`` times the error of plain bf16 autograd on the same gradient (its
yardstick, ``step_checks``).

The op and task levels and the ladder are here; the step level is ``verify_step.py``,
``Check``, ``compare``, ``TOLERANCES`` and ``YARDSTICK_FACTOR`` are ``verify_checks.py``,
all of them re-exported here (the public names: docs/api.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dataflow_training.check.verify_checks import TOLERANCES, YARDSTICK_FACTOR, Check, compare
from dataflow_training.check.verify_step import (
    adam_moments,
    check_state_keys,
    follows_routing,
    routing_checks,
    step_checks,
    step_config,
)
from dataflow_training.drive.progress import ProgressCallback
from dataflow_training.drive.run import resolver_for
from dataflow_training.drive.values import stored_state
from dataflow_training.step.config import DtypePolicy
from dataflow_training.step.family import (
    Env,
    RowGradient,
    embed_layer,
    head_layer,
    load_family,
    partial_saves,
)
from dataflow_training.step.ops import STANDARD_OPS, autograd_ops, load_ops

__all__ = [
    "LEVELS",
    "TOLERANCES",
    "YARDSTICK_FACTOR",
    "Check",
    "adam_moments",
    "check_levels",
    "check_state_keys",
    "compare",
    "follows_routing",
    "op_checks",
    "routing_checks",
    "step_checks",
    "step_config",
    "step_host_bytes",
    "CUDA_STEP_BYTES_PER_PARAM",
    "task_checks",
    "verify",
]

#: the ladder's levels, in the order they run
LEVELS = ("op", "task", "step")

#: Host memory the step level takes on the CPU, per model parameter: the float64
#: reference with its gradients and AdamW state, the engine's run (its objects and their
#: slow-pool slices), the start weights and each step's compared copies. Measured peak RSS
#: (session 24, this repository's CPU machine, 2 x 16 tokens, 2 rounds, 1 step): qwen3_0_6b
#: cut to vocabulary 8,192 and 2 layers (39.9M parameters) 104 (fp32) and 95 (bf16) bytes
#: a parameter, 4 layers (71.3M) 99; 93 a parameter between the two. Used to refuse, up
#: front, a step level the host cannot hold (``step_host_bytes``).
CPU_STEP_BYTES_PER_PARAM = 100

#: Host memory the step level takes at least with the engine on CUDA, per parameter: the
#: float64 reference's weights, gradients and two AdamW moments (32 bytes) and the
#: gradients and weights each of its steps returns in float64 (16); the engine's state is
#: on the device. A floor, not an estimate: Qwen 3.5's dense cut (2.9B parameters, 139 GB
#: by it) was killed for memory on the device machine's 128 GiB host after four minutes
#: (session 41), where l3_1b (1.24B) had run.
CUDA_STEP_BYTES_PER_PARAM = 48


def model_params(family: Any, config: Any) -> int:
    """The model's parameters as its layers declare them (a tied weight once)."""
    return sum(math.prod(p.shape) for layer in family.layers(config) for p in layer.params)


def step_host_bytes(family: Any, config: Any, device: str = "cpu") -> int:
    """What the step level holds in host memory: about that on the CPU
    (``CPU_STEP_BYTES_PER_PARAM``), at least that with the engine on CUDA
    (``CUDA_STEP_BYTES_PER_PARAM``)."""
    per = CPU_STEP_BYTES_PER_PARAM if device == "cpu" else CUDA_STEP_BYTES_PER_PARAM
    return per * model_params(family, config)


def check_levels(levels: Sequence[str]) -> None:
    """``ValueError`` unless ``levels`` names one or more of ``LEVELS`` and nothing else
    (``verify``'s ``levels``, ``dataflow verify --levels``)."""
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or not levels:
        raise ValueError(f"levels {unknown or '(none)'}: each is one of {', '.join(LEVELS)}")


# -- ops ---------------------------------------------------------------------------------
def _ref_attention(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return scores.softmax(-1) @ v, torch.logsumexp(scores, -1)


def _ref_layer_norm(x, w, b, eps):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def _ref_rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _ref_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _grads(out, inputs, d_out):
    return torch.autograd.grad(out, inputs, d_out)


#: Gated DeltaNet's op pair: checked where a family's ops name them
DELTA_RULE_OPS = ("gated_delta_rule_fwd", "gated_delta_rule_bwd")


def op_checks(
    device: str, dtype: torch.dtype, tolerance: float, seed: int, names: Any = None
) -> list[Check]:
    """Each op in ``names`` (default: every standard op) that has a check here, forward
    and backward, against autograd through a float64 formula."""
    names = set(STANDARD_OPS if names is None else names)
    ops = load_ops(device, sorted(names & {*STANDARD_OPS, *DELTA_RULE_OPS}))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype)

    checks: list[Check] = []

    def check(name: str, outs: Any, refs: Any) -> None:
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            if out is not None:
                checks.append(compare("op", f"{name}[{i}]", out, ref, tolerance))

    if {"attention_fwd", "attention_bwd"} & names:
        q, k, v = rand(2, 3, 7, 8), rand(2, 3, 7, 8), rand(2, 3, 7, 8)
        ref_out, ref_lse = _ref_attention(q, k, v)
        d_out = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
        out, lse = ops["attention_fwd"](on(q), on(k), on(v), causal=True)
        check("attention_fwd", (out, lse), (ref_out, ref_lse))
        if "attention_bwd" in names:
            check(
                "attention_bwd",
                ops["attention_bwd"](on(d_out), on(q), on(k), on(v), out, lse, causal=True),
                _grads(ref_out, (q, k, v), d_out),
            )
    x, w, b = rand(5, 12), (1 + 0.1 * rand(12)).detach().requires_grad_(), rand(12)
    dy = torch.randn(5, 12, generator=g, dtype=torch.float64)
    if "layer_norm_fwd" in names:
        ref = _ref_layer_norm(x, w, b, 1e-5)
        y, mean, rstd = ops["layer_norm_fwd"](on(x), on(w), on(b), 1e-5)
        check("layer_norm_fwd", (y,), (ref,))
        if "layer_norm_bwd" in names:
            check(
                "layer_norm_bwd",
                ops["layer_norm_bwd"](on(dy), on(x), mean, rstd, on(w), on(b)),
                _grads(ref, (x, w, b), dy),
            )
    if "rms_norm_fwd" in names:
        ref = _ref_rms_norm(x, w, 1e-6)
        y, rstd = ops["rms_norm_fwd"](on(x), on(w), 1e-6)
        check("rms_norm_fwd", (y,), (ref,))
        if "rms_norm_bwd" in names:
            check(
                "rms_norm_bwd",
                ops["rms_norm_bwd"](on(dy), on(x), rstd, on(w)),
                _grads(ref, (x, w), dy),
            )
    if "gelu" in names:
        ref = _ref_gelu(x)
        check("gelu", (ops["gelu"](on(x)),), (ref,))
        if "gelu_bwd" in names:
            check("gelu_bwd", (ops["gelu_bwd"](on(dy), on(x)),), _grads(ref, (x,), dy))
    if "swiglu_fwd" in names:
        gate, up = rand(5, 12), rand(5, 12)
        ref = gate * torch.sigmoid(gate) * up
        check("swiglu_fwd", (ops["swiglu_fwd"](on(gate), on(up)),), (ref,))
        if "swiglu_bwd" in names:
            check(
                "swiglu_bwd",
                ops["swiglu_bwd"](on(dy), on(gate), on(up)),
                _grads(ref, (gate, up), dy),
            )
    if "linear" in names:
        weight = rand(9, 12)
        check("linear", (ops["linear"](on(x), on(weight), on(b[:9])),), (x @ weight.T + b[:9],))
    if "chunked_cross_entropy" in names:
        hidden, vocab_w = rand(11, 12), rand(20, 12)
        targets = torch.randint(0, 20, (11,), generator=g)
        targets[3] = -100
        loss_ref = F.cross_entropy(hidden @ vocab_w.T, targets, reduction="sum", ignore_index=-100)
        check(
            "chunked_cross_entropy",
            ops["chunked_cross_entropy"](
                on(hidden), on(vocab_w), targets.to(device), 4, grad_scale=0.5
            ),
            (loss_ref, *(0.5 * t for t in _grads(loss_ref, (hidden, vocab_w), None))),
        )
        # a vocabulary stored padded (``vocab_multiple``): the last 4 rows out of the
        # softmax, their gradient zero
        real, targets = vocab_w[:16], torch.where(targets < 0, targets, targets % 16)
        loss_ref = F.cross_entropy(hidden @ real.T, targets, reduction="sum", ignore_index=-100)
        d_hidden, d_real = _grads(loss_ref, (hidden, real), None)
        padding = torch.zeros(4, 12, dtype=torch.float64)
        check(
            "chunked_cross_entropy vocab=16 of 20 rows",
            ops["chunked_cross_entropy"](
                on(hidden), on(vocab_w), targets.to(device), 4, grad_scale=0.5, vocab=16
            ),
            (loss_ref, 0.5 * d_hidden, torch.cat((0.5 * d_real, padding))),
        )
    if "gated_delta_rule_fwd" in names:  # against the recurrence under autograd
        q, k = (F.normalize(rand(2, 70, 2, 8), dim=-1).detach().requires_grad_() for _ in "qk")
        v, decay, beta = rand(2, 70, 4, 6), rand(2, 70, 4), rand(2, 70, 4)
        log_decay, gate = -F.softplus(decay), torch.sigmoid(beta)
        ref = autograd_ops({})["gated_delta_rule_fwd"](q, k, v, log_decay, gate)
        # the log decay stays float32 at least (the rule's ops take it so)
        inputs = [*(on(t) for t in (q, k, v)), log_decay.detach().to(device), on(gate)]
        check("gated_delta_rule_fwd", (ops["gated_delta_rule_fwd"](*inputs),), (ref,))
        if "gated_delta_rule_bwd" in names:
            d_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
            check(
                "gated_delta_rule_bwd",
                ops["gated_delta_rule_bwd"](on(d_out), *inputs),
                _grads(ref, (q, k, v, log_decay, gate), d_out),
            )
    if "adamw_multi" in names:
        checks.append(_adamw_check(ops["adamw_multi"], device, dtype, tolerance, g))
    return checks


def _adamw_check(
    adamw_multi: Callable, device: str, dtype: torch.dtype, tolerance: float, g: Any
) -> Check:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    shapes = [(33,), (4, 5)]
    p = [rand(*s) for s in shapes]
    m = [0.1 * rand(*s) for s in shapes]
    v = [rand(*s).abs() for s in shapes]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    out = [[t.to(device=device, dtype=dtype) for t in ts] for ts in (p, m, v)]
    ref_p, ref_m, ref_v = [t.clone() for t in p], [t.clone() for t in m], [t.clone() for t in v]
    for step in range(1, 4):
        grads = [rand(*s) for s in shapes]
        adamw_multi(
            out[0],
            [t.to(device=device, dtype=dtype) for t in grads],
            out[1],
            out[2],
            step=step,
            lr=lr,
            beta1=b1,
            beta2=b2,
            eps=eps,
            weight_decay=wd,
        )
        for i, grad in enumerate(grads):
            ref_p[i] *= 1 - lr * wd
            ref_m[i] = b1 * ref_m[i] + (1 - b1) * grad
            ref_v[i] = b2 * ref_v[i] + (1 - b2) * grad * grad
            ref_p[i] -= (
                lr * (ref_m[i] / (1 - b1**step)) / (torch.sqrt(ref_v[i] / (1 - b2**step)) + eps)
            )
    flat_out = torch.cat([t.reshape(-1) for t in out[0]])
    return compare(
        "op",
        "adamw_multi (3 steps)",
        flat_out,
        torch.cat([t.reshape(-1) for t in ref_p]),
        tolerance,
    )


# -- tasks -------------------------------------------------------------------------------
def task_checks(
    family: Any,
    config: Any,
    device: str,
    dtype: torch.dtype,
    tolerance: float,
    seed: int,
    batch: int = 2,
    seq_len: int = 8,
) -> list[Check]:
    """Every layer kind's math: recompute equals what forward saved; the hand backward
    equals autograd through the family's own forward (run on differentiable formulas of
    the forward ops, ``autograd_ops``); the fused head gives the same loss
    and gradients whatever its chunk size. Aux is left out here (an empty ``env.aux``: no
    load counts, no balance term); the step level checks it."""
    ops = load_ops(device, family.ops)
    torch.manual_seed(seed)
    state = {
        k: v.to(device=device, dtype=dtype)
        for k, v in family.reference_model(config).state_dict().items()
    }
    check_state_keys(family, config, state)
    layers = family.layers(config)
    state = stored_state(layers, state)  # the tasks see the tables padded, as in a step
    checks: list[Check] = []
    hidden_shape = family.hidden_shape(config, batch, seq_len)
    seen: set[str] = set()
    shared = _leader_selection(family, config, layers, state, ops, device, dtype, hidden_shape)
    with torch.enable_grad():
        for layer in layers:
            params = {p.name: state[f"{layer.name}.{p.name}"] for p in layer.params}
            if layer.kind == "head" or layer.kind in seen:
                continue
            seen.add(layer.kind)
            checks += _layer_checks(
                family,
                config,
                layer,
                params,
                ops,
                device,
                dtype,
                tolerance,
                batch,
                seq_len,
                hidden_shape,
                shared.get(layer.leader, {}),
            )
    checks += _head_checks(
        family, config, layers, state, ops, device, dtype, tolerance, hidden_shape
    )
    return checks


def _leader_selection(
    family, config, layers, state, ops, device, dtype, hidden_shape
) -> dict[str, dict[str, torch.Tensor]]:
    """Each leader's AuxTemp (its forward on a random input): what its followers' tasks
    see as ``env.shared`` (``LayerSpec.leader``); empty without followers."""
    leaders = {layer.leader for layer in layers if getattr(layer, "leader", "")}
    out = {}
    for layer in layers:
        if layer.name not in leaders:
            continue
        params = {p.name: state[f"{layer.name}.{p.name}"] for p in layer.params}
        x = torch.randn(hidden_shape, device=device, dtype=dtype)
        with torch.no_grad():
            _, _, out[layer.name] = family.math(layer.kind).forward(config, params, x, Env(ops))
    return out


def _dense(grad: Any) -> torch.Tensor:
    """A gradient as one tensor (a ``RowGradient`` made whole)."""

    return grad.dense() if isinstance(grad, RowGradient) else grad


def _layer_checks(
    family,
    config,
    layer,
    params,
    ops,
    device,
    dtype,
    tolerance,
    batch,
    seq_len,
    hidden_shape,
    shared=None,
):
    """``shared``: a follower's leader's AuxTemp (``env.shared``)."""
    shared = shared or {}
    env = Env(ops, shared=shared)
    math_ = family.math(layer.kind)

    trainable = [p.name for p in layer.params if p.trainable]
    leaves = {k: v.clone().requires_grad_(k in trainable) for k, v in params.items()}
    if layer.kind == "embed":
        vocab = layer.params[0].state_shape[0]
        tokens = torch.randint(0, vocab, (batch, seq_len), device=device)
        y = math_.forward(config, leaves, tokens, Env(autograd_ops(ops)))
        dy = torch.randn_like(y)
        auto = torch.autograd.grad(y, [leaves[n] for n in trainable], dy)
        grads = math_.backward(config, tokens, dy, env)
        return [
            compare("task", f"embed backward d{name}", _dense(grads[name]), g, tolerance)
            for name, g in zip(trainable, auto, strict=True)
        ]
    x = torch.randn(hidden_shape, device=device, dtype=dtype)
    with torch.no_grad():
        y, saved, aux_temp = math_.forward(config, params, x, env)
        again = math_.recompute(config, params, x, aux_temp, env)
    checks = [
        compare("task", f"{layer.kind} recompute {name}", again[name], saved[name], tolerance)
        for name in saved
    ]
    saved_specs = math_.saved(config, batch, seq_len)
    for partial in partial_saves(math_, config, saved_specs).values():
        kept = {name: saved[name] for name in partial.keeps}
        with torch.no_grad():
            rest = math_.rederive(config, params, x, kept, aux_temp, env, partial.name)
        checks += [
            compare(
                "task",
                f"{layer.kind} rederive {partial.name!r} {s.name}",
                rest.get(s.name, torch.full((0,), math.nan)),
                saved[s.name],
                tolerance,
            )
            for s in saved_specs
            if s.name not in partial.keeps
        ]
    specs = {s.name: tuple(s.shape) for s in saved_specs}
    for name, value in saved.items():
        if specs.get(name) != tuple(value.shape):
            checks.append(
                Check(
                    "task",
                    f"{layer.kind} saved {name!r} shape {tuple(value.shape)} declared {specs.get(name)}",
                    math.inf,
                    math.inf,
                    tolerance,
                )
            )
    x_leaf = x.clone().requires_grad_()
    dy = torch.randn_like(y)
    # autograd routes with forward's choices: a near tie between two experts' router
    # probabilities, ranked the other way by autograd's rounding, would otherwise send a
    # token elsewhere and move the experts' gradients by far more than rounding does
    # (bf16 with 256 experts: 5-8 % of theirs); the step level checks the choices
    # themselves (``routing_checks``)
    route_ids = aux_temp.get("ids") if isinstance(aux_temp, dict) else None
    auto_env = Env(autograd_ops(ops), shared=shared, route_ids=route_ids)
    y_auto, _, _ = math_.forward(config, leaves, x_leaf, auto_env)
    target = (y_auto * dy).sum()
    term = getattr(math_, "objective", None)  # a loss term of the block's own (an indexer's)
    if term is not None:
        target = target + term(config, leaves, x_leaf, aux_temp, auto_env)
    auto = torch.autograd.grad(target, [x_leaf, *(leaves[n] for n in trainable)])
    with torch.no_grad():
        dx, grads = math_.backward(config, params, x, saved, aux_temp, dy, env)
    checks.append(compare("task", f"{layer.kind} backward dx", dx, auto[0], tolerance))
    checks += [
        compare("task", f"{layer.kind} backward d{name}", grads[name], g, tolerance)
        for name, g in zip(trainable, auto[1:], strict=True)
    ]
    return checks


def _head_checks(family, config, layers, state, ops, device, dtype, tolerance, hidden_shape):

    head, embed = head_layer(layers), embed_layer(layers)
    params = {p.name: state[f"{head.name}.{p.name}"] for p in head.params}
    params |= {local: state[target] for local, target in head.tied.items()}
    x = torch.randn(hidden_shape, device=device, dtype=dtype)
    vocab = embed.params[0].state_shape[0]
    targets = torch.randint(0, vocab, hidden_shape[:-1], device=device)
    math_ = family.math("head")
    whole = math_.forward_backward(
        config, params, x, targets, Env(ops, chunk_tokens=x[..., 0].numel())
    )
    chunked = math_.forward_backward(config, params, x, targets, Env(ops, chunk_tokens=3))
    checks = [
        compare("task", "head loss (chunks of 3 vs one)", chunked[0], whole[0], tolerance),
        compare("task", "head dx (chunks of 3 vs one)", chunked[1], whole[1], tolerance),
    ]
    checks += [
        compare(
            "task",
            f"head d{name} (chunks of 3 vs one)",
            chunked[2][name],
            whole[2][name],
            tolerance,
        )
        for name in whole[2]
    ]
    return checks


# -- the ladder --------------------------------------------------------------------------
def verify(
    family_name: str,
    preset: str,
    *,
    device: str = "cpu",
    policy: str = "fp32",
    steps: int = 3,
    rounds: int = 2,
    batch: int = 2,
    seq_len: int = 16,
    budget_bytes: int | None = None,
    seed: int = 0,
    progress: ProgressCallback | None = None,
    order: str = "round",
    yardstick: bool = True,
    levels: Sequence[str] = LEVELS,
    resolver: str = "torch",
    precision: str | None = None,
) -> list[Check]:
    """Every check of the ladder for one family preset; see the module docstring.
    ``precision`` (``step.precision``; its weights' dtype must be ``policy``'s) runs the
    step level with that policy's optimizer and state: the compensated update of ``bf16``
    and ``mixed`` against the same float64 reference.
    ``progress(level, None)`` is called as each level starts, ``progress(level, checks)``
    as it ends (``dataflow_training.drive.progress``). ``yardstick``: in bf16, hold each step
    gradient also to plain bf16 autograd's error on it (``step_checks``). ``levels``: which
    of ``LEVELS`` run (in the ladder's order whatever the order given). ``resolver``: the
    registered resolver that runs the step level's engine (``run.resolver_for``: ``auto``
    is what ``dataflow train`` runs on the device)."""

    if policy not in TOLERANCES:
        raise ValueError(f"unknown dtype policy {policy!r}; known: {sorted(TOLERANCES)}")
    check_levels(levels)
    resolver = resolver_for(resolver, device)
    family = load_family(family_name)
    config = family.config(preset)
    tolerances = TOLERANCES[policy]
    dtype = getattr(torch, DtypePolicy.named(policy).param)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 products: see the docs
    ladder: dict[str, Callable[[], list[Check]]] = {
        "op": lambda: op_checks(
            device, dtype, tolerances["op"], seed, (*family.ops, "adamw_multi")
        ),
        "task": lambda: task_checks(family, config, device, dtype, tolerances["task"], seed),
        "step": lambda: step_checks(
            family,
            preset,
            device=device,
            policy=policy,
            steps=steps,
            rounds=rounds,
            batch=batch,
            seq_len=seq_len,
            budget_bytes=budget_bytes,
            seed=seed,
            tolerance=tolerances["step"],
            order=order,
            note=getattr(progress, "note", None),
            yardstick=yardstick,
            resolver=resolver,
            precision=precision,
        ),
    }
    checks: list[Check] = []
    try:
        for level, run in ladder.items():
            if level not in levels:
                continue
            if progress is not None:
                progress(level, None)
            done = run()
            if progress is not None:
                progress(level, done)
            checks += done
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return checks
