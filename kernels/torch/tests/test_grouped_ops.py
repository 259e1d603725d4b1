"""The grouped GEMM ops of MoE FFNs against a dense per-row truth: every row times its
own expert's weight, computed by gathering that weight (no grouping, no offsets).

Tolerances: float64 loops and the gathered einsum agree to rounding (1e-12); the CUDA
``torch._grouped_mm`` variant in bfloat16 against the float32 loop within bf16 rounding of
a sum over ``in`` products (rtol 2e-2, atol 2e-2 on O(1) values)."""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch import grouped

EXPERTS, ROWS, IN, OUT = 5, 37, 32, 48


def _case(dtype=torch.float64, device="cpu", empty_expert=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, EXPERTS, (ROWS,), generator=g)
    ids[ids == empty_expert] = (empty_expert + 1) % EXPERTS  # one expert gets no rows
    ids = ids.sort().values
    counts = torch.bincount(ids, minlength=EXPERTS)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
    w = torch.randn(EXPERTS, OUT, IN, generator=g, dtype=torch.float64)
    dy = torch.randn(ROWS, OUT, generator=g, dtype=torch.float64)
    to = {"dtype": dtype, "device": device}
    return ids, offsets.to(device), x.to(**to), w.to(**to), dy.to(**to)


def test_the_reference_loop_is_a_matmul_per_row_with_its_expert():
    ids, offsets, x, w, dy = _case()
    truth = torch.einsum("noi,ni->no", w[ids], x)
    torch.testing.assert_close(
        grouped.grouped_mm_reference(x, w, offsets), truth, rtol=1e-12, atol=1e-12
    )
    d_w = grouped.grouped_mm_wgrad_reference(dy, x, offsets)
    truth_w = torch.zeros_like(w).index_add_(0, ids, torch.einsum("no,ni->noi", dy, x))
    torch.testing.assert_close(d_w, truth_w, rtol=1e-12, atol=1e-12)
    assert torch.equal(d_w[2], torch.zeros_like(d_w[2]))  # the expert without rows


def test_bad_offsets_are_refused_by_name():
    _, offsets, x, w, _ = _case()
    with pytest.raises(ValueError, match=r"grouped_mm: offsets must have E \+ 1 = 6 entries"):
        grouped.grouped_mm_reference(x, w, offsets[:-1])
    with pytest.raises(ValueError, match=r"grouped_mm: offsets end at 36, x has 37 rows"):
        grouped.grouped_mm_reference(x, w, torch.cat([offsets[:-1], offsets[-1:] - 1]))


@pytest.mark.gpu
def test_torch_grouped_mm_variant_matches_the_loop_on_cuda():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    ids, offsets, x, w, dy = _case(torch.bfloat16, "cuda")
    truth = grouped.grouped_mm_reference(x.float(), w.float(), offsets)
    fast = grouped.grouped_mm_cuda(x, w, offsets)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), truth, rtol=2e-2, atol=2e-2 * IN**0.5)
    truth_w = grouped.grouped_mm_wgrad_reference(dy.float(), x.float(), offsets)
    fast_w = grouped.grouped_mm_wgrad_cuda(dy, x, offsets)
    torch.testing.assert_close(fast_w.float(), truth_w, rtol=2e-2, atol=2e-2 * ROWS**0.5)
