"""chunked_cross_entropy against a float64 autograd reference written here.

The reference builds the whole (tokens, vocab) logits in float64, sums
``logsumexp - logit[target]`` over the targets that are not -100, and takes both gradients
with ``torch.autograd.grad``. Tolerances (``torch.testing.assert_close``), inputs of unit
scale:

- float32 hidden and weight: loss rtol 1e-5; gradients rtol 1e-5, atol 1e-5
- bfloat16 hidden and weight: loss rtol 1e-4 (float32 math on the same bfloat16 values);
  gradients rtol 2e-2, atol 2e-2 (rounded to bfloat16 once, at the end)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VARIANTS = ["torch", "reference"]
IGNORE = -100
HALF = (torch.float16, torch.bfloat16)
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
GRAD_TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_sum, d_hidden, d_weight) in float64, from the definition, by autograd.
    ``logits_dtype``: the logits' values rounded to it (as a head that writes 16-bit logits
    has them), their gradient passed through exactly."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T
    if logits_dtype is not None:
        rounded = logits.detach().to(logits_dtype).double()
        logits = logits + (rounded - logits.detach())
    valid = targets != IGNORE
    picked = logits.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    per_token = torch.logsumexp(logits, dim=1) - picked
    loss = (per_token * valid).sum()
    d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
    return loss.detach(), d_hidden, d_weight


def make_targets(randn, tokens: int, vocab: int, ignored: float, device: str) -> torch.Tensor:
    generator = randn.generator
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[torch.rand(tokens, generator=generator) < ignored] = IGNORE
    return targets.to(device)


def d_weight_dtype(name, weight, tokens, chunk_tokens, tiles=False) -> torch.dtype:
    """The fast variants return a 16-bit d_weight summed over chunks as its float32
    accumulator (the caller rounds it once); one chunk, the tiles and the reference give
    weight's dtype."""
    summed = name != "reference" and not tiles and tokens > chunk_tokens
    return torch.float32 if summed and weight.dtype in HALF else weight.dtype


def check(kernel, hidden, weight, targets, chunk_tokens, name="torch") -> None:
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", name)(
        hidden, weight, targets, chunk_tokens
    )
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    assert d_hidden.shape == hidden.shape and d_hidden.dtype == hidden.dtype
    assert d_weight.shape == weight.shape
    assert d_weight.dtype == d_weight_dtype(name, weight, hidden.shape[0], chunk_tokens)
    assert d_hidden.device == hidden.device and d_weight.device == weight.device
    torch.testing.assert_close(
        loss.double(), want_loss, rtol=LOSS_RTOL[hidden.dtype], atol=LOSS_RTOL[hidden.dtype]
    )
    tolerance = GRAD_TOLERANCE[hidden.dtype]
    torch.testing.assert_close(d_hidden.double(), want_d_hidden, **tolerance)
    torch.testing.assert_close(d_weight.double(), want_d_weight, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "dim", "vocab", "chunk_tokens"),
    [
        (37, 16, 101, 8),  # chunks do not divide the tokens: the last has 5 rows
        (37, 16, 101, 37),  # one chunk exactly
        (37, 16, 101, 1000),  # a chunk larger than the tokens
        (5, 8, 11, 1),  # one token per chunk
        (64, 48, 257, 10),
        (1, 3, 2, 4),
    ],
)
@pytest.mark.parametrize("ignored", [0.0, 0.3])
@pytest.mark.parametrize("name", VARIANTS)
def test_matches_the_float64_reference(
    kernel, randn, device, dtype, tokens, dim, vocab, chunk_tokens, ignored, name
) -> None:
    hidden = randn(tokens, dim, dtype=dtype, device=device)
    weight = randn(vocab, dim, dtype=dtype, device=device)
    targets = make_targets(randn, tokens, vocab, ignored, device)
    check(kernel, hidden, weight, targets, chunk_tokens, name)


@pytest.mark.parametrize("device", DEVICES)
def test_peaked_logits_stay_finite(kernel, randn, device) -> None:
    """Logits in the hundreds: exp would overflow without the row max subtracted. float32
    logits of that size carry absolute errors near 3e-5, which the softmax passes on to the
    gradients as relative errors of about 1e-4: hence the looser tolerance here."""
    hidden = randn(19, 8, device=device, scale=10.0)
    weight = randn(23, 8, device=device, scale=10.0)
    targets = make_targets(randn, 19, 23, 0.2, device)
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, 4)
    assert torch.isfinite(loss) and torch.isfinite(d_hidden).all()
    assert torch.isfinite(d_weight).all()
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(d_hidden.double(), want_d_hidden, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(d_weight.double(), want_d_weight, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_every_target_ignored_gives_zero_loss_and_gradients(kernel, randn, device) -> None:
    hidden, weight = randn(9, 4, device=device), randn(13, 4, device=device)
    targets = torch.full((9,), IGNORE, device=device)
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, 4)
    assert float(loss) == 0.0
    assert not d_hidden.any() and not d_weight.any()


@pytest.mark.parametrize("device", DEVICES)
def test_ignored_tokens_get_no_gradient(kernel, randn, device) -> None:
    hidden, weight = randn(12, 6, device=device), randn(10, 6, device=device)
    targets = make_targets(randn, 12, 10, 0.0, device)
    targets[[2, 5, 11]] = IGNORE
    _, d_hidden, _ = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, 5)
    assert not d_hidden[[2, 5, 11]].any()
    assert d_hidden[[0, 1, 3]].abs().sum() > 0


