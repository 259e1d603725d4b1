"""Lowering + torch resolver + engine train a toy family exactly like plain autograd with
torch.optim.AdamW: 2 accumulation rounds, 3 steps, at a generous and at a tight budget."""

from __future__ import annotations

import pytest
import torch
from dataflow_resolver_torch.training import TrainingResolver
from dataflow_training import OptimizerPolicy, TrainConfig, lower, read_state, start_values
from dataflow_training.testing import ToyFamily, plain_ops, toy_weights

from dataflow import Engine, minimal_budget, place, plan

STEPS, ROUNDS, BATCH, SEQ = 3, 2, 2, 5
OPT = OptimizerPolicy(lr=1e-2, weight_decay=0.1)


def _data(config, step: int, round_: int):
    g = torch.Generator().manual_seed(1000 * step + round_)
    tokens = torch.randint(0, config.vocab, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, config.vocab, (BATCH, SEQ), generator=g)
    return tokens, targets


def _reference_run(family, config, state):
    model = family.reference_model(config).double()
    with torch.no_grad():
        for name, value in state.items():
            model.param(name).copy_(value)
    decay = [p for n, p in model.named_parameters() if n.endswith((".w", ".wte"))]
    rest = [p for n, p in model.named_parameters() if not n.endswith((".w", ".wte"))]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": OPT.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=OPT.lr,
        betas=(OPT.beta1, OPT.beta2),
        eps=OPT.eps,
    )
    losses = []
    for step in range(STEPS):
        optim.zero_grad()
        for r in range(ROUNDS):
            tokens, targets = _data(config, step, r)
            loss = model(tokens, targets)
            (loss / ROUNDS).backward()
            losses.append(loss.item())
        optim.step()
    return losses, {name: model.param(name).detach() for name in state}


def _initial(lowered, config, state, step: int, data_only: bool = False):
    """Start values of every object that exists at start: packed weights, zero optimizer
    state, this step's tokens."""
    return start_values(
        lowered, state, lambda s, r: _data(config, s, r), step=step, data_only=data_only
    )


@pytest.mark.parametrize("budget", ["generous", "tight"])
def test_toy_training_matches_autograd(budget: str) -> None:
    family = ToyFamily()
    config = family.config("small")
    state = toy_weights(family, config)
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS, optimizer=OPT, chunk_tokens=4)
    lowered = lower(family, "small", train)
    program = lowered.program
    # "tight": a quarter above the smallest feasible budget, which still moves every
    # weight and optimizer state through the links (asserted below)
    budget_bytes = 2**30 if budget == "generous" else int(1.25 * minimal_budget(program))
    planned = plan(program, budget_bytes)
    resolver = TrainingResolver(lowered.with_program(planned.program), ops=plain_ops())
    losses = []
    with Engine("torch", budget_bytes=budget_bytes) as engine:
        engine.load(place(planned), resolver, initial=_initial(lowered, config, state, 0))
        for _ in range(STEPS):  # fresh tokens each step; weights and states carry over
            engine.run(feed=lambda step: _initial(lowered, config, state, step, data_only=True))
            losses += [engine.fetch(f"loss_0_{r}").item() for r in range(ROUNDS)]
        weights = read_state(lowered, engine.fetch)
    if budget == "tight":
        assert (
            planned.sim.fast_peak_bytes <= budget_bytes < plan(program, 2**30).sim.fast_peak_bytes
        )
    expected_losses, expected = _reference_run(
        family, config, {k: v.double() for k, v in state.items()}
    )
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6
    )
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-4, atol=1e-5)


def test_verify_ladder_passes_on_the_toy_family(isolated_plugin_manager) -> None:
    """`dataflow verify`'s three levels on the toy family, with the installed kernels and
    this resolver registered like plugins."""
    import dataflow_kernels_torch.plugin as kernels_plugin
    import dataflow_resolver_torch.plugin as resolver_plugin
    from dataflow_training import verify

    from dataflow import FamilySpec, hookimpl
    from dataflow.testing import core_plugin

    class ToyPlugin:
        @hookimpl
        def dataflow_families(self):
            return [FamilySpec("toy", "the test family", lambda: ToyFamily())]

    isolated_plugin_manager(ToyPlugin(), core_plugin, kernels_plugin, resolver_plugin)
    checks = verify("toy", "small", steps=2, rounds=2, batch=2, seq_len=6)
    levels = {check.level for check in checks}
    failed = [check for check in checks if not check.ok]
    assert levels == {"op", "task", "step"} and not failed, failed
    # each of 2 steps: a loss per round (2), a gradient and a weight of each of 8 parameters
    assert sum(check.level == "step" for check in checks) == 2 * (2 + 2 * 8)


def test_an_added_optimizer_runs_through_lowering_and_resolver(isolated_plugin_manager) -> None:
    """A plugin's ``dataflow_optimizers`` is the place to add an update rule: SGD with
    momentum, registered here, trains the toy family exactly like torch.optim.SGD."""
    from dataflow import OptimizerArg, OptimizerSpec, StateField, hookimpl
    from dataflow.testing import core_plugin

    def sgd(ops, params, grads, states, *, step, policy, weight_decay, roles):
        for param, grad, momentum in zip(params, grads, states["momentum"], strict=True):
            momentum.mul_(policy["beta1"]).add_(grad)
            param.add_(momentum, alpha=-policy["lr"])

    class SgdPlugin:
        @hookimpl
        def dataflow_optimizers(self):
            momentum = OptimizerArg("beta1", "float", 0.9, "the momentum")
            state = (StateField("momentum"),)
            return [OptimizerSpec("sgd", "SGD with momentum", state, sgd, arguments=(momentum,))]

    isolated_plugin_manager(core_plugin, SgdPlugin())
    family = ToyFamily()
    config = family.config("small")
    torch.manual_seed(1)
    state = {k: v.detach().clone() for k, v in family.reference_model(config).state_dict().items()}
    policy = OptimizerPolicy(name="sgd", lr=0.05, beta1=0.9, state_dtypes={"momentum": "float32"})
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=1, optimizer=policy)
    lowered = lower(family, "small", train)
    planned = plan(lowered.program, 2**30)
    with Engine("torch") as engine:
        engine.load(
            planned,
            TrainingResolver(lowered.with_program(planned.program), ops=plain_ops()),
            initial=_initial(lowered, config, state, 0),
        )
        engine.run(
            steps=2, feed=lambda step: _initial(lowered, config, state, step, data_only=True)
        )
        weights = {
            k.partition(".")[2]: v
            for k, v in read_state(lowered, engine.fetch).items()
            if k.startswith("1.")
        }
    model = family.reference_model(config).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    reference = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        reference.zero_grad()
        tokens, targets = _data(config, step, 0)
        model(tokens, targets).backward()
        reference.step()
    torch.testing.assert_close(
        weights["w"].double(), model.param("1.w").detach(), rtol=1e-5, atol=1e-6
    )


def test_optimizer_errors_name_the_field() -> None:
    family = ToyFamily()
    with pytest.raises(ValueError, match=r"unknown optimizer 'rmsprop'; known: adafactor, adamw"):
        lower(family, "small", TrainConfig(seq_len=4, optimizer=OptimizerPolicy(name="rmsprop")))
    wrong = OptimizerPolicy(state_dtypes={"exp_avg": "float32"})
    with pytest.raises(
        ValueError,
        match=r"state_dtypes names \['exp_avg'\]; optimizer 'adamw' "
        r"keeps \['exp_avg', 'exp_avg_sq'\]",
    ):
        lower(family, "small", TrainConfig(seq_len=4, optimizer=wrong))
