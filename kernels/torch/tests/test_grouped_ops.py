"""The grouped GEMM ops of MoE FFNs against a dense per-row truth: every row times its
own expert's weight, computed by gathering that weight (no grouping, no offsets).

Tolerances: float64 loops and the gathered einsum agree to rounding (1e-12). The
``torch._grouped_mm`` argument conventions (int32 group ends, which operand is 3-D, the
transposed views) are checked on CPU too, through torch's own CPU path of
``torch._grouped_mm``, in float32 against the float64 loop (rtol 1e-5, atol 1e-5 on O(1)
to O(sqrt(K)) values). The CUDA kernel in bfloat16 is checked against the float32 loop over
the same bfloat16 inputs: it accumulates in float32 and rounds once to bfloat16, so
``rtol = 2**-7`` (two bfloat16 ulps of the output) and ``atol = 1e-3 * sqrt(K)`` for the
float32 summation order (K: the contraction length; the values are O(sqrt(K))). An expert
that no row chose gets a gradient of exactly 0.
"""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch import grouped

EXPERTS, ROWS, IN, OUT = 5, 37, 32, 48


def _case(dtype=torch.float64, device="cpu", empty=(2,), experts=EXPERTS, rows=ROWS, seed=0):
    """Rows sorted by expert (the experts in ``empty`` get none), offsets, x, w, dy."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.tensor([e for e in range(experts) if e not in empty])
    ids = chosen[torch.randint(0, len(chosen), (rows,), generator=g)].sort().values
    counts = torch.bincount(ids, minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    w = torch.randn(experts, OUT, IN, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, OUT, generator=g, dtype=torch.float64)
    to = {"dtype": dtype, "device": device}
    return ids, offsets.to(device), x.to(**to), w.to(**to), dy.to(**to)


def _truths(ids, x, w, dy):
    """Per row with its own expert's gathered weight, in float64."""
    x, w, dy, ids = x.double().cpu(), w.double().cpu(), dy.double().cpu(), ids.cpu()
    y = torch.einsum("noi,ni->no", w[ids], x)
    d_w = torch.zeros_like(w).index_add_(0, ids, torch.einsum("no,ni->noi", dy, x))
    return y, d_w


def test_the_reference_loop_is_a_matmul_per_row_with_its_expert():
    ids, offsets, x, w, dy = _case()
    truth, truth_w = _truths(ids, x, w, dy)
    torch.testing.assert_close(
        grouped.grouped_mm_reference(x, w, offsets), truth, rtol=1e-12, atol=1e-12
    )
    d_w = grouped.grouped_mm_wgrad_reference(dy, x, offsets)
    torch.testing.assert_close(d_w, truth_w, rtol=1e-12, atol=1e-12)
    assert torch.equal(d_w[2], torch.zeros_like(d_w[2]))  # the expert without rows


def test_bad_offsets_are_refused_by_name():
    _, offsets, x, w, _ = _case()
    with pytest.raises(ValueError, match=r"grouped_mm: offsets must have E \+ 1 = 6 entries"):
        grouped.grouped_mm_reference(x, w, offsets[:-1])
    with pytest.raises(ValueError, match=r"grouped_mm: offsets end at 38, x has 37 rows"):
        grouped.grouped_mm_reference(x, w, torch.cat([offsets[:-1], offsets[-1:] + 1]))
    with pytest.raises(ValueError, match=r"grouped_mm: offsets must have E \+ 1 = 6 entries"):
        grouped.forward_operands(x, w, offsets[:-1])


def _window_case(dtype=torch.float64, device="cpu", used=29):
    """A case whose offsets end at row ``used`` of ``ROWS``: the rows past it hold NaN (a
    shard's window, ``kit.moe.ShardWindow``: rows of other shards, never computed)."""
    ids, offsets, x, w, dy = _case(dtype, device)
    offsets = torch.minimum(offsets, torch.tensor(used, dtype=offsets.dtype, device=device))
    x, dy = x.clone(), dy.clone()
    x[used:], dy[used:] = float("nan"), float("nan")
    return ids[:used], offsets, x, w, dy