def test_mixed_dtypes_bfloat16_hidden_float32_weight(kernel, randn) -> None:
    hidden = randn(21, 12, dtype=torch.bfloat16)
    weight = randn(31, 12)
    targets = make_targets(randn, 21, 31, 0.1, "cpu")
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, 6)
    assert d_hidden.dtype == torch.bfloat16 and d_weight.dtype == torch.float32
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_hidden.double(), want_d_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(d_weight.double(), want_d_weight, rtol=1e-5, atol=1e-5)


def test_chunk_size_does_not_change_the_result(kernel, randn) -> None:
    """Different chunkings sum the same float32 terms; they agree to float32 rounding."""
    hidden, weight = randn(50, 16), randn(40, 16)
    targets = make_targets(randn, 50, 40, 0.2, "cpu")
    ce = kernel("chunked_cross_entropy", "torch")
    whole = ce(hidden, weight, targets, 50)
    for chunk_tokens in (1, 7, 16, 49):
        for got, want in zip(ce(hidden, weight, targets, chunk_tokens), whole, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inputs_that_require_grad_build_no_graph(kernel, randn) -> None:
    hidden = randn(6, 4).requires_grad_()
    weight = randn(5, 4).requires_grad_()
    targets = make_targets(randn, 6, 5, 0.0, "cpu")
    outputs = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, 4)
    assert not any(t.requires_grad for t in outputs)


@pytest.mark.parametrize(
    ("hidden_shape", "weight_shape", "targets", "chunk_tokens", "message"),
    [
        ((4, 3), (5, 3), torch.zeros(4, dtype=torch.int64), 0, "chunk_tokens must be"),
        ((4, 3), (5, 3), torch.zeros(4, dtype=torch.int64), 2.0, "chunk_tokens must be"),
        ((4, 3), (5, 2), torch.zeros(4, dtype=torch.int64), 2, r"weight \(5, 2\)"),
        ((2, 4, 3), (5, 3), torch.zeros(4, dtype=torch.int64), 2, r"hidden \(2, 4, 3\)"),
        ((4, 3), (5, 3), torch.zeros(3, dtype=torch.int64), 2, r"expected targets \(4,\)"),
        ((4, 3), (5, 3), torch.zeros(4, dtype=torch.int32), 2, "must be int64"),
    ],
)
def test_bad_arguments_are_named(
    kernel, randn, hidden_shape, weight_shape, targets, chunk_tokens, message
) -> None:
    with pytest.raises(ValueError, match=message):
        kernel("chunked_cross_entropy", "torch")(
            randn(*hidden_shape), randn(*weight_shape), targets, chunk_tokens
        )


@pytest.mark.gpu
def test_holds_one_chunk_of_logits_at_a_time(kernel, randn) -> None:
    """Peak CUDA memory during the call: the outputs, the float32 d_weight, one chunk's
    logits and (chunk, dim) temporaries; a second chunk of logits would not fit the bound,
    and the whole (tokens, vocab) logits are 10x one chunk."""
    tokens, dim, vocab, chunk_tokens = 1000, 64, 8192, 100
    hidden = randn(tokens, dim, device="cuda")
    weight = randn(vocab, dim, device="cuda")
    targets = make_targets(randn, tokens, vocab, 0.1, "cuda")
    ce = kernel("chunked_cross_entropy", "torch")
    ce(hidden, weight, targets, chunk_tokens)  # warm up cuBLAS (its workspace is cached)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outputs = ce(hidden, weight, targets, chunk_tokens)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    logits_chunk = chunk_tokens * vocab * 4
    outputs_bytes = tokens * dim * 4 + vocab * dim * 4  # d_hidden, d_weight (float32)
    temporaries = 3 * chunk_tokens * dim * 4 + 64 * 1024  # per-row vectors, rounding
    assert extra <= outputs_bytes + logits_chunk + temporaries, (extra, logits_chunk)
    assert extra < outputs_bytes + 2 * logits_chunk
    del outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", VARIANTS)
