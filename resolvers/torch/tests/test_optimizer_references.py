"""Every builtin optimizer, run as the step's optimizer tasks (toy family, lowering, torch
resolver, engine), equals a plain-torch reference over 5 steps: ``torch.optim.AdamW``,
``torch.optim.Adafactor``, and Lion and Muon written here from their papers' equations, in
float64, parameter by parameter (no batching, no flat spans). The state objects the
lowering makes hold exactly each optimizer's fields at their sizes."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_resolver_torch.training import TrainingResolver
from dataflow_training import TrainConfig, lower, precision, read_state, start_values
from dataflow_training.testing import ToyFamily, plain_ops, toy_weights

from dataflow import Engine, plan

STEPS, BATCH, SEQ = 5, 2, 5
LR, WD = {"adamw": 1e-2, "lion": 2e-3, "muon": 1e-2, "adafactor": 1e-2}, 0.1
#: the toy family's parameters with weight decay (the rest are marked decay=False)
DECAY = ("emb.wte", "0.w", "1.w", "2.w")


def _data(config, step: int):
    g = torch.Generator().manual_seed(1000 * step)
    tokens = torch.randint(0, config.vocab, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, config.vocab, (BATCH, SEQ), generator=g)


def _engine_run(name: str, args: dict) -> tuple[dict, dict]:
    family = ToyFamily()
    config = family.config("small")
    state = toy_weights(family, config)
    policy = precision("fp32").optimizer_policy(name, args, lr=LR[name], weight_decay=WD)
    lowered = lower(family, "small", TrainConfig(seq_len=SEQ, batch=BATCH, optimizer=policy))
    planned = plan(lowered.program, 2**30)
    feed = lambda step, data_only=True: start_values(  # noqa: E731
        lowered, state, lambda s, r: _data(config, s), step=step, data_only=data_only
    )
    with Engine("torch") as engine:
        resolver = TrainingResolver(lowered.with_program(planned.program), ops=plain_ops())
        engine.load(planned, resolver, initial=feed(0, False))
        engine.run(steps=STEPS, feed=feed)
        weights = read_state(lowered, engine.fetch)
    return weights, state


# -- references: one function per optimizer, (params by name, grads by name, state, step) --
def _lion(params, grads, state, step, beta1=0.9, beta2=0.99):
    for name, p in params.items():
        m = state.setdefault(name, torch.zeros_like(p))
        c = beta1 * m + (1 - beta1) * grads[name]
        wd = WD if name in DECAY else 0.0
        p.copy_(p - LR["lion"] * (torch.sign(c) + wd * p))
        m.copy_(beta2 * m + (1 - beta2) * grads[name])


def _orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan's quintic: X <- aX + b(XX^T)X + c(XX^T)^2 X, from a wide, unit-norm X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ gram @ x)
    return x.T if g.shape[0] > g.shape[1] else x


def _muon(params, grads, state, step, mu=0.95, beta1=0.9, beta2=0.95, eps=1e-8):
    lr = LR["muon"]
    for name, p in params.items():
        g, wd = grads[name], (WD if name in DECAY else 0.0)
        if p.dim() == 2 and name.split(".")[0].isdigit():  # a block's matrix: Muon
            m = state.setdefault(name, torch.zeros_like(p))
            m.copy_(mu * m + g)
            update = _orthogonalize(g + mu * m)
            p.copy_(p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(p.shape)) * update)
            continue
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m.copy_(beta1 * m + (1 - beta1) * g)
        v.copy_(beta2 * v + (1 - beta2) * g * g)
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        p.copy_(p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps))


def _torch_optimizer(name: str, params: dict) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for n, p in params.items() if n in DECAY], "weight_decay": WD},
        {"params": [p for n, p in params.items() if n not in DECAY], "weight_decay": 0.0},
    ]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=LR[name], betas=(0.9, 0.95), eps=1e-8)
    return torch.optim.Adafactor(groups, lr=LR[name], eps=(1.1920929e-07, 1e-3))


def _reference_run(name: str, state: dict) -> dict:
    family = ToyFamily()
    config = family.config("small")
    model = family.reference_model(config).double()
    with torch.no_grad():
        for key, value in state.items():
            model.param(key).copy_(value.double())
    params = {key: model.param(key) for key in state}
    optimizer = _torch_optimizer(name, params) if name in ("adamw", "adafactor") else None
    kept: dict = {}
    for step in range(STEPS):
        model.zero_grad()
        model(*_data(config, step)).backward()
        if optimizer is not None:
            optimizer.step()
            continue
        with torch.no_grad():
            grads = {key: p.grad for key, p in params.items()}
            {"lion": _lion, "muon": _muon}[name](params, grads, kept, step + 1)
    return {key: p.detach() for key, p in params.items()}


@pytest.mark.parametrize(
    ("name", "args"),
    [("adamw", {}), ("lion", {}), ("muon", {"eps": 1e-8}), ("adafactor", {})],
)
def test_each_optimizer_equals_its_reference_over_five_steps(name: str, args: dict) -> None:
    weights, state = _engine_run(name, args)
    expected = _reference_run(name, state)
    assert weights.keys() == expected.keys()
    moved = max((expected[k] - state[k].double()).abs().max().item() for k in expected)
    assert moved > 10 * LR[name] * 1e-2  # the steps did move the weights
    for key, value in weights.items():
        torch.testing.assert_close(value.double(), expected[key], rtol=1e-4, atol=1e-5)


def test_a_wrong_reference_would_fail() -> None:
    """The comparison can fail: a Lion run with another beta1 than its reference's is off after 5 steps."""
    weights, state = _engine_run("lion", {"beta1": 0.5})
    expected = _reference_run("lion", state)
    with pytest.raises(AssertionError):
        for key, value in weights.items():
            torch.testing.assert_close(value.double(), expected[key], rtol=1e-4, atol=1e-5)


def test_state_objects_hold_each_field_at_its_exact_size() -> None:
    family = ToyFamily()
    config = family.config("small")  # dim x dim block weights, a vocab x dim embedding
    dim, vocab = config.dim, config.vocab
    sizes = {}
    for name in ("muon", "adafactor", "lion"):
        policy = precision("fp32").optimizer_policy(name)
        lowered = lower(family, "small", TrainConfig(seq_len=SEQ, optimizer=policy))
        packed = lowered.layout.packed
        sizes[name] = {
            e.name: tuple(e.shape)
            for o in packed.values()
            if o.kind == "O" and o.layer in ("0", "emb")
            for e in o.layout.entries
        }
    assert sizes["muon"] == {
        "w/momentum": (dim, dim), "b/momentum": (dim,), "wte/momentum": (vocab, dim),
        "w/exp_avg_sq": (0,), "b/exp_avg_sq": (dim,), "wte/exp_avg_sq": (vocab, dim),
    }  # fmt: skip
    assert sizes["adafactor"] == {
        "w/row": (dim,), "w/col": (dim,), "w/variance": (0,),
        "b/row": (0,), "b/col": (0,), "b/variance": (dim,),
        "wte/row": (vocab,), "wte/col": (dim,), "wte/variance": (0,),
    }  # fmt: skip
    assert sizes["lion"] == {
        "w/exp_avg": (dim, dim),
        "b/exp_avg": (dim,),
        "wte/exp_avg": (vocab, dim),
    }