def test_rows_past_the_last_offset_are_neither_computed_nor_summed():
    """Offsets ending before the rows (a shard's window): the rows before the end are
    each expert's, as with every row; the rows past it (NaN here) change nothing: no
    output row of theirs is computed and no weight gradient takes them."""
    used = 29
    ids, offsets, x, w, dy = _window_case(used=used)
    truth, truth_w = _truths(ids, x[:used], w, dy[:used])
    y = grouped.grouped_mm_reference(x, w, offsets)
    torch.testing.assert_close(y[:used], truth, rtol=1e-12, atol=1e-12)
    d_w = grouped.grouped_mm_wgrad_reference(dy, x, offsets)
    torch.testing.assert_close(d_w, truth_w, rtol=1e-12, atol=1e-12)


def _cpu_grouped_mm(*operands):
    try:
        return torch._grouped_mm(operands[0], operands[1], offs=operands[2])
    except (AttributeError, NotImplementedError, RuntimeError) as error:
        if "CPU" in str(error) or isinstance(error, AttributeError | NotImplementedError):
            pytest.skip(f"this torch has no CPU torch._grouped_mm: {error}")
        raise


@pytest.mark.parametrize("empty", [(2,), (0, 4), (0, 1, 2, 3)], ids=["mid", "ends", "one"])
def test_the_operands_follow_torch_grouped_mm_conventions(empty):
    """The very operands the CUDA variant passes, through torch's CPU ``_grouped_mm``:
    int32 group ends (no leading 0), the 3-D weights as (E, in, out), ``dy.t()`` by the
    rows for the gradient; empty experts first, last, and all but one."""
    ids, offsets, x, w, dy = _case(torch.float32, empty=empty)
    truth, truth_w = _truths(ids, x, w, dy)
    mat_a, mat_b, offs = grouped.forward_operands(x, w, offsets)
    assert offs.dtype == torch.int32 and offs.shape == (EXPERTS,) and int(offs[-1]) == ROWS
    assert mat_b.shape == (EXPERTS, IN, OUT) and grouped.strides_ok(mat_b)
    y = _cpu_grouped_mm(mat_a, mat_b, offs)
    torch.testing.assert_close(y.double(), truth, rtol=1e-5, atol=1e-5)
    mat_a, mat_b, offs = grouped.wgrad_operands(dy, x, offsets)
    assert mat_a.stride(0) == 1 and mat_b.stride(1) == 1  # column-major A, row-major B
    d_w = _cpu_grouped_mm(mat_a, mat_b, offs)
    torch.testing.assert_close(d_w.double(), truth_w, rtol=1e-5, atol=1e-5)
    for expert in empty:
        assert torch.equal(d_w[expert], torch.zeros_like(d_w[expert]))


def test_the_stride_rule_is_torch_grouped_mms():
    """Row- or column-major with the other stride a multiple of 16 bytes (8 bf16)."""
    w = torch.zeros(4, 24, 16, dtype=torch.bfloat16)
    assert grouped.strides_ok(w) and grouped.strides_ok(w.transpose(-2, -1))
    assert not grouped.strides_ok(torch.zeros(6, 12, dtype=torch.bfloat16))  # 24 bytes
    assert grouped.strides_ok(torch.zeros(6, 12, dtype=torch.float32))  # 48 bytes
    assert not grouped.strides_ok(w[:, :, ::2])  # neither row- nor column-major
    assert grouped.strides_ok(torch.zeros(6, 24, dtype=torch.bfloat16)[:, :12])  # stride 24


# -- CUDA --------------------------------------------------------------------------------
def _cuda_case(**kw):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    return _case(torch.bfloat16, "cuda", **kw)


