"""Shared fixtures: the ops, a small float64 config and a reference model with non-trivial
weights, and the tolerances every comparison uses.

Ops come from the kernel registry (``load_ops("cpu", OPS)``: the family's ops from
``dataflow-kernels-torch``, a dependency of the family).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import layer_specs
from dataflow_family_gpt2.model import OPS
from dataflow_family_gpt2.reference import GPT2Reference
from dataflow_training.kit import Env, load_ops

# Tolerances. Embed and block math run in float64 and differ from the reference only by
# summation order (SDPA vs written-out softmax): FLOAT64. The head's cross-entropy runs in
# float32 by the op's contract (its loss is a float32 sum), so anything downstream of it
# carries float32 rounding: CROSS_ENTROPY.
FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
CROSS_ENTROPY = {"rtol": 2e-5, "atol": 1e-8}


def _installed_ops() -> tuple[dict[str, Callable] | None, str]:
    try:
        return load_ops("cpu", OPS), "load_ops('cpu', gpt2's ops) (installed kernel packages)"
    except LookupError as error:
        return None, str(error)


def pytest_report_header(config: pytest.Config) -> str:
    return f"gpt2 ops: {_installed_ops()[1]}"


@pytest.fixture(scope="session")
def float64_tol() -> dict[str, float]:
    return FLOAT64


@pytest.fixture(scope="session")
def ce_tol() -> dict[str, float]:
    return CROSS_ENTROPY


@pytest.fixture(scope="session")
def installed_ops() -> dict[str, Callable]:
    ops, source = _installed_ops()
    if ops is None:
        pytest.fail(f"no kernel package provides every gpt2 op on cpu: {source}")
    return ops


@pytest.fixture(scope="session")
def ops(installed_ops) -> Env:
    """What the family's math takes: the ops in an ``Env`` (one round, no Aux)."""
    return Env(installed_ops)


@pytest.fixture(scope="session")
def config() -> GPT2Config:
    """Small and irregular: a vocab that no chunk size divides, more positions than used."""
    return GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)


@pytest.fixture
def reference(config: GPT2Config) -> GPT2Reference:
    """float64, GPT-2 init plus noise on every parameter (so no bias is 0, no norm 1)."""
    torch.manual_seed(0)
    model = GPT2Reference(config).double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture
def layer_params(
    config: GPT2Config, reference: GPT2Reference
) -> dict[str, dict[str, torch.Tensor]]:
    """layer name -> {param name -> a detached copy of the reference's tensor}."""
    state = reference.state_dict()
    return {
        layer.name: {
            param.name: state[f"{layer.name}.{param.name}"].clone() for param in layer.params
        }
        for layer in layer_specs(config)
    }


@pytest.fixture
def batch_tokens(config: GPT2Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of 3 x 11, the targets shifted, some ignored (-100)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, 12), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[0, 2] = targets[2, -1] = -100
    return tokens[:, :-1].contiguous(), targets
