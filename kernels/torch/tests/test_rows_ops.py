"""The masked row ops of an MoE shard's window (``rows.py``) against a per-row loop in
float64: only the valid rows count, whatever the others hold (NaN and infinities here),
and the adds' float32 sums match the float64 truth.

Tolerances: float32 sums of bfloat16 rows times float32 weights, against float64 sums of
the same rounded inputs: relative 1e-6 (a token gathers at most a few dozen rows here;
float32's unit is 6e-8). The puts copy (a cast at most), so exactly.
"""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch import rows as rows_ops
from hypothesis import given, settings
from hypothesis import strategies as st


def _window(count, n_rows, width, valid_rows, dtype, device="cpu", seed=0):
    """(rows with NaN/inf where not valid, the tokens, valid: the first ``valid_rows``,
    weights)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_rows, width, generator=g, dtype=torch.float64)
    valid = torch.arange(n_rows) < valid_rows
    junk = torch.tensor([float("nan"), float("inf")], dtype=torch.float64).repeat(width)
    rows[~valid] = junk[:width]
    into = torch.randint(0, max(count, 1), (n_rows,), generator=g)
    into[~valid] = -7  # never read where not valid
    weights = torch.rand(n_rows, generator=g, dtype=torch.float64)
    return rows.to(device, dtype), into.to(device), valid.to(device), weights.to(device)


def _truth(rows, into, valid, weights, count):
    """The loop: each valid row, times its weight, added into its token, in float64."""
    out = torch.zeros(count, rows.shape[1], dtype=torch.float64)
    for i in range(rows.shape[0]):
        if bool(valid[i]):
            factor = 1.0 if weights is None else float(weights[i])
            out[int(into[i])] += rows[i].double().cpu() * factor
    return out


@settings(max_examples=30, deadline=None)
@given(
    count=st.integers(1, 9),
    n_rows=st.integers(0, 40),
    share=st.floats(0, 1),
    width=st.integers(1, 7),
    slices=st.integers(1, 5),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_torch_and_reference_adds_sum_the_valid_rows_alone(
    count, n_rows, share, width, slices, weighted, seed
) -> None:
    rows, into, valid, weights = _window(
        count, n_rows, width, round(share * n_rows), torch.float32, seed=seed
    )
    weights = weights.float() if weighted else None
    want, given = _truth(rows, into, valid, weights, count), rows.clone()
    for add in (rows_ops.rows_add_masked, rows_ops.rows_add_masked_reference):
        got = add(rows, into, valid, weights, count, slices=slices)
        assert got.dtype == torch.float32 and got.shape == (count, width)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        # the caller's rows untouched (a float32 cast is no copy: nothing scales in place)
        torch.testing.assert_close(rows, given, rtol=0, atol=0, equal_nan=True)


def test_float64_rows_are_summed_in_float64() -> None:
    rows, into, valid, weights = _window(5, 30, 4, 20, torch.float64)
    want = _truth(rows, into, valid, weights, 5)
    for add in (rows_ops.rows_add_masked, rows_ops.rows_add_masked_reference):
        got = add(rows, into, valid, weights, 5)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("put", [rows_ops.rows_put_masked, rows_ops.rows_put_masked_reference])
def test_the_puts_write_the_valid_rows_and_keep_the_others(put) -> None:
    g = torch.Generator().manual_seed(3)
    index = torch.randperm(12, generator=g)
    valid = torch.arange(12) < 5
    values = torch.full((12, 2, 3), float("nan"))
    values[:5] = torch.randn(5, 2, 3, generator=g)
    target = torch.arange(72, dtype=torch.bfloat16).view(12, 2, 3)
    want = target.clone()
    want[index[:5]] = values[:5].to(torch.bfloat16)
    put(values, index, valid, target)
    assert torch.equal(target, want)


@settings(max_examples=30, deadline=None)
@given(
    n_source=st.integers(1, 9),
    n_rows=st.integers(0, 40),
    share=st.floats(0, 1),
    width=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_the_torch_and_reference_gathers_give_the_valid_rows(
    n_source, n_rows, share, width, seed
) -> None:
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(n_source, width, generator=g).to(torch.bfloat16)
    index = torch.randint(0, n_source, (n_rows,), generator=g)
    valid = torch.arange(n_rows) < round(share * n_rows)
    for gather in (rows_ops.rows_gather_masked, rows_ops.rows_gather_masked_reference):
        got = gather(source, index, valid)
        assert got.dtype == source.dtype and got.shape == (n_rows, width)
        assert torch.equal(got[valid], source[index[valid]])
    assert not rows_ops.rows_gather_masked_reference(source, index, valid)[~valid].any()


def _swiglu_rows(n_rows, inner, valid_rows, dtype, device="cpu", seed=0):
    """(gate_up, d_act, weights, valid: the first ``valid_rows``), the rows not valid NaN."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n_rows, 2 * inner, generator=g, dtype=torch.float64)
    d_act = torch.randn(n_rows, inner, generator=g, dtype=torch.float64)
    weights = torch.rand(n_rows, generator=g, dtype=torch.float64)
    valid = torch.arange(n_rows) < valid_rows
    gate_up[~valid], d_act[~valid] = float("nan"), float("nan")
    return (*(t.to(device, dtype) for t in (gate_up, d_act, weights)), valid.to(device))


