"""``price_step`` on a CPU: the step priced as a GPU's is, from the profiling pass and
measured links, with nothing of CUDA's (no libraries' reserve, no workspace beside the
arena), and its links kept in the profile cache with the task profiles."""

from __future__ import annotations

import pytest

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_resolver_torch")

from dataflow_training.plan.pricing import price_step  # noqa: E402
from dataflow_training.plan.profile import CACHE_ENV  # noqa: E402
from dataflow_training.step.config import TrainConfig  # noqa: E402
from dataflow_training.step.family import load_family  # noqa: E402
from dataflow_training.step.lowering import lower  # noqa: E402

import dataflow  # noqa: E402
from dataflow import Links  # noqa: E402


@pytest.fixture
def step():
    return lower(load_family("gpt2"), "gpt2_tiny", TrainConfig(seq_len=16, batch=2))


def test_a_cpu_step_is_priced_by_measurement_with_nothing_of_cudas(
    step, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    priced = price_step(step, "torch", device="cpu", search=True)
    assert priced.priced_for == "cpu (measured)"
    assert (priced.reserve_bytes, priced.workspace_beside_bytes) == (0, 0)
    declared = {task.id: task.cost_us for task in step.program.tasks}
    measured = {task.id: task.cost_us for task in priced.step.program.tasks}
    assert all(cost > 0 for cost in measured.values())
    assert measured != declared  # the declared costs are an H200's: microseconds
    links = priced.step.program.links
    assert links.h2d != Links().h2d and links.duplex_bytes_per_us is not None
    assert priced.rewriter is not None  # its candidates priced by measurement too


def test_a_second_pricing_reads_tasks_and_links_from_the_cache(step, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = price_step(step, "torch", device="cpu")

    def not_again(*args, **kwargs):
        raise AssertionError("the links were measured again")

    monkeypatch.setattr(dataflow, "measure_links", not_again)
    second = price_step(step, "torch", device="cpu")
    assert second.step.program == first.step.program  # costs and links, as cached


@pytest.mark.gpu
def test_a_cuda_step_keeps_the_reserve_and_measures_its_links_every_time(
    step, tmp_path, monkeypatch
) -> None:
    """On CUDA: the libraries' reserve is left beside the arena, and the links (pinned
    copies, which depend on the host) are measured on every pricing, never cached."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = price_step(step, "torch", device="cuda", graph=True)
    assert first.priced_for == "cuda (measured)" and first.reserve_bytes > 0
    measured = []
    real = dataflow.measure_links
    monkeypatch.setattr(
        dataflow, "measure_links", lambda *a, **k: measured.append(1) or real(*a, **k)
    )
    price_step(step, "torch", device="cuda", graph=True)
    assert measured == [1]
