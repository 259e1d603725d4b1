"""benchmarks/kernel_breakdown.py's accounting on hand-made trace events (the script itself
needs CUDA): kernels summed by name and kind, per 16K tokens, over several steps."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks import kernel_breakdown


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kernels_are_summed_per_name_and_kind_per_16k_tokens() -> None:
    events = [
        kernel("sm90_xmma_gemm_bf16bf16", 0, 100),
        kernel("sm90_xmma_gemm_bf16bf16", 50, 100),  # overlaps the first: union 150 us
        kernel("flash_bwd_kernel", 200, 40),
        kernel("triton_poi_fused_add_0", 300, 10),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},
    ]
    # two steps of 32,768 tokens: per 16K tokens every total is a quarter
    row = kernel_breakdown.summarise("s", events, 0.5, steps=2, tokens=32768)
    assert row["kinds_ms_per_16k"] == pytest.approx(
        {"matmul": 0.05, "attention": 0.01, "fused triton": 0.0025}
    )
    assert row["kernels_ms_per_16k"]["sm90_xmma_gemm_bf16bf16"] == pytest.approx(
        {"ms": 0.05, "launches_per_16k": 0.5}
    )
    assert row["kernel_busy_ms_per_16k"] == pytest.approx((150 + 40 + 10) / 4 / 1e3)
    assert row["wall_ms_per_16k"] == pytest.approx(250.0)
    text = kernel_breakdown.table([row, row])
    assert "| matmul | 0.05 | 0.05 |" in text and "`flash_bwd_kernel`" in text


def test_kinds_of_common_kernel_names() -> None:
    assert kernel_breakdown.kind_of("void cutlass::Kernel2<cutlass_80_wmma>") == "matmul"
    assert kernel_breakdown.kind_of("nvjet_tst_128x256_64x4") == "matmul"
    assert kernel_breakdown.kind_of("flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_breakdown.kind_of("triton_red_fused_native_layer_norm_3") == "fused triton"
    assert kernel_breakdown.kind_of("void at::native::vectorized_elementwise_kernel") == (
        "elementwise"
    )
    assert kernel_breakdown.kind_of("_adamw_flat_kernel") == "optimizer"