#: ``swiglu_rows_bwd`` against the float64 formulas, norm-wise: float32 rows to float32
#: rounding; bfloat16 rows to a few roundings (the torch variant rounds the activation,
#: then its product with the weight: each 2**-9 relative at most)
SWIGLU_ROWS_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,valid_rows", [(40, 13), (7, 0), (16, 16)])
def test_the_torch_swiglu_rows_backward_matches_the_formulas(
    dtype, n_rows, valid_rows, assert_rel_close
) -> None:
    """The valid rows' activation times weight, gate and up gradients and the weights'
    gradients (float32) as the float64 formulas; the rows not valid (NaN) change none."""
    args = _swiglu_rows(n_rows, 24, valid_rows, dtype)
    valid = args[-1]
    want = rows_ops.swiglu_rows_bwd_reference(*args)
    got = rows_ops.swiglu_rows_bwd(*args)
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32]
    assert [t.shape for t in got] == [t.shape for t in want]
    for name, a, b in zip(("act", "d_gate_up", "d_weights"), got, want, strict=True):
        if valid_rows:
            assert_rel_close(a[valid].double(), b[valid].double(), SWIGLU_ROWS_TOL[dtype], name)
    assert not any(t[~valid].any() for t in want)  # the reference's zeros


def test_operands_that_disagree_are_refused_by_name() -> None:
    rows, into, valid, weights = _window(3, 10, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="into must be"):
        rows_ops.rows_add_masked(rows, into[:4], valid, weights, 3)
    with pytest.raises(ValueError, match="valid must be bool"):
        rows_ops.rows_add_masked(rows, into, valid.int(), weights, 3)
    with pytest.raises(ValueError, match="rows_put_masked"):
        rows_ops.rows_put_masked(rows, into, valid, torch.zeros(10, 5))
    with pytest.raises(ValueError, match="source must be"):
        rows_ops.rows_gather_masked(rows[0], into, valid)
    with pytest.raises(ValueError, match="index must be"):
        rows_ops.rows_gather_masked(rows, into.int(), valid)
    with pytest.raises(ValueError, match="valid must be"):
        rows_ops.rows_gather_masked(rows, into, valid[:3])
    gate_up, d_act, weights, valid = _swiglu_rows(10, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="gate_up must be"):
        rows_ops.swiglu_rows_bwd(gate_up[:, :7], d_act, weights, valid)
    with pytest.raises(ValueError, match="d_act must be"):
        rows_ops.swiglu_rows_bwd(gate_up, d_act[:, :3], weights, valid)
    with pytest.raises(ValueError, match="weights must be"):
        rows_ops.swiglu_rows_bwd(gate_up, d_act, weights[:3], valid)
    with pytest.raises(ValueError, match="valid must be"):
        rows_ops.swiglu_rows_bwd(gate_up, d_act, weights, valid.int())


