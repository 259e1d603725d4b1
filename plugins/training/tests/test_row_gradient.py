"""An embedding's gradient as the rows of its tokens (``RowGradient``): the same gradient
as plain autograd's, and written into a gradient object exactly as the whole (vocab, dim)
table it replaces was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.kit.decoder import DecoderConfig
from dataflow_training.kit.decoder_math import DecoderEmbed
from dataflow_training.step.family import Env, RowGradient
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB, DIM = 11, 6


def _table(tokens: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the embedding's backward returned before: the whole table, summed by index_add_."""
    table = torch.zeros(VOCAB, DIM, dtype=dtype)
    table.index_add_(0, tokens.reshape(-1), d.reshape(-1, DIM).to(dtype))
    return table


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    seed=st.integers(0, 2**16),
)
def test_summed_rows_are_autograds_embedding_gradient(tokens: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(tokens)
    weight = torch.randn(VOCAB, DIM, dtype=torch.float64, generator=g, requires_grad=True)
    d = torch.randn(len(tokens), DIM, dtype=torch.float64, generator=g)
    (expected,) = torch.autograd.grad(F.embedding(ids, weight), weight, d)
    grad = RowGradient.summed(ids, d, (VOCAB, DIM), torch.float64)
    torch.testing.assert_close(grad.dense(), expected, rtol=1e-12, atol=1e-12)
    # every repeat of a row carries that row's whole gradient
    torch.testing.assert_close(grad.values, expected[grad.rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_added_and_copied_rows_write_what_the_whole_table_wrote(dtype: torch.dtype) -> None:
    """Into a gradient object of ``dtype``: round 0 copies, later rounds add; each row is
    summed in float32 and rounded once, bit for bit what ``copy_``/``add_`` of the float32
    table gave (tokens repeat, and some rows get none)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([[3, 1, 3, 7], [1, 3, 0, 7]])
    rounds = [torch.randn(2, 4, DIM, generator=g).to(dtype) for _ in range(3)]
    old = torch.full((VOCAB, DIM), float("nan"), dtype=dtype)
    new = old.clone()
    for index, d in enumerate(rounds):
        table = _table(tokens, d, torch.float32)
        grad = RowGradient.summed(tokens, d.reshape(-1, DIM), (VOCAB, DIM), torch.float32)
        if index == 0:
            old.copy_(table)
            grad.copy_into(new)
        else:
            old.add_(table)
            grad.add_into(new)
        assert torch.equal(new, old), index


def test_the_decoder_embedding_returns_its_tokens_rows() -> None:
    config = DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=g)
    d = torch.randn(2, 5, DIM, generator=g, dtype=torch.bfloat16)
    grads = DecoderEmbed().backward(config, tokens, d, Env({}))
    (grad,) = grads.values()
    # the stored table's shape: VOCAB rows rounded up to vocab_multiple (64)
    assert isinstance(grad, RowGradient) and grad.shape == (64, DIM)
    assert grad.values.dtype == torch.float32  # summed in float32, not in bfloat16
    assert grad.rows.shape == (10,)  # the round's tokens: the same shape every step
    dense = grad.dense()
    assert dense[VOCAB:].count_nonzero() == 0
    torch.testing.assert_close(dense[:VOCAB], _table(tokens, d, torch.float32), rtol=0, atol=0)


@pytest.mark.gpu
def test_row_pieces_are_written_inside_a_cuda_graph() -> None:
    """The embedding's backward into a table stored in row pieces (``vocab_pieces``) is
    captured in a CUDA graph: no write reads an index back to the host (session 42: a
    0-dim index tensor did, and every piece-stored embbwd ran dispatched). Replayed with
    new tokens, each piece holds what the whole table's rows from ``first`` on hold."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab, dim, pieces = 256, 32, 4
    rows = vocab // pieces
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 64), device="cuda", generator=g)
    d = torch.randn(2 * 64, dim, device="cuda", generator=g).to(torch.bfloat16)
    targets = [torch.zeros(rows, dim, device="cuda", dtype=torch.bfloat16) for _ in range(pieces)]

    def backward() -> None:
        grad = RowGradient.summed(tokens, d, (vocab, dim), torch.float32)
        for index, target in enumerate(targets):
            grad.copy_into(target, index * rows)
            grad.add_into(target, index * rows)  # the round after: twice the gradient

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as graphs ask
        backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backward()
    tokens.copy_(torch.randint(0, vocab, tokens.shape, device="cuda", generator=g))
    d.copy_(torch.randn(d.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    whole = torch.zeros(vocab, dim, device="cuda")
    whole.index_add_(0, tokens.reshape(-1), d.float())
    twice = (whole.to(torch.bfloat16).float() + whole).to(torch.bfloat16)
    # atomics sum the repeats in any order: a row may round one bf16 step apart, twice
    torch.testing.assert_close(torch.cat(targets), twice, rtol=8e-3, atol=1e-3)
