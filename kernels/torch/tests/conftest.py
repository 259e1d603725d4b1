"""Fixtures shared by the kernel tests: fresh random inputs per test, the variants."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from dataflow import DataflowPluginManager, get_plugin_manager

DISTRIBUTION = "dataflow-kernels-torch"


@pytest.fixture(scope="session")
def manager() -> DataflowPluginManager:
    """A manager that loads only this distribution (other kernel packages never interfere)."""
    return get_plugin_manager(autoload=False, allow=[DISTRIBUTION])


@pytest.fixture
def kernel(manager: DataflowPluginManager) -> Callable[[str, str], Callable[..., Any]]:
    """``kernel(op, name)``: the loaded callable of variant ``op/name``."""
    return lambda op, name: manager.kernels().get(f"{op}/{name}").load()


@pytest.fixture
def randn(request: pytest.FixtureRequest) -> Callable[..., torch.Tensor]:
    """``randn(*shape, dtype=float32, device="cpu", scale=1.0)``: normal samples, new for
    every test (seeded from the test's id, so a failure reproduces), never all zeros."""
    generator = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

    def make(
        *shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", scale: float = 1.0
    ) -> torch.Tensor:
        sample = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        return sample.to(device=device, dtype=dtype)

    make.generator = generator  # type: ignore[attr-defined]
    return make


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The tensors here are tiny: one thread avoids OpenMP hand-offs that cost more than
    the work (and stall when the machine is busy). Restored after each module, so suites
    run after this one in the same session keep their threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (``||got||`` when want is all zeros)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(want.norm())
    return float((got - want).norm()) / (scale if scale > 0 else 1.0)


@pytest.fixture
def assert_rel_close() -> Callable[..., None]:
    """``assert_rel_close(got, want, tol, name)``: shapes equal and ``relative_error`` at most
    ``tol`` (the METHOD-style norm-wise criterion the kernel tests state per dtype)."""

    def check(got: torch.Tensor, want: torch.Tensor, tol: float, name: str = "output") -> None:
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        error = relative_error(got, want)
        assert error <= tol, f"{name}: relative error {error:.3g} > {tol:g}"

    return check


class Float64AdamW:
    """AdamW from the paper (Loshchilov & Hutter; decoupled decay) in float64, as
    torch.optim.AdamW orders it: decay the parameter, update the moments, bias-correct.

    After each step the values are rounded to the dtypes the kernel stores them in (a
    bfloat16 parameter cannot take an update below its resolution), then carried on in
    float64: the kernel under test differs only by float32 arithmetic inside a step."""

    def __init__(self, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
        self.dtypes = (param.dtype, exp_avg.dtype, exp_avg_sq.dtype)
        self.param = param.double().clone()
        self.exp_avg = exp_avg.double().clone()
        self.exp_avg_sq = exp_avg_sq.double().clone()

    def step(self, grad: torch.Tensor, step: int, lr, beta1, beta2, eps, weight_decay) -> None:
        g = grad.double()
        param = self.param * (1 - lr * weight_decay)
        exp_avg = beta1 * self.exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * self.exp_avg_sq + (1 - beta2) * g * g
        m_hat = exp_avg / (1 - beta1**step)
        v_hat = exp_avg_sq / (1 - beta2**step)
        param = param - lr * m_hat / (torch.sqrt(v_hat) + eps)
        self.param, self.exp_avg, self.exp_avg_sq = (
            value.to(dtype).double()
            for value, dtype in zip((param, exp_avg, exp_avg_sq), self.dtypes, strict=True)
        )


@pytest.fixture
def float64_adamw() -> type[Float64AdamW]:
    """The float64 AdamW class the AdamW tests compare against."""
    return Float64AdamW


#: (device, dtype, tolerance on the relative error) the explicit-op tests run at: float64
#: and float32 on CPU (CI), the dtypes training uses on CUDA.
PRECISIONS = [
    ("cpu", torch.float64, 1e-10),
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.float32, 1e-4, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 1e-2, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, 1e-2, marks=pytest.mark.gpu),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``device, dtype, tol`` runs at every entry of ``PRECISIONS``."""
    if {"device", "dtype", "tol"} <= set(metafunc.fixturenames):
        metafunc.parametrize(("device", "dtype", "tol"), PRECISIONS)