def test_grad_scale_scales_the_gradients_not_the_loss(kernel, randn, device, dtype, name) -> None:
    hidden = randn(40, 16, dtype=dtype, device=device)
    weight = randn(70, 16, dtype=dtype, device=device)
    targets = make_targets(randn, 40, 70, 0.2, device)
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", name)(
        hidden, weight, targets, 16, grad_scale=1 / 37
    )
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    torch.testing.assert_close(loss.double(), want_loss, rtol=LOSS_RTOL[dtype], atol=1e-4)
    tolerance = GRAD_TOLERANCE[dtype]
    tolerance = {"rtol": tolerance["rtol"], "atol": tolerance["atol"] / 37}
    torch.testing.assert_close(d_hidden.double(), want_d_hidden / 37, **tolerance)
    torch.testing.assert_close(d_weight.double(), want_d_weight / 37, **tolerance)


@pytest.mark.parametrize("name", VARIANTS)
def test_float64_inputs_get_float64_math(kernel, randn, assert_rel_close, name) -> None:
    hidden, weight = randn(33, 12, dtype=torch.float64), randn(50, 12, dtype=torch.float64)
    targets = make_targets(randn, 33, 50, 0.2, "cpu")
    got = kernel("chunked_cross_entropy", name)(hidden, weight, targets, 10, grad_scale=0.5)
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    assert got[0].dtype == torch.float64
    for label, g, w in zip(
        ("loss", "d_hidden", "d_weight"),
        got,
        (want_loss, want_d_hidden * 0.5, want_d_weight * 0.5),
        strict=True,
    ):
        assert_rel_close(g, w, 1e-12, label)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_tokens", [300, 2000])  # several chunks; one chunk
def test_bfloat16_on_cuda_matches_float64_and_the_reference(
    kernel, randn, assert_rel_close, chunk_tokens
) -> None:
    """Relative error of the 16-bit-matmul path: 1e-2 against float64 autograd and against
    the float32 reference variant (the loss: 1e-4)."""
    hidden = randn(1000, 64, dtype=torch.bfloat16, device="cuda")
    weight = randn(5000, 64, dtype=torch.bfloat16, device="cuda", scale=0.3)
    targets = make_targets(randn, 1000, 5000, 0.1, "cuda")
    fast = kernel("chunked_cross_entropy", "torch")(hidden, weight, targets, chunk_tokens)
    plain = kernel("chunked_cross_entropy", "reference")(hidden, weight, targets, chunk_tokens)
    truth = reference(hidden, weight, targets)
    assert fast[1].dtype == torch.bfloat16
    assert fast[2].dtype == d_weight_dtype("torch", weight, 1000, chunk_tokens)
    for want, tol in ((truth, 1e-2), (plain, 1e-2)):
        assert_rel_close(fast[0], want[0], 1e-4, "loss")
        assert_rel_close(fast[1], want[1], tol, "d_hidden")
        assert_rel_close(fast[2], want[2], tol, "d_weight")


class _LiveStorages(TorchDispatchMode):
    """Under it, the most storages of each (dtype, bytes) alive at once among those its
    ops made, the dtype the first tensor's over it (checked after every op: a view keeps
    its storage alive, as the allocator sees it). Storage weak references are torch
    internals (as its CUDA graph trees use)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[int, tuple]] = {}  # data_ptr -> (weak ref, kind)
        self.most: Counter[tuple] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, _) in list(self.refs.items()):  # first: a freed pointer is reused
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self.refs[ptr]
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.refs:
                    kind = (tensor.dtype, storage.nbytes())
                    self.refs[storage.data_ptr()] = (storage._weak_ref(), kind)
        alive = Counter(kind for _, kind in self.refs.values())
        for kind, count in alive.items():
            self.most[kind] = max(self.most[kind], count)
        return out


@pytest.mark.parametrize("pieces", [1, 2])
def test_bfloat16_keeps_one_chunk_of_d_logits_alive_on_the_cpu(randn, pieces) -> None:
    """The 16-bit path's (chunk, vocab) d_logits: one chunk's at a time, the last one's
    freed before the next chunk's logits (until session 40 a per-piece view kept it into
    the next chunk: 1 GB more for Qwen 3.5's head at 2,048 tokens a chunk); CPU, where CI
    sees it, by storages alive rather than the allocator's peak."""
    from dataflow_kernels_torch.cross_entropy import chunked_cross_entropy

    tokens, dim, vocab, chunk_tokens = 512, 16, 1024, 64
    hidden = randn(tokens, dim, dtype=torch.bfloat16)
    weight = randn(vocab, dim, dtype=torch.bfloat16)
    table = list(weight.chunk(pieces)) if pieces > 1 else weight
    targets = make_targets(randn, tokens, vocab, 0.1, "cpu")
    live = _LiveStorages()
    with live:
        outputs = chunked_cross_entropy(hidden, table, targets, chunk_tokens)
    del outputs
    assert live.most[torch.bfloat16, chunk_tokens * vocab * 2] == 1  # d_logits
    assert live.most[torch.float32, chunk_tokens * vocab * 4] == 1  # logits


