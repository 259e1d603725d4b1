"""Fixtures shared by the kernel tests: fresh random inputs per test, the variants."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from dataflow.plugins import DataflowPluginManager, get_plugin_manager

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
