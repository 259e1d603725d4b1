"""The compiled resolver gives what the eager one gives (CUDA: inductor's home), through
the CUDA graph the steps after the first replay."""

from __future__ import annotations

import pytest
import torch

from dataflow.plugins import resolvers


def test_both_resolvers_are_registered() -> None:
    names = resolvers().names()
    assert "torch" in names and "torch-compiled" in names


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family_name", "preset"),
    # llama3: RoPE tables are traced inside the compiled task and must not copy from the
    # host while the step is captured into a CUDA graph
    # olmoe, qwen3_moe: the MoE block's routing (sort by expert, grouped GEMM over device
    # offsets) compiled and captured; benchmarks/model_rows.sh runs the MoE rows eager
    # until this passes on the device
    [
        ("gpt2", "gpt2_tiny"),
        ("llama3", "llama3_tiny"),
        ("olmoe", "olmoe_tiny"),
        ("qwen3_moe", "qwen3_moe_tiny"),
    ],
)
def test_compiled_tiny_steps_match_the_reference_on_cuda(family_name: str, preset: str) -> None:
    pytest.importorskip(f"dataflow_family_{family_name}")
    from dataflow_training.verify import TOLERANCES, step_checks

    from dataflow.plugins import families

    family = families().get(family_name).load()
    torch.backends.cuda.matmul.allow_tf32 = False
    checks = step_checks(
        family,
        preset,
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
