"""Shared fixtures: the ops, a small float64 config and a reference model with non-trivial
weights, and the tolerances every comparison uses.

Ops come from the kernel registry (``load_ops("cpu")``, the ``dataflow-kernels-torch``
reference variants) whenever a kernel package provides them; without one, the suite falls
back to ``PLAIN_OPS`` below (plain torch, the same formulas) and says so in its header,
and ``test_gpt2_math.py::test_installed_kernels_provide_every_op`` is skipped with the
reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import layer_specs
from dataflow_family_gpt2.reference import GPT2Reference
from dataflow_training.ops import load_ops

# Tolerances. Embed and block math run in float64 and differ from the reference only by
# summation order (SDPA vs written-out softmax): FLOAT64. The head's cross-entropy runs in
# float32 by the op's contract (its loss is a float32 sum), so anything downstream of it
# carries float32 rounding: CROSS_ENTROPY.
FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
CROSS_ENTROPY = {"rtol": 2e-5, "atol": 1e-8}


def _chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's contract in float32 (test-only fallback)."""
    loss_sum = torch.zeros((), dtype=torch.float32)
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = hidden[start : start + chunk_tokens].float()
        target = targets[start : start + chunk_tokens]
        scored = target != -100
        index = torch.where(scored, target, 0)
        log_probs = (rows @ weight.float().T).log_softmax(dim=1)
        picked = log_probs.gather(1, index[:, None]).squeeze(1)
        loss_sum -= torch.where(scored, picked, 0.0).sum()
        d_logits = log_probs.exp()
        d_logits[torch.arange(len(index)), index] -= 1.0
        d_logits *= scored[:, None]
        d_hidden[start : start + chunk_tokens] = d_logits @ weight.float()
        d_weight += d_logits.T @ rows
    return loss_sum, d_hidden, d_weight.to(weight.dtype)


#: Plain-torch implementations of the ops the family calls (test-only fallback).
PLAIN_OPS: dict[str, Callable] = {
    "attention": lambda q, k, v, *, causal: F.scaled_dot_product_attention(
        q, k, v, is_causal=causal
    ),
    "layer_norm": lambda x, weight, bias, eps: F.layer_norm(x, (x.shape[-1],), weight, bias, eps),
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "linear": lambda x, weight, bias=None: F.linear(x, weight, bias),
    "chunked_cross_entropy": _chunked_cross_entropy,
}


def _installed_ops() -> tuple[dict[str, Callable] | None, str]:
    try:
        return load_ops("cpu"), "load_ops('cpu') (installed kernel packages)"
    except LookupError as error:
        return None, f"test-only plain torch ops ({error})"


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
        pytest.skip(f"no kernel package provides every op on cpu: {source}")
    return ops


@pytest.fixture(scope="session")
def ops() -> dict[str, Callable]:
    installed, _ = _installed_ops()
    return installed if installed is not None else PLAIN_OPS


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