def _cuda_variants(manager, op):
    return [v.name for v in manager.kernels().for_op(op, device="cuda")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_cuda_variant_sums_a_shards_window_as_the_loop(
    manager, kernel, dtype, assert_rel_close
) -> None:
    """A window of 65,536 rows of 2,048 (qwen3_5_moe_cut's at batch 2), a quarter of
    them the shard's (the first, as a ``ShardWindow`` puts them), into 8,192 tokens."""
    count, n_rows, width = 8192, 65536, 2048
    rows, into, valid, weights = _window(count, n_rows, width, n_rows // 4, dtype, "cuda")
    weights = weights.float()
    keep = valid.cpu()
    want = torch.zeros(count, width, dtype=torch.float64)
    want.index_add_(
        0, into.cpu()[keep], rows.cpu()[keep].double() * weights.cpu()[keep].double()[:, None]
    )
    for name in _cuda_variants(manager, "rows_add_masked"):
        got = kernel("rows_add_masked", name)(rows, into, valid, weights, count, slices=4)
        assert got.dtype == torch.float32
        assert_rel_close(got, want, 1e-6, f"rows_add_masked/{name}")


@pytest.mark.gpu
def test_every_cuda_variant_puts_the_valid_rows(manager, kernel) -> None:
    n_rows, width = 65536, 1024
    g = torch.Generator().manual_seed(5)
    index = torch.randperm(n_rows, generator=g).cuda()
    valid = (torch.arange(n_rows) < n_rows // 3).cuda()
    values = torch.randn(n_rows, width, generator=g).cuda().to(torch.bfloat16)
    values[~valid] = float("nan")
    target = torch.randn(n_rows, width, generator=g).cuda().to(torch.bfloat16)
    want = target.clone()
    want[index[valid]] = values[valid]
    for name in _cuda_variants(manager, "rows_put_masked"):
        out = target.clone()
        kernel("rows_put_masked", name)(values, index, valid, out)
        assert torch.equal(out, want), name


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [2048, 1024])
def test_every_cuda_variant_gathers_the_valid_rows(manager, kernel, columns) -> None:
    """The window's gathers at qwen3_5_moe_cut's batch 2: 65,536 rows of 8,192 tokens'
    2,048 (``moe_in[tokens]``), and of the experts' ``gate_up`` rows, the first 1,024
    columns of 2,048 taken as a strided view (a row stride past its width)."""
    g = torch.Generator().manual_seed(6)
    n_rows, n_source = 65536, 8192 if columns == 2048 else 65536
    whole = torch.randn(n_source, 2048, generator=g).cuda().to(torch.bfloat16)
    source = whole[:, :columns]
    index = torch.randint(0, n_source, (n_rows,), generator=g).cuda()
    valid = (torch.arange(n_rows) < n_rows // 4).cuda()
    want = source[index[valid]]
    for name in _cuda_variants(manager, "rows_gather_masked"):
        got = kernel("rows_gather_masked", name)(source, index, valid)
        assert got.shape == (n_rows, columns) and torch.equal(got[valid], want), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_cuda_variant_runs_the_swiglu_rows_backward_as_the_formulas(
    manager, kernel, dtype, assert_rel_close
) -> None:
    """A backward shard's window at qwen3_5_moe_cut's batch 2: 65,536 rows of an inner
    width of 512, a quarter of them the shard's (the rest NaN)."""
    args = _swiglu_rows(65536, 512, 65536 // 4, dtype, "cuda")
    valid = args[-1]
    want = rows_ops.swiglu_rows_bwd_reference(*args)
    for name in _cuda_variants(manager, "swiglu_rows_bwd"):
        got = kernel("swiglu_rows_bwd", name)(*args)
        assert got[2].dtype == torch.float32
        for part, a, b in zip(("act", "d_gate_up", "d_weights"), got, want, strict=True):
            tol = SWIGLU_ROWS_TOL[dtype]
            assert_rel_close(a[valid].double(), b[valid].double(), tol, f"{name} {part}")


@pytest.mark.gpu
def test_the_fast_variants_replay_in_a_cuda_graph_with_a_new_window(manager, kernel) -> None:
    """Captured once, replayed after the window's rows, tokens and share changed: the
    result is the new window's (nothing of the first was read on the host)."""
    count, n_rows, width = 512, 4096, 256
    rows, into, valid, weights = _window(count, n_rows, width, 1000, torch.bfloat16, "cuda")
    weights = weights.float()
    index = torch.randperm(n_rows, device="cuda")
    target = torch.zeros(n_rows, width, device="cuda", dtype=torch.bfloat16)
    for name in ("torch", "triton"):
        if name not in _cuda_variants(manager, "rows_add_masked"):
            continue
        add, put = kernel("rows_add_masked", name), kernel("rows_put_masked", name)
        gather = kernel("rows_gather_masked", name)

        def step(add=add, put=put, gather=gather):
            put(rows, index, valid, target)
            return add(rows, into, valid, weights, count, slices=2), gather(rows, index, valid)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as graphs ask
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, gathered = step()
        new = _window(count, n_rows, width, 3000, torch.bfloat16, "cuda", seed=9)
        for held, fresh in zip((rows, into, valid), new[:3], strict=True):
            held.copy_(fresh)
        target.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = _truth(rows, into, valid, weights, count)
        torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-5)
        written = torch.zeros_like(target)
        written[index[valid]] = rows[valid]
        assert torch.equal(target, written), name
        torch.testing.assert_close(
            gathered[valid], rows[index[valid]], rtol=0, atol=0, equal_nan=True, msg=name
        )
