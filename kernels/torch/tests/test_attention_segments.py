"""attention_fwd / attention_bwd with ``segments`` (padded and packed batches) against
plain autograd of a masked softmax in float64.

The truth, written here from the definition: query ``i`` of row ``b`` sees key ``j`` only
where ``segments[b, i] == segments[b, j] >= 0`` (and causally, and in the window or the
mask where given); a padded query (id -1) sees nothing, so its output, its lse and every
gradient through it are zero. Every variant's (out, lse) and its backward (dq, dk, dv from
its own out and lse) are compared with it by relative error (conftest.PRECISIONS: CPU
float64 1e-10, CPU float32 1e-5, CUDA float32 1e-4, CUDA 16-bit 1e-2); on CUDA the
``gpu`` runs of these tests check flash's varlen kernels (16-bit, no mask) and the
memory-efficient kernel's per-row bias (float32, or a mask).

The varlen layout (``attention_varlen``) is checked on the CPU: its ``cu_seqlens`` against
runs counted in Python, its refusal of an id split in one row, the maps between the
contract's layout and the kernels', and the whole varlen path with the kernels replaced
by their definition (``FakeVarlenFlash``: per sequence of ``cu_seqlens``, float64).
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from dataflow_kernels_torch import attention, attention_varlen

#: the pairs and the cuDNN pair (which hands segments to the torch pair)
VARIANTS = ["torch", "reference", "cudnn"]


def truth(q, k, v, dout, segments, *, causal, window=None, mask=None):
    """(out, lse, dq, dk, dv) in float64: a masked softmax, gradients by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    owner = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    scores = q64 @ k64[:, owner].transpose(-2, -1) / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    index = torch.arange(seq, device=q.device)
    keep = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
    if causal:
        keep &= index[None, :, None] >= index[None, None, :]
    if window is not None:
        keep &= index[None, :, None] - index[None, None, :] < window
    if mask is not None:
        keep &= mask
    scores = scores.masked_fill(~keep[:, None], -math.inf)
    seen = keep.any(-1)[:, None, :]  # a padded query sees nothing: lse 0, out 0
    lse = torch.where(seen, torch.logsumexp(scores, dim=-1), 0.0)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs @ v64[:, owner]
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return (out.detach(), lse.detach(), *grads)


def ids(rows: list[list[tuple[int, int]]], seq: int, device) -> torch.Tensor:
    """Segment ids from (id, length) runs per row, the rest of each row padding."""
    out = torch.full((len(rows), seq), -1, dtype=torch.int64)
    for row, runs in enumerate(rows):
        at = 0
        for sequence, length in runs:
            out[row, at : at + length] = sequence
            at += length
    return out.to(device)


#: (batch, heads, kv_heads, seq, head_dim), the runs of each row: packed documents,
#: right and left padding (a run of -1), one sequence alone
CASES = [
    ((2, 4, 2, 17, 16), [[(0, 5), (1, 7), (2, 5)], [(3, 10)]]),
    ((2, 3, 3, 24, 32), [[(-1, 4), (0, 20)], [(7, 9), (8, 9), (-1, 6)]]),
    ((1, 2, 1, 33, 64), [[(0, 1), (1, 31)]]),
]


def _run(kernel, name, q, k, v, dout, segments, **cuts):
    out, lse = kernel("attention_fwd", name)(q, k, v, segments=segments, **cuts)
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, segments=segments, **cuts)
    return out, lse, *grads


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize(("shape", "runs"), CASES, ids=lambda c: str(c)[:24])
@pytest.mark.parametrize("cut", ["causal", "window 4", "not causal", "mask"])
def test_segments_match_a_masked_softmax(
    kernel, randn, assert_rel_close, device, dtype, tol, name, shape, runs, cut
) -> None:
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    segments = ids(runs, seq, device)
    cuts: dict = {"causal": cut != "not causal"}
    if cut == "window 4":
        cuts["window"] = 4
    if cut == "mask":  # every third key left out, each query keeping itself
        index = torch.arange(seq, device=device)
        cuts["mask"] = (index[None, :] % 3 != 0) | (index[:, None] == index[None, :])
    want = truth(q, k, v, dout, segments, **cuts)
    got = _run(kernel, name, q, k, v, dout, segments, **cuts)
    for label, g, w, like in zip(
        ("out", "lse", "dq", "dk", "dv"), got, want, (q, q[..., 0], q, k, v), strict=True
    ):
        assert g.shape == like.shape, label
        assert_rel_close(g, w, tol, label)
    padded = segments < 0
    assert not got[0][padded[:, None, :, None].expand_as(got[0])].any()  # exact zeros
    assert not got[2][padded[:, None, :, None].expand_as(got[2])].any()


