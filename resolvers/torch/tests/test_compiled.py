"""The compiled resolver gives what the eager one gives (CUDA: inductor's home)."""

from __future__ import annotations

import pytest
import torch

from dataflow.plugins import resolvers


def test_both_resolvers_are_registered() -> None:
    names = resolvers().names()
    assert "torch" in names and "torch-compiled" in names


@pytest.mark.gpu
def test_compiled_gpt2_tiny_steps_match_the_reference_on_cuda() -> None:
    pytest.importorskip("dataflow_family_gpt2")
    from dataflow_training.verify import TOLERANCES, step_checks

    from dataflow.plugins import families

    family = families().get("gpt2").load()
    torch.backends.cuda.matmul.allow_tf32 = False
    checks = step_checks(
        family,
        "gpt2_tiny",
        device="cuda",
        policy="fp32",
        steps=2,
        rounds=2,
        batch=2,
        seq_len=16,
        budget_bytes=None,
        seed=0,
        tolerance=TOLERANCES["fp32"]["step"],
        resolver="torch-compiled",
    )
    failed = [check for check in checks if not check.ok]
    assert not failed, failed