def _bf16_close(out, truth, contraction):
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(
        out.double().cpu(), truth.double().cpu(), rtol=2**-7, atol=1e-3 * contraction**0.5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("empty", [(2,), (0, 7), (0, 1, 2, 3, 4, 5, 6)], ids=["mid", "ends", "one"])
def test_torch_grouped_mm_variant_matches_the_loop_on_cuda(empty):
    """bf16 ``torch._grouped_mm`` (the fast path taken: asserted) against the float32
    loop over the same inputs; experts without rows in the middle, at both ends, and
    all but one; their weight gradient exactly 0."""
    ids, offsets, x, w, dy = _cuda_case(empty=empty, experts=8, rows=300)
    assert grouped._fast(*grouped.forward_operands(x, w, offsets)[:2], OUT, 8)
    wa, wb, _ = grouped.wgrad_operands(dy, x, offsets)
    assert grouped._fast(wa, wb, IN, 8)
    truth = grouped.grouped_mm_reference(x.float(), w.float(), offsets)
    _bf16_close(grouped.grouped_mm_cuda(x, w, offsets), truth, IN)
    truth_w = grouped.grouped_mm_wgrad_reference(dy.float(), x.float(), offsets)
    d_w = grouped.grouped_mm_wgrad_cuda(dy, x, offsets)
    _bf16_close(d_w, truth_w, 300)
    for expert in empty:
        assert torch.equal(d_w[expert], torch.zeros_like(d_w[expert])), expert


@pytest.mark.gpu
def test_rows_past_the_last_offset_are_left_out_by_the_kernel_on_cuda():
    """``torch._grouped_mm`` with offsets ending before the rows (a shard's window, rows
    past it NaN): the rows before the end agree with the loop and are finite, and the
    weight gradient takes no row past it (finite, and equal to the loop's)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    used = 200
    ids, offsets, x, w, dy = _case(torch.bfloat16, "cuda", experts=8, rows=304)
    offsets = torch.minimum(offsets, torch.tensor(used, dtype=offsets.dtype, device="cuda"))
    x[used:], dy[used:] = float("nan"), float("nan")
    assert grouped._fast(*grouped.forward_operands(x, w, offsets)[:2], OUT, 8)
    truth = grouped.grouped_mm_reference(x[:used].float(), w.float(), offsets)
    _bf16_close(grouped.grouped_mm_cuda(x, w, offsets)[:used], truth, IN)
    truth_w = grouped.grouped_mm_wgrad_reference(dy[:used].float(), x[:used].float(), offsets)
    _bf16_close(grouped.grouped_mm_wgrad_cuda(dy, x, offsets), truth_w, used)


@pytest.mark.gpu
def test_the_transposed_weight_of_the_backward_takes_the_kernel_on_cuda():
    """The MoE backward's ``grouped_mm(d_rows, down.transpose(1, 2), offsets)``: a
    weight given as a transposed view reaches the kernel row-major, and agrees."""
    ids, offsets, x, w, dy = _cuda_case(experts=8, rows=300)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # (E, OUT, IN) stored (E, IN, OUT)
    assert grouped._fast(*grouped.forward_operands(x, w_t, offsets)[:2], OUT, 8)
    truth = grouped.grouped_mm_reference(x.float(), w.float(), offsets)
    _bf16_close(grouped.grouped_mm_cuda(x, w_t, offsets), truth, IN)


@pytest.mark.gpu
def test_operands_the_kernel_does_not_take_fall_back_to_the_loop_on_cuda():
    """A row block 2 bytes off 16-byte alignment, and a width that is not a multiple of
    8, take the loop (no error) and agree with the truth."""
    ids, offsets, x, w, dy = _cuda_case(experts=8, rows=300)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and not grouped._tma_ready(shifted)
    truth = grouped.grouped_mm_reference(x.float(), w.float(), offsets)
    _bf16_close(grouped.grouped_mm_cuda(shifted, w, offsets), truth, IN)
    narrow = w[:, : OUT - 4].contiguous()
    assert not grouped._fast(*grouped.forward_operands(x, narrow, offsets)[:2], OUT - 4, 8)
    _bf16_close(grouped.grouped_mm_cuda(x, narrow, offsets), truth[:, : OUT - 4], IN)


@pytest.mark.gpu
def test_the_kernel_replays_in_a_cuda_graph_with_new_routing():
    """Captured once (the engine replays steps as CUDA graphs), replayed with other
    offsets in the same buffers: no host read of the offsets, the new routing used."""
    ids, offsets, x, w, dy = _cuda_case(experts=8, rows=304)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        grouped.grouped_mm_cuda(x, w, offsets), grouped.grouped_mm_wgrad_cuda(dy, x, offsets)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped.grouped_mm_cuda(x, w, offsets)
        d_w = grouped.grouped_mm_wgrad_cuda(dy, x, offsets)
    ids2, offsets2, *_ = _case(empty=(3,), experts=8, rows=304, seed=9)
    offsets.copy_(offsets2.to(offsets.device))
    graph.replay()
    torch.cuda.synchronize()
    _bf16_close(y, grouped.grouped_mm_reference(x.float(), w.float(), offsets), IN)
    _bf16_close(d_w, grouped.grouped_mm_wgrad_reference(dy.float(), x.float(), offsets), 304)
    assert torch.equal(d_w[3], torch.zeros_like(d_w[3]))