#: (tokens, dim, vocab, chunk tokens) of the 16-bit peak-memory tests: 32 MiB buffers
PEAK_SHAPE = (2048, 256, 32768, 256)


def _bf16_call_peak(kernel, randn, name: str) -> int:
    """The CUDA allocator's peak above what was in use, during one bfloat16 call of the
    ``name`` variant at ``PEAK_SHAPE`` (after a warm-up call: cuBLAS caches its workspace)."""
    tokens, dim, vocab, chunk_tokens = PEAK_SHAPE
    hidden = randn(tokens, dim, dtype=torch.bfloat16, device="cuda")
    weight = randn(vocab, dim, dtype=torch.bfloat16, device="cuda")
    targets = make_targets(randn, tokens, vocab, 0.1, "cuda")
    ce = kernel("chunked_cross_entropy", name)
    ce(hidden, weight, targets, chunk_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outputs = ce(hidden, weight, targets, chunk_tokens)
    torch.cuda.synchronize()
    del outputs
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
def test_bfloat16_holds_one_chunk_of_logits_at_a_time(kernel, randn) -> None:
    """Peak CUDA memory of the 16-bit path: outputs (d_weight the float32 accumulator),
    one chunk's float32 logits and its bfloat16 d_logits, one chunk's (vocab, dim) float32
    product unless ``addmm`` adds it into the accumulator in place, and (chunk, 1) row
    temporaries; a second chunk's d_logits would not fit (a view of the last chunk's kept
    it alive into the next until session 40: the device's memory snapshot showed two),
    nor a 16-bit copy of d_weight."""
    from dataflow_kernels_torch._support import has_kernel

    tokens, dim, vocab, chunk_tokens = PEAK_SHAPE
    extra = _bf16_call_peak(kernel, randn, "torch")
    logits_chunk = chunk_tokens * vocab * 4
    outputs_bytes = tokens * dim * 2 + vocab * dim * 4  # d_hidden; d_weight in float32
    in_place = has_kernel("aten::addmm.dtype", "cuda")
    accumulation = 0 if in_place else vocab * dim * 4  # one chunk's product
    temporaries = 64 * 1024
    bound = outputs_bytes + logits_chunk * 3 // 2 + accumulation + temporaries
    assert extra <= bound, (extra, bound)
    assert bound - extra < vocab * dim * 2  # no room left for a 16-bit d_weight beside


@pytest.mark.gpu
def test_triton_holds_one_chunk_of_16bit_logits_at_a_time(kernel, randn) -> None:
    """Peak CUDA memory of the Triton variant: outputs (d_weight the float32 accumulator,
    added into in place), one chunk's 16-bit logits (its d_logits, in place) and the
    per-token loss and log-sum-exp; a second chunk's logits would not fit."""
    pytest.importorskip("triton")
    tokens, dim, vocab, chunk_tokens = PEAK_SHAPE
    extra = _bf16_call_peak(kernel, randn, "triton")
    logits_chunk = chunk_tokens * vocab * 2
    outputs_bytes = tokens * dim * 2 + vocab * dim * 4  # d_hidden; d_weight in float32
    temporaries = tokens * 4 * 2 + 64 * 1024  # losses, log-sum-exp, rounding
    assert extra <= outputs_bytes + logits_chunk + temporaries, (extra, logits_chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [5001, 5120])  # padded to 5120; already a multiple of 128
@pytest.mark.parametrize("chunk_tokens", [300, 2000])  # several chunks; one chunk
def test_triton_variant_matches_float64_and_the_reference(
    kernel, randn, assert_rel_close, vocab, chunk_tokens
) -> None:
    """The padded-vocabulary, fused-softmax variant: bf16 logits (as under autocast), so
    the loss within 1e-3 and the gradients within 1e-2 of float64 autograd and of the
    float32 reference; ignored rows get no gradient; grad_scale scales the gradients."""
    pytest.importorskip("triton")
    hidden = randn(1000, 64, dtype=torch.bfloat16, device="cuda")
    weight = randn(vocab, 64, dtype=torch.bfloat16, device="cuda", scale=0.3)
    targets = make_targets(randn, 1000, vocab, 0.1, "cuda")
    fast = kernel("chunked_cross_entropy", "triton")(
        hidden, weight, targets, chunk_tokens, grad_scale=0.25
    )
    plain = kernel("chunked_cross_entropy", "reference")(
        hidden, weight, targets, chunk_tokens, grad_scale=0.25
    )
    truth = reference(hidden, weight, targets)
    assert fast[1].dtype == torch.bfloat16
    assert fast[2].dtype == d_weight_dtype("triton", weight, 1000, chunk_tokens)
    assert fast[2].shape == weight.shape
    assert_rel_close(fast[0], truth[0], 1e-3, "loss vs float64")
    assert_rel_close(fast[1], 0.25 * truth[1], 1e-2, "d_hidden vs float64")
    assert_rel_close(fast[2], 0.25 * truth[2], 1e-2, "d_weight vs float64")
    assert_rel_close(fast[1], plain[1], 1e-2, "d_hidden vs reference")
    assert_rel_close(fast[2], plain[2], 1e-2, "d_weight vs reference")
    assert fast[1][targets == IGNORE].abs().sum() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "dim", "vocab", "chunk_tokens"),
    [
        (37, 16, 101, 8),  # tiles of 21 rows: the last has 17
        (64, 48, 257, 10),
        (37, 16, 101, 37),  # one chunk: tiles are not needed, the one matmul writes d_weight
        (5, 8, 11, 1),  # tiles of 2 rows
    ],
)
@pytest.mark.parametrize("ignored", [0.0, 0.3])
def test_vocab_tiles_match_the_float64_reference(
    kernel, randn, monkeypatch, device, dtype, tokens, dim, vocab, chunk_tokens, ignored
) -> None:
    """d_weight made one vocabulary tile at a time (``vocab_tiles=True``): the same
    tolerances as the chunk-summed path, grad_scale on the gradients only."""
    from dataflow_kernels_torch import cross_entropy

    tiled = []
    by_tiles = cross_entropy._d_weight_by_tiles
    monkeypatch.setattr(
        cross_entropy,
        "_d_weight_by_tiles",
        lambda *args, **kw: tiled.append(args[6]) or by_tiles(*args, **kw),
    )
    hidden = randn(tokens, dim, dtype=dtype, device=device)
    weight = randn(vocab, dim, dtype=dtype, device=device)
    targets = make_targets(randn, tokens, vocab, ignored, device)
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", "torch")(
        hidden, weight, targets, chunk_tokens, grad_scale=0.5, vocab_tiles=True
    )
    want_loss, want_d_hidden, want_d_weight = reference(hidden, weight, targets)
    assert d_weight.shape == weight.shape and d_weight.dtype == weight.dtype
    # the 16-bit path made d_weight by tiles whenever there were several chunks
    several = dtype == torch.bfloat16 and chunk_tokens < tokens
    assert tiled == ([chunk_tokens * vocab // tokens] if several else [])
    rtol = LOSS_RTOL[dtype]
    torch.testing.assert_close(loss.double(), want_loss, rtol=rtol, atol=rtol)
    tolerance = GRAD_TOLERANCE[dtype]
    torch.testing.assert_close(d_hidden.double(), 0.5 * want_d_hidden, **tolerance)
    torch.testing.assert_close(d_weight.double(), 0.5 * want_d_weight, **tolerance)


def test_vocab_tile_rows_hold_about_one_chunk_of_logits() -> None:
    from dataflow_kernels_torch.cross_entropy import vocab_tile_rows

    # Llama 3 8B at 8 GiB: 8,192 tokens a round, chunks of 2,048, 128,256 rows
    rows = vocab_tile_rows(8192, 128256, 2048, 128)
    assert rows == 32000 and rows * 8192 <= 2048 * 128256
    assert vocab_tile_rows(37, 101, 8) == 21
    assert vocab_tile_rows(10, 50, 1, 128) == 128  # at least one multiple
    assert vocab_tile_rows(1000, 3, 1) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_vocab_tiles_keep_no_float32_vocabulary_table(kernel, randn, name) -> None:
    """The tiled head's CUDA peak: outputs, one chunk's logits (float32 and 16-bit on the
    torch path, 16-bit on the Triton one) and row temporaries; the float32 (vocab, dim)
    accumulator of the chunk-summed path would not fit under the bound."""
    if name == "triton":
        pytest.importorskip("triton")
    tokens, dim, vocab, chunk_tokens = 1024, 256, 16384, 128
    hidden = randn(tokens, dim, dtype=torch.bfloat16, device="cuda")
    weight = randn(vocab, dim, dtype=torch.bfloat16, device="cuda", scale=0.3)
    targets = make_targets(randn, tokens, vocab, 0.1, "cuda")
    ce = kernel("chunked_cross_entropy", name)
    ce(hidden, weight, targets, chunk_tokens, vocab_tiles=True)  # warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outputs = ce(hidden, weight, targets, chunk_tokens, vocab_tiles=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs_bytes = tokens * dim * 2 + vocab * dim * 2
    logits_chunk = chunk_tokens * vocab * 6  # float32 logits and their 16-bit d_logits
    temporaries = 256 * 1024
    assert extra <= outputs_bytes + logits_chunk + temporaries, extra
    assert vocab * dim * 4 > logits_chunk + temporaries  # the table would not have fit
    # The Triton variant's logits are 16-bit (its module doc); these are large (std ~5),
    # where one bfloat16 step moves a probability by up to 6 %: it is held to the
    # definition over the logits it has. (On the device on 2026-12-04, against the
    # float64 logits, 3 of the 16,384 rows of its d_weight were 0.074 off.)
    truth = reference(hidden, weight, targets, torch.bfloat16 if name == "triton" else None)
    torch.testing.assert_close(outputs[0].double(), truth[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outputs[2].double(), truth[2], rtol=2e-2, atol=2e-2)
    del outputs


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [5001, 5120])
def test_triton_vocab_tiles_match_float64_and_the_chunk_summed_path(
    kernel, randn, assert_rel_close, vocab
) -> None:
    """The Triton variant with ``vocab_tiles``: the padding columns stay out of every
    tile's softmax (vocab 5001 pads to 5120), ignored rows get no gradient."""
    pytest.importorskip("triton")
    hidden = randn(1000, 64, dtype=torch.bfloat16, device="cuda")
    weight = randn(vocab, 64, dtype=torch.bfloat16, device="cuda", scale=0.3)
    targets = make_targets(randn, 1000, vocab, 0.1, "cuda")
    ce = kernel("chunked_cross_entropy", "triton")
    tiled = ce(hidden, weight, targets, 300, grad_scale=0.25, vocab_tiles=True)
    summed = ce(hidden, weight, targets, 300, grad_scale=0.25)
    truth = reference(hidden, weight, targets)
    assert tiled[2].shape == weight.shape and tiled[2].dtype == torch.bfloat16
    assert_rel_close(tiled[0], truth[0], 1e-3, "loss vs float64")
    assert_rel_close(tiled[1], 0.25 * truth[1], 1e-2, "d_hidden vs float64")
    assert_rel_close(tiled[2], 0.25 * truth[2], 1e-2, "d_weight vs float64")
    assert_rel_close(tiled[2], summed[2], 1e-2, "d_weight vs the chunk-summed path")
    assert tiled[1][targets == IGNORE].abs().sum() == 0


# -- a vocabulary stored padded (``vocab=``) ------------------------------------------------


def padded_weight(randn, real: int, stored: int, dim: int, **kw) -> torch.Tensor:
    """A (stored, dim) weight whose rows past ``real`` are zero (a model's padding)."""
    weight = randn(stored, dim, **kw)
    weight[real:] = 0
    return weight


def check_padded(got, hidden, weight, targets, real, scale=1.0, tolerance=None, dtype=None) -> None:
    """``got`` equals the float64 reference of the first ``real`` rows alone; d_weight's
    padded rows are exactly zero; its dtype ``dtype`` (default weight's)."""
    want_loss, want_d_hidden, want_d_real = reference(hidden, weight[:real], targets)
    loss, d_hidden, d_weight = got
    assert d_weight.shape == weight.shape and d_weight.dtype == (dtype or weight.dtype)
    assert d_weight[real:].count_nonzero() == 0
    tolerance = tolerance or GRAD_TOLERANCE[hidden.dtype]
    torch.testing.assert_close(loss.double(), want_loss, rtol=LOSS_RTOL[hidden.dtype], atol=1e-4)
    torch.testing.assert_close(d_hidden.double(), scale * want_d_hidden, **tolerance)
    torch.testing.assert_close(d_weight[:real].double(), scale * want_d_real, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("real", "stored", "chunk_tokens"),
    [(101, 128, 8), (101, 128, 37), (257, 320, 10), (64, 64, 10)],  # the last: no padding
)
@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("name", VARIANTS)
def test_padded_rows_are_left_out_of_the_softmax(
    kernel, randn, device, dtype, real, stored, chunk_tokens, tiles, name
) -> None:
    """``vocab=real`` over a weight of ``stored`` rows: the loss and gradients of the real
    rows alone, by chunks or by vocabulary tiles, and no gradient in the padded rows."""
    hidden = randn(37, 16, dtype=dtype, device=device)
    weight = padded_weight(randn, real, stored, 16, dtype=dtype, device=device)
    targets = make_targets(randn, 37, real, 0.2, device)
    targets[0] = real - 1  # the last real row, beside the padding
    got = kernel("chunked_cross_entropy", name)(
        hidden, weight, targets, chunk_tokens, grad_scale=0.5, vocab_tiles=tiles, vocab=real
    )
    dtype = d_weight_dtype(name, weight, 37, chunk_tokens, tiles)
    check_padded(got, hidden, weight, targets, real, scale=0.5, dtype=dtype)


@pytest.mark.parametrize("name", VARIANTS)
def test_padded_rows_of_any_value_change_nothing(kernel, randn, name) -> None:
    """Whatever the padded rows hold, the result is the real rows' (a row that is not
    zero would otherwise have a logit in the softmax)."""
    hidden, weight = randn(20, 8, dtype=torch.bfloat16), randn(64, 8, dtype=torch.bfloat16)
    targets = make_targets(randn, 20, 50, 0.0, "cpu")
    got = kernel("chunked_cross_entropy", name)(hidden, weight, targets, 6, vocab=50)
    check_padded(got, hidden, weight, targets, 50, dtype=d_weight_dtype(name, weight, 20, 6))


@pytest.mark.parametrize("vocab", [0, 65, 2.0, True])
def test_a_vocab_outside_the_weight_is_named(kernel, randn, vocab) -> None:
    with pytest.raises(ValueError, match=r"vocab must be an int from 1 to weight's 64 rows"):
        kernel("chunked_cross_entropy", "torch")(
            randn(4, 8), randn(64, 8), torch.zeros(4, dtype=torch.int64), 2, vocab=vocab
        )


@pytest.mark.gpu
@pytest.mark.parametrize(("real", "stored"), [(5001, 5056), (50257, 50304), (5001, 5001)])
@pytest.mark.parametrize("chunk_tokens", [300, 2000])  # several chunks; one chunk
@pytest.mark.parametrize("tiles", [False, True])
def test_triton_variant_takes_a_weight_stored_padded(
    kernel, randn, monkeypatch, real, stored, chunk_tokens, tiles
) -> None:
    """A weight stored padded to a multiple of 64 (50,304: GPT-2's as nanoGPT pads it) is
    used as it is, with no per-call copy, and ``vocab=`` masks the columns past the real
    vocabulary: the real rows' loss and gradients (bf16 logits: the loss within 1e-3, the
    gradients 1e-2 of float64 autograd), the padded rows' gradient exactly zero. A weight
    of 5,001 rows (no multiple of 64) is still copied into a multiple of 128."""
    pytest.importorskip("triton")
    from dataflow_kernels_torch import triton_ce

    copies = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: copies.append(1) or cat(*a, **k))
    hidden = randn(1000, 64, dtype=torch.bfloat16, device="cuda")
    weight = padded_weight(randn, real, stored, 64, dtype=torch.bfloat16, device="cuda", scale=0.3)
    targets = make_targets(randn, 1000, real, 0.1, "cuda")
    targets[0] = real - 1
    fast = triton_ce.chunked_cross_entropy_triton(
        hidden, weight, targets, chunk_tokens, grad_scale=0.25, vocab_tiles=tiles, vocab=real
    )
    assert copies == ([] if stored % 64 == 0 else [1])
    truth = reference(hidden, weight[:real], targets)
    loss, d_hidden, d_weight = fast
    assert d_weight.shape == weight.shape and d_weight[real:].count_nonzero() == 0
    rel = lambda got, want: float((got.double() - want).norm() / want.norm())  # noqa: E731
    assert rel(loss, truth[0]) < 1e-3
    assert rel(d_hidden, 0.25 * truth[1]) < 1e-2
    assert rel(d_weight[:real], 0.25 * truth[2]) < 1e-2


PIECE_VARIANTS = [*VARIANTS, pytest.param("triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "chunk_tokens"),
    [((64, 64, 64), 10), ((128, 64), 37), ((128, 128), 1000), ((64, 64, 64, 64), 1)],
)
@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("real", [None, 250])
@pytest.mark.parametrize("name", PIECE_VARIANTS)
def test_a_weight_in_row_pieces_is_the_weight_they_make(
    kernel, randn, dtype, rows, chunk_tokens, tiles, real, name
) -> None:
    """The table in row pieces (``TrainConfig.vocab_pieces``): the loss and d_hidden of
    the joined table, and one d_weight per piece, each its rows of the joined table's
    (float64 autograd's tolerances; the float32 path within 1e-5 of the joined call);
    ``vocab=`` masks the last piece's padding as it masks the table's."""
    if name == "triton":
        pytest.importorskip("triton")
    device = "cuda" if name == "triton" else "cpu"
    if name == "triton" and dtype == torch.float32:
        pytest.skip("the Triton variant hands float32 to the torch one")
    stored, tokens, dim = sum(rows), 37, 16
    weight = randn(stored, dim, dtype=dtype, device=device, scale=0.5)
    vocab = stored if real is None else min(real, stored)
    if vocab < stored:
        weight[vocab:] = 0
    pieces = list(weight.split(list(rows)))
    hidden = randn(tokens, dim, dtype=dtype, device=device)
    targets = make_targets(randn, tokens, vocab, 0.2, device)
    keywords = {"grad_scale": 0.5, "vocab_tiles": tiles}
    if vocab < stored:
        keywords["vocab"] = vocab
    ce = kernel("chunked_cross_entropy", name)
    loss, d_hidden, d_pieces = ce(hidden, pieces, targets, chunk_tokens, **keywords)
    joined = ce(hidden, weight, targets, chunk_tokens, **keywords)
    assert isinstance(d_pieces, tuple) and len(d_pieces) == len(rows)
    for piece, d_piece in zip(pieces, d_pieces, strict=True):
        assert d_piece.shape == piece.shape and d_piece.dtype == joined[2].dtype
    d_weight = torch.cat(d_pieces)
    want_loss, want_d_hidden, want_d_weight = reference(hidden[:, :], weight[:vocab], targets)
    rtol = LOSS_RTOL[dtype] if name != "triton" else 1e-3
    torch.testing.assert_close(loss.double(), want_loss, rtol=rtol, atol=rtol)
    tolerance = GRAD_TOLERANCE[dtype]
    torch.testing.assert_close(d_hidden.double(), 0.5 * want_d_hidden, **tolerance)
    torch.testing.assert_close(d_weight[:vocab].double(), 0.5 * want_d_weight, **tolerance)
    assert d_weight[vocab:].count_nonzero() == 0
    if dtype == torch.float32:  # the same float32 math as the joined call
        for got, want in zip((loss, d_hidden, d_weight), joined, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_pieces_that_disagree_are_named(kernel, randn) -> None:
    with pytest.raises(ValueError, match="row pieces must agree"):
        kernel("chunked_cross_entropy", "torch")(
            randn(4, 8), [randn(6, 8), randn(6, 4)], torch.zeros(4, dtype=torch.int64), 2
        )


INTO_NAMES = ["torch", "reference", pytest.param("triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("name", INTO_NAMES)
def test_d_weight_added_into_the_callers_16bit_gradient(
    kernel, randn, assert_rel_close, pieces, name
) -> None:
    """``d_weight_into`` (a head adding into its own bf16 gradient, no float32 table) and
    ``scale_by`` (a device scale, 1 / scored tokens): the targets end as what they held
    plus ``scale * d_weight`` of float64 autograd, d_hidden scaled alike within 1e-2, the
    loss unscaled; the call returns the targets themselves. In pieces too (one target a
    piece). The added gradient's error is held to what rounding the running sum to bf16
    once a chunk loses by itself (each chunk's exact float64 share added, rounded, in
    turn: its ``yardstick``): at most twice that, plus 1e-2 for the bf16 matmuls."""
    device = "cuda" if name == "triton" else "cpu"
    if name == "triton":
        pytest.importorskip("triton")
    tokens, dim, vocab, chunk = 300, 64, 512, 64
    hidden = randn(tokens, dim, dtype=torch.bfloat16, device=device)
    weight = randn(vocab, dim, dtype=torch.bfloat16, device=device, scale=0.3)
    targets = make_targets(randn, tokens, vocab, 0.1, device)
    given = weight.chunk(pieces) if pieces > 1 else weight
    # what earlier rounds left there: of the size of one round's gradient (adding a small
    # increment into a large bf16 value would lose it to the large value's rounding)
    before = randn(vocab, dim, dtype=torch.bfloat16, device=device, scale=0.01)
    into = [part.clone() for part in before.chunk(pieces)]
    scale = torch.tensor(1.0 / 270, device=device)
    loss, d_hidden, d_weight = kernel("chunked_cross_entropy", name)(
        hidden, given, targets, chunk, grad_scale=0.5,
        d_weight_into=into if pieces > 1 else into[0], scale_by=scale,
    )  # fmt: skip
    truth = reference(hidden, weight, targets)
    got = torch.cat(list(d_weight)) if pieces > 1 else d_weight
    assert all(a is b for a, b in zip(d_weight if pieces > 1 else [d_weight], into, strict=True))
    assert_rel_close(loss, truth[0], 1e-3, "loss")
    assert_rel_close(d_hidden, truth[1] * (0.5 / 270), 1e-2, "d_hidden")
    added, want = got.double() - before.double(), truth[2] * (0.5 / 270)
    running = before.double().cpu()
    for start in range(0, tokens, chunk):  # the per-chunk roundings alone
        share = reference(hidden[start : start + chunk], weight, targets[start : start + chunk])
        running = (running + share[2].cpu() * (0.5 / 270)).bfloat16().double()
    yardstick = ((running - before.double().cpu()) - want.cpu()).norm() / want.norm()
    error = (added - want).norm() / want.norm()
    assert error <= 2 * yardstick + 1e-2, (float(error), float(yardstick))


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_d_weight_into_that_does_not_match_the_weight_is_named(kernel, randn, name) -> None:
    hidden = randn(8, 16, dtype=torch.bfloat16)
    weight = randn(32, 16, dtype=torch.bfloat16)
    targets = make_targets(randn, 8, 32, 0.0, "cpu")
    ce = kernel("chunked_cross_entropy", name)
    with pytest.raises(ValueError, match="d_weight_into must be shaped"):
        ce(hidden, weight, targets, 4, d_weight_into=torch.zeros(32, 16))
    with pytest.raises(ValueError, match="scale_by must be a 0-d float32"):
        ce(
            hidden,
            weight,
            targets,
            4,
            d_weight_into=torch.zeros_like(weight),
            scale_by=torch.ones(1),
        )
    with pytest.raises(ValueError, match="not with vocab_tiles"):
        kernel("chunked_cross_entropy", "torch")(
            hidden, weight, targets, 4, vocab_tiles=True, d_weight_into=torch.zeros_like(weight)
        )
