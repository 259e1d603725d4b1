"""The correctness ladder: ops, tasks and whole training steps against independent truths.

- **op**: every op the kernel registry picks for the device, against a float64 formula
  written here (softmax attention, the norm formulas, full cross-entropy with autograd,
  the AdamW update).
- **task**: every layer kind's math: recompute equals what forward saved; the hand
  backward equals autograd through the family's own forward; the fused head gives the
  same loss and gradients whatever its chunk size.
- **step**: the lowered program, planned into a budget and run on the engine for several
  steps of several accumulation rounds, against the family's plain-autograd reference
  model trained with ``torch.optim.AdamW`` in float64: every round's loss, every weight
  gradient of the first step, every weight after the last.

Errors are relative, ``||out - ref|| / ||ref||`` (METHOD.md), with the largest absolute
difference beside it; tolerances per dtype policy are in ``TOLERANCES`` and explained in
docs/correctness_compare.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from dataflow_training.config import DtypePolicy, OptimizerPolicy, TrainConfig
from dataflow_training.layout import Layout
from dataflow_training.ops import load_ops
from dataflow_training.progress import ProgressCallback
from dataflow_training.tolerances import adam_weight_error

#: largest relative error accepted, per dtype policy and level
TOLERANCES = {
    "fp32": {"op": 1e-5, "task": 1e-4, "step": 1e-4},
    "bf16": {"op": 1e-2, "task": 3e-2, "step": 5e-2},
}


@attrs.frozen
class Check:
    level: str
    name: str
    max_abs: float
    rel: float
    tolerance: float
    #: also accepted: every element within this absolute distance (see step_checks)
    abs_tolerance: float | None = None

    @property
    def ok(self) -> bool:
        if self.abs_tolerance is not None and self.max_abs <= self.abs_tolerance:
            return True
        return math.isfinite(self.rel) and self.rel <= self.tolerance


def compare(level: str, name: str, out: Any, ref: Any, tolerance: float) -> Check:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        return Check(
            level,
            f"{name} (shape {tuple(out64.shape)} != {tuple(ref64.shape)})",
            math.inf,
            math.inf,
            tolerance,
        )
    diff = (out64 - ref64).norm().item()
    scale = ref64.norm().item()
    rel = diff / scale if scale > 0 else diff
    return Check(
        level, name, (out64 - ref64).abs().max().item() if out64.numel() else 0.0, rel, tolerance
    )


# -- ops ---------------------------------------------------------------------------------
def op_checks(device: str, dtype: torch.dtype, tolerance: float, seed: int) -> list[Check]:
    ops = load_ops(device)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    checks = []
    q, k, v = rand(2, 3, 7, 8), rand(2, 3, 7, 8), rand(2, 3, 7, 8)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf)
    checks.append(
        compare(
            "op",
            "attention",
            ops["attention"](on(q), on(k), on(v), causal=True),
            scores.softmax(-1) @ v,
            tolerance,
        )
    )
    x, w, b = rand(5, 12), 1 + 0.1 * rand(12), rand(12)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    checks.append(
        compare(
            "op",
            "layer_norm",
            ops["layer_norm"](on(x), on(w), on(b), 1e-5),
            (x - mean) / torch.sqrt(var + 1e-5) * w + b,
            tolerance,
        )
    )
    checks.append(
        compare(
            "op",
            "rms_norm",
            ops["rms_norm"](on(x), on(w), 1e-6),
            x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w,
            tolerance,
        )
    )
    gelu = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    checks.append(compare("op", "gelu", ops["gelu"](on(x)), gelu, tolerance))
    checks.append(compare("op", "silu", ops["silu"](on(x)), x * torch.sigmoid(x), tolerance))
    weight = rand(9, 12)
    checks.append(
        compare(
            "op",
            "linear",
            ops["linear"](on(x), on(weight), on(b[:9])),
            x @ weight.T + b[:9],
            tolerance,
        )
    )
    hidden, vocab_w = rand(11, 12), rand(20, 12)
    targets = torch.randint(0, 20, (11,), generator=g)
    targets[3] = -100
    h_ref, w_ref = hidden.clone().requires_grad_(), vocab_w.clone().requires_grad_()
    loss_ref = F.cross_entropy(h_ref @ w_ref.T, targets, reduction="sum", ignore_index=-100)
    dh_ref, dw_ref = torch.autograd.grad(loss_ref, (h_ref, w_ref))
    loss, dh, dw = ops["chunked_cross_entropy"](on(hidden), on(vocab_w), targets.to(device), 4)
    checks += [
        compare("op", "chunked_cross_entropy loss", loss, loss_ref, tolerance),
        compare("op", "chunked_cross_entropy d_hidden", dh, dh_ref, tolerance),
        compare("op", "chunked_cross_entropy d_weight", dw, dw_ref, tolerance),
    ]
    checks.append(_adamw_check(ops["adamw"], device, dtype, tolerance, rand))
    return checks


def _adamw_check(
    adamw: Callable, device: str, dtype: torch.dtype, tolerance: float, rand: Callable
) -> Check:
    p, m, v = rand(33), 0.1 * rand(33), rand(33).abs()
    grads = [rand(33) for _ in range(3)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    out = [t.to(device=device, dtype=dtype) for t in (p, m, v)]
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    for step, grad in enumerate(grads, start=1):
        adamw(
            *out[:1],
            grad.to(device=device, dtype=dtype),
            *out[1:],
            step=step,
            lr=lr,
            beta1=b1,
            beta2=b2,
            eps=eps,
            weight_decay=wd,
        )
        ref_p *= 1 - lr * wd
        ref_m = b1 * ref_m + (1 - b1) * grad
        ref_v = b2 * ref_v + (1 - b2) * grad * grad
        ref_p -= lr * (ref_m / (1 - b1**step)) / (torch.sqrt(ref_v / (1 - b2**step)) + eps)
    return compare("op", "adamw (3 steps)", out[0], ref_p, tolerance)


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
    ops = load_ops(device)
    torch.manual_seed(seed)
    state = {
        k: v.to(device=device, dtype=dtype)
        for k, v in family.reference_model(config).state_dict().items()
    }
    checks: list[Check] = []
    layers = family.layers(config)
    hidden_shape = family.hidden_shape(config, batch, seq_len)
    for layer in layers:
        params = {p.name: state[f"{layer.name}.{p.name}"] for p in layer.params}
        math_ = family.math(layer.kind)
        if layer.kind == "head":
            continue  # checked below, with the embedding it is tied to
        if layer.kind == "embed":
            tokens = torch.randint(
                0, params[layer.params[0].name].shape[0], (batch, seq_len), device=device
            )
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            with torch.enable_grad():
                y = math_.forward(config, leaves, tokens, ops)
                dy = torch.randn_like(y)
                auto = torch.autograd.grad(y, list(leaves.values()), dy)
            grads = math_.backward(config, tokens, dy, ops)
            checks += [
                compare("task", f"{layer.kind} backward d{name}", grads[name], g, tolerance)
                for name, g in zip(leaves, auto, strict=True)
            ]
            continue
        if any(c.name.startswith(f"{layer.kind} ") for c in checks):
            continue  # one check per block kind
        x = torch.randn(hidden_shape, device=device, dtype=dtype)
        y, saved = math_.forward(config, params, x, ops)
        again = math_.recompute(config, params, x, ops)
        checks += [
            compare("task", f"{layer.kind} recompute {name}", again[name], saved[name], tolerance)
            for name in saved
        ]
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        x_leaf = x.clone().requires_grad_()
        dy = torch.randn_like(y)
        with torch.enable_grad():
            y_auto, _ = math_.forward(config, leaves, x_leaf, ops)
            auto = torch.autograd.grad(y_auto, [x_leaf, *leaves.values()], dy)
        dx, grads = math_.backward(config, params, x, saved, dy, ops)
        checks.append(compare("task", f"{layer.kind} backward dx", dx, auto[0], tolerance))
        checks += [
            compare("task", f"{layer.kind} backward d{name}", grads[name], g, tolerance)
            for name, g in zip(leaves, auto[1:], strict=True)
        ]
    checks += _head_checks(
        family, config, layers, state, ops, device, dtype, tolerance, hidden_shape
    )
    return checks


def _head_checks(family, config, layers, state, ops, device, dtype, tolerance, hidden_shape):
    head = next(layer for layer in layers if layer.kind == "head")
    embed = next(layer for layer in layers if layer.kind == "embed")
    params = {p.name: state[f"{head.name}.{p.name}"] for p in head.params}
    embed_params = {p.name: state[f"{embed.name}.{p.name}"] for p in embed.params}
    x = torch.randn(hidden_shape, device=device, dtype=dtype)
    vocab = embed.params[0].shape[0]
    targets = torch.randint(0, vocab, hidden_shape[:-1], device=device)
    math_ = family.math("head")
    whole = math_.forward_backward(config, params, embed_params, x, targets, x[..., 0].numel(), ops)
    chunked = math_.forward_backward(config, params, embed_params, x, targets, 3, ops)
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


# -- steps -------------------------------------------------------------------------------
def step_config(policy: str, *, batch: int, seq_len: int, rounds: int) -> TrainConfig:
    """The training step the step level lowers (``dataflow verify`` checks its budget)."""
    return TrainConfig(
        seq_len=seq_len,
        batch=batch,
        rounds=rounds,
        dtype=DtypePolicy.named(policy),
        optimizer=OptimizerPolicy(lr=1e-3),
        chunk_tokens=max(1, batch * seq_len // 3),
    )


def step_checks(
    family: Any,
    preset: str,
    *,
    device: str,
    policy: str,
    steps: int,
    rounds: int,
    batch: int,
    seq_len: int,
    budget_bytes: int | None,
    seed: int,
    tolerance: float,
    resolver: str = "torch",
) -> list[Check]:
    from dataflow.engine import Engine
    from dataflow.planning import plan
    from dataflow.planning.placement import place
    from dataflow_training.lowering import lower

    config = family.config(preset)
    train = step_config(policy, batch=batch, seq_len=seq_len, rounds=rounds)
    program = lower(family, preset, train, keep_grads=True).program
    planned = plan(program, budget_bytes or 2**62)
    torch.manual_seed(seed)
    reference = family.reference_model(config)
    param_dtype = getattr(torch, train.dtype.param)
    state = {k: v.detach().to(param_dtype) for k, v in reference.state_dict().items()}
    layouts = {k: Layout.from_dict(v) for k, v in program.metadata["layouts"].items()}
    vocab = (
        next(layer for layer in family.layers(config) if layer.kind == "embed").params[0].shape[0]
    )

    def tokens(step: int, round_: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 7919 + 1000 * step + round_)
        return (
            torch.randint(0, vocab, (batch, seq_len), generator=g),
            torch.randint(0, vocab, (batch, seq_len), generator=g),
        )

    def start_values(step: int, data_only: bool = False) -> dict[str, torch.Tensor]:
        values = {}
        for obj in program.objects:
            if not program.exists_at_start(obj.id):
                continue
            if obj.id.startswith(("x_", "t_")):
                round_ = int(obj.id.split("_")[2])
                values[obj.id] = tokens(step, round_)[obj.id.startswith("t_")]
            elif not data_only:
                buffer = torch.zeros(obj.size_bytes, dtype=torch.uint8)
                if obj.id.startswith("W_"):
                    layer = obj.id[2:]
                    for name, view in layouts[obj.id].views(buffer).items():
                        view.copy_(state[f"{layer}.{name}"])
                values[obj.id] = buffer
        return values

    losses, grads = [], {}
    with Engine("torch", budget_bytes=planned.budget_bytes, device=device) as engine:
        engine.load(
            planned,
            _resolver(planned.program, resolver),
            initial=start_values(0),
            placement=place(planned),
        )
        for _ in range(steps):
            engine.run(feed=lambda step: start_values(step, data_only=True))
            losses += [engine.fetch(f"loss_0_{r}") for r in range(rounds)]
            if not grads:
                grads = _unpack_all(engine, layouts, program, "dW_")
        weights = _unpack_all(engine, layouts, program, "W_")
    ref_losses, ref_grads, ref_weights = _reference_steps(
        family, config, state, train, steps, rounds, tokens
    )
    checks = [
        compare("step", f"loss step {i // rounds} round {i % rounds}", loss, ref, tolerance)
        for i, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True))
    ]
    checks += [
        compare("step", f"grad {name} (step 0)", grads[name], ref_grads[name], tolerance)
        for name in sorted(ref_grads)
    ]
    # Adam steps a near-zero gradient's entry by about lr either way: see tolerances.py
    for name in sorted(ref_weights):
        error = adam_weight_error(
            weights[name],
            ref_weights[name],
            grads[name],
            ref_grads[name],
            lr=train.optimizer.lr,
            eps=train.optimizer.eps,
            steps=steps,
        )
        n = error.sign_flips
        flips = f"; {n} first-step sign flip{'s' * (n != 1)}" if n else ""
        checks.append(
            Check(
                "step",
                f"weight {name} (after step {steps - 1}{flips})",
                error.max_abs,
                error.rel,
                tolerance,
            )
        )
    return checks


def _resolver(program, name: str = "torch"):
    from dataflow.plugins import resolvers

    return resolvers().get(name).build(program)


def _unpack_all(engine, layouts, program, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for obj in program.final_locations:
        if obj.startswith(prefix):
            layer = obj[len(prefix) :]
            for name, view in layouts[obj].views(engine.fetch(obj)).items():
                out[f"{layer}.{name}"] = view.clone()
    return out


def _reference_steps(family, config, state, train, steps, rounds, tokens):
    model = family.reference_model(config).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    decay_names = {
        f"{layer.name}.{p.name}" for layer in family.layers(config) for p in layer.params if p.decay
    }
    named = dict(model.named_parameters())
    opt = train.optimizer
    optimizer = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in named.items() if n in decay_names],
                "weight_decay": opt.weight_decay,
            },
            {"params": [p for n, p in named.items() if n not in decay_names], "weight_decay": 0.0},
        ],
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
    )
    losses, first_grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        for round_ in range(rounds):
            x, t = tokens(step, round_)
            loss = model(x, t)
            (loss / rounds).backward()
            losses.append(loss.detach())
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in named.items()}
        optimizer.step()
    return losses, first_grads, {n: p.detach() for n, p in named.items()}


# -- the ladder --------------------------------------------------------------------------
def verify(
    family_name: str,
    preset: str,
    *,
    device: str = "cpu",
    policy: str = "fp32",
    steps: int = 2,
    rounds: int = 2,
    batch: int = 2,
    seq_len: int = 16,
    budget_bytes: int | None = None,
    seed: int = 0,
    progress: ProgressCallback | None = None,
) -> list[Check]:
    """Every check of the ladder for one family preset; see the module docstring.
    ``progress(level, None)`` is called as each level starts, ``progress(level, checks)``
    as it ends (``dataflow_training.progress``)."""
    from dataflow.plugins import families

    if policy not in TOLERANCES:
        raise ValueError(f"unknown dtype policy {policy!r}; known: {sorted(TOLERANCES)}")
    family = families().get(family_name).load()
    config = family.config(preset)
    tolerances = TOLERANCES[policy]
    dtype = getattr(torch, DtypePolicy.named(policy).param)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 products: see the docs
    levels: dict[str, Callable[[], list[Check]]] = {
        "op": lambda: op_checks(device, dtype, tolerances["op"], seed),
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
        ),
    }
    checks: list[Check] = []
    try:
        for level, run in levels.items():
            if progress is not None:
                progress(level, None)
            done = run()
            if progress is not None:
                progress(level, done)
            checks += done
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return checks