@pytest.mark.parametrize("name", VARIANTS)
def test_one_sequence_per_row_is_plain_causal_attention(kernel, randn, name) -> None:
    """Segments of one id per row change nothing (the same kernels' bits aside)."""
    q, k, v, dout = (randn(2, 2, 13, 8, dtype=torch.float64) for _ in range(4))
    plain = _run(kernel, name, q, k, v, dout, None, causal=True)
    one = _run(kernel, name, q, k, v, dout, torch.zeros(2, 13, dtype=torch.int64), causal=True)
    for a, b in zip(plain, one, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", VARIANTS)
def test_segments_are_an_int_tensor_of_the_batch(kernel, randn, name) -> None:
    q = randn(2, 2, 9, 8)
    for bad in (
        torch.zeros(2, 9),  # float
        torch.zeros(2, 8, dtype=torch.int64),  # the wrong length
        torch.zeros(9, dtype=torch.int64),  # no batch
        [[0] * 9] * 2,  # not a tensor
    ):
        with pytest.raises(ValueError, match=r"segments are a \(2, 9\) int32/int64 tensor"):
            kernel("attention_fwd", name)(q, q, q, causal=True, segments=bad)


def python_runs(segments: torch.Tensor) -> list[int]:
    """The cumulative sequence lengths of ``segments``' runs, counted in Python."""
    cu = [0]
    for row in segments.tolist():
        length = 0
        for at, token in enumerate(row):
            if at and token != row[at - 1]:
                cu.append(cu[-1] + length)
                length = 0
            length += 1
        cu.append(cu[-1] + length)
    return cu


@pytest.mark.parametrize(
    ("rows", "seq", "want"),
    [
        ([[(0, 5), (1, 7), (2, 5)], [(3, 10)]], 17, [0, 5, 12, 17, 27, 34]),  # packed, padded
        ([[(-1, 4), (0, 20)], [(7, 9), (8, 9), (-1, 6)]], 24, [0, 4, 24, 33, 42, 48]),  # left
        ([[(0, 1), (1, 31)]], 33, [0, 1, 32, 33]),  # one token, then a padding token
        ([[(4, 6)], [(4, 6)]], 6, [0, 6, 12]),  # one id in two rows: two sequences
    ],
)
def test_varlen_layout_cuts_each_run_of_a_row(rows, seq, want) -> None:
    segments = ids(rows, seq, "cpu")
    layout = attention_varlen.varlen_layout(segments)
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == want == python_runs(segments)
    assert layout.max_len == max(b - a for a, b in zip(want, want[1:], strict=False))


def test_varlen_layout_of_random_runs(randn) -> None:
    generator = randn.generator
    for _ in range(20):
        batch, seq = torch.randint(1, 5, (2,), generator=generator).tolist()
        seq *= 7
        # ids from runs of random lengths, padding among them, never one id twice a row
        rows = []
        for _ in range(batch):
            runs, at, next_id = [], 0, 0
            while at < seq:
                length = int(torch.randint(1, 9, (), generator=generator))
                pad = bool(torch.randint(0, 4, (), generator=generator) == 0)
                runs.append((-1 if pad else next_id, min(length, seq - at)))
                next_id += not pad
                at += length
            rows.append(runs)
        segments = ids(rows, seq, "cpu")
        layout = attention_varlen.varlen_layout(segments.to(torch.int32))
        assert layout.cu_seqlens.tolist() == python_runs(segments)
        lengths = layout.cu_seqlens.diff()
        assert layout.max_len == int(lengths.max()) and bool((lengths > 0).all())


def test_varlen_layout_refuses_an_id_split_in_a_row() -> None:
    """The mask joins the runs of one id in a row; the varlen kernels cannot: no layout.
    Split padding is fine (padded queries see nothing either way)."""
    split = torch.tensor([[0, 0, 1, 1], [2, 3, 2, -1]])
    assert attention_varlen.varlen_layout(split) is None
    assert attention_varlen.varlen_layout(split[:1]) is not None
    padding_split = torch.tensor([[-1, 0, 0, -1], [1, -1, -1, 2]])
    assert attention_varlen.varlen_layout(padding_split).cu_seqlens.tolist() == [
        0, 1, 3, 4, 5, 7, 8,
    ]  # fmt: skip


def test_flash_varlen_needs_flash_no_mask_and_contiguous_ids(randn) -> None:
    q = randn(2, 2, 4, 8)
    packed, split = torch.tensor([[0, 0, 1, 1], [5, 5, 5, -1]]), torch.tensor([[0, 1, 0, 1]] * 2)
    assert attention._flash_varlen("flash", q, None, packed) is not None
    assert attention._flash_varlen("flash", q, None, split) is None
    assert attention._flash_varlen("efficient", q, None, packed) is None
    assert attention._flash_varlen("cpu", q, None, packed) is None
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert attention._flash_varlen("flash", q, mask, packed) is None
    one_token_each = torch.tensor([[0, 1, 2, 3]] * 2)  # flash would swap grouped heads
    assert attention._flash_varlen("flash", q, None, one_token_each) is None


def test_the_maps_to_the_varlen_layout_round_trip(randn) -> None:
    batch, heads, seq = 3, 4, 5
    t = randn(batch, heads, seq, 8)
    tokens = attention_varlen.tokens_of(t)
    assert tokens.shape == (batch * seq, heads, 8)
    assert torch.equal(tokens[2 * seq + 3, 1], t[2, 1, 3])  # row-major over (batch, seq)
    assert torch.equal(attention_varlen.heads_of(tokens, batch), t)
    # a fake varlen lse: entry (h, b * seq + i) holds 1000 h + 100 b + i
    h, token = torch.meshgrid(torch.arange(heads), torch.arange(batch * seq), indexing="ij")
    varlen = (1000 * h + 100 * (token // seq) + token % seq).float()
    lse = attention_varlen.lse_of_varlen(varlen, batch)
    assert lse.shape == (batch, heads, seq) and lse.is_contiguous()
    b, h, i = torch.meshgrid(
        torch.arange(batch), torch.arange(heads), torch.arange(seq), indexing="ij"
    )
    assert torch.equal(lse, (1000 * h + 100 * b + i).float())
    back = attention_varlen.lse_to_varlen(lse.double())
    assert back.dtype == torch.float32 and back.is_contiguous()
    assert torch.equal(back, varlen)


class FakeVarlenFlash:
    """``aten._flash_attention_forward`` / ``_flash_attention_backward`` with cumulative
    sequence lengths, from their definition: each sequence of ``cu_seqlens`` attends
    within itself (causal, ``window_size_left`` keys back), grouped key/value heads shared;
    the lse (heads, total) unpadded; the backward's probabilities from the lse it is given.
    Float64 inside; it records its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _sequences(self, cu, max_q, max_k, dropout_p):
        assert cu.dtype == torch.int32 and dropout_p == 0.0
        bounds = cu.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        return list(zip(bounds, bounds[1:], strict=False))

    @staticmethod
    def _scale(q, scale):
        return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    @staticmethod
    def _keep(length, causal, left, right):
        index = torch.arange(length)
        distance = index[:, None] - index[None, :]
        keep = torch.ones(length, length, dtype=torch.bool)
        if causal:
            keep &= distance >= 0
        if left is not None:
            keep &= distance <= left
        if right is not None:
            keep &= distance >= -right
        return keep

    def _flash_attention_forward(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale,
        window_size_left=None, window_size_right=None,
    ):  # fmt: skip
        self.calls.append("fwd")
        assert cu_q is cu_k and not debug
        group = q.shape[1] // k.shape[1]
        out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape[1], q.shape[0])
        lse = lse.double()
        for a, b in self._sequences(cu_q, max_q, max_k, dropout_p):
            qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            scores = qs @ ks.transpose(-2, -1) * self._scale(q, scale)
            keep = self._keep(b - a, causal, window_size_left, window_size_right)
            scores = scores.masked_fill(~keep, -math.inf)
            lse[:, a:b] = torch.logsumexp(scores, -1)
            out[a:b] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
        return out.to(q.dtype), lse, None, None, None

    def _flash_attention_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng,
        unused, *, scale, window_size_left=None, window_size_right=None,
    ):  # fmt: skip
        self.calls.append("bwd")
        assert cu_q is cu_k and lse.shape == (q.shape[1], q.shape[0])
        assert lse.dtype == torch.float32 and lse.is_contiguous()
        heads, kv_heads = q.shape[1], k.shape[1]
        group = heads // kv_heads
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk = torch.zeros(k.shape[0], heads, k.shape[2], dtype=torch.float64)
        dv = torch.zeros_like(dk)
        for a, b in self._sequences(cu_q, max_q, max_k, dropout_p):
            qs, ks, vs, os, ds = (t[a:b].double().transpose(0, 1) for t in (q, k, v, out, dout))
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            scores = qs @ ks.transpose(-2, -1) * self._scale(q, scale)
            keep = self._keep(b - a, causal, window_size_left, window_size_right)
            scores = scores.masked_fill(~keep, -math.inf)
            probs = (scores - lse[:, a:b, None].double()).exp()
            delta = (ds * os).sum(-1, keepdim=True)
            d_scores = probs * (ds @ vs.transpose(-2, -1) - delta)
            dq[a:b] = (d_scores @ ks * self._scale(q, scale)).transpose(0, 1)
            dk[a:b] = (d_scores.transpose(-2, -1) @ qs * self._scale(q, scale)).transpose(0, 1)
            dv[a:b] = (probs.transpose(-2, -1) @ ds).transpose(0, 1)
        dk, dv = (t.view(t.shape[0], kv_heads, group, -1).sum(2) for t in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.mark.parametrize(("shape", "runs"), CASES, ids=lambda c: str(c)[:24])
@pytest.mark.parametrize("cut", ["causal", "window 4", "not causal"])
def test_the_varlen_path_matches_a_masked_softmax(
    monkeypatch, randn, assert_rel_close, shape, runs, cut
) -> None:
    """The torch pair's varlen path on the CPU, its kernels ``FakeVarlenFlash``: the
    layout, the maps and the zeroing of padded queries against the float64 truth (1e-6:
    the kernels' lse is float32, as flash's)."""
    fake = FakeVarlenFlash()
    monkeypatch.setattr(attention_varlen, "_aten", types.SimpleNamespace(
        _flash_attention_forward=fake._flash_attention_forward,
        _flash_attention_backward=fake._flash_attention_backward,
    ))  # fmt: skip
    monkeypatch.setattr(attention, "backend", lambda q: "flash")
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=torch.float64) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=torch.float64) for _ in range(2))
    segments = ids(runs, seq, "cpu")
    cuts: dict = {"causal": cut != "not causal"}
    if cut == "window 4":
        cuts["window"] = 4
    want = truth(q, k, v, dout, segments, **cuts)
    out, lse = attention.attention_fwd(q, k, v, segments=segments, **cuts)
    lse = lse + segments[:, None, :].lt(0) * 7.0  # a padded query's lse: whatever it is
    grads = attention.attention_bwd(dout, q, k, v, out, lse, segments=segments, **cuts)
    assert fake.calls == ["fwd", "bwd"]
    lse = lse.masked_fill(segments[:, None, :] < 0, 0.0)
    for label, g, w, like in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want, (q, q[..., 0], q, k, v),
        strict=True,
    ):  # fmt: skip
        assert g.shape == like.shape, label
        assert_rel_close(g, w, 1e-6, label)
    padded = segments < 0
    assert not out[padded[:, None, :, None].expand_as(out)].any()  # exact zeros
    assert not grads[0][padded[:, None, :, None].expand_as(grads[0])].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cut", ["causal", "window 64", "not causal"])
def test_a_long_packed_row_with_grouped_heads(kernel, randn, assert_rel_close, dtype, cut) -> None:
    """1024 tokens a row, five documents and padding, 8 query heads on 2 key/value heads:
    flash's varlen kernels (where the device has them), against the float64 truth."""
    device = "cuda"
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 1024, 64
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    runs = [
        [(0, 100), (1, 300), (2, 1), (3, 400), (4, 200), (-1, 23)],
        [(-1, 24), (5, 1000)],
    ]
    segments = ids(runs, seq, device)
    cuts: dict = {"causal": cut != "not causal"}
    if cut == "window 64":
        cuts["window"] = 64
    if attention.backend(q) == "flash":
        assert attention._flash_varlen("flash", q, None, segments) is not None
    want = truth(q, k, v, dout, segments, **cuts)
    for name in VARIANTS:
        got = _run(kernel, name, q, k, v, dout, segments, **cuts)
        for label, g, w, like in zip(
            ("out", "lse", "dq", "dk", "dv"), got, want, (q, q[..., 0], q, k, v), strict=True
        ):
            assert g.shape == like.shape, f"{name} {label}"
            assert_rel_close(g, w, 1e-2, f"{name} {label}")
        padded = segments < 0
        assert not got[0][padded[:, None, :, None].expand_as(got[0])].any()
        assert not got[2][padded[:, None, :, None].expand_as(got[2])].any()


@pytest.mark.gpu
def test_segments_under_graph_capture_take_the_mask_path(kernel, randn) -> None:
    """In a CUDA graph (the engine captures steps) the varlen layout, which reads the
    segments on the host, is not made: the mask path runs, and replays what it captured."""
    q, k, v, dout = (randn(2, 4, 64, 32, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    segments = ids([[(0, 30), (1, 34)], [(2, 50), (-1, 14)]], 64, "cuda")
    fwd, bwd = kernel("attention_fwd", "torch"), kernel("attention_bwd", "torch")

    split = ids([[(0, 30), (1, 4), (0, 30)]] * 2, 64, "cuda")  # the mask path, eager

    def step(segments):
        out, lse = fwd(q, k, v, causal=True, segments=segments)
        return out, lse, *bwd(dout, q, k, v, out, lse, causal=True, segments=segments)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as graphs ask
        step(segments)
        step(split)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(segments)
    graph.replay()
    torch.cuda.synchronize()
    want = truth(q, k, v, dout, segments, causal=True)
    for label, g, w in zip(("out", "lse", "dq", "dk", "dv"), captured, want, strict=True):
        error = float((g.double() - w).norm() / w.norm().clamp_min(1e-30))
        assert error <= 1e-2, f"{label}: relative error {error:.3g}"
