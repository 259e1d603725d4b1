"""``Segments``: built from cu_seqlens and from HF's attention_mask/position_ids, their
next-token targets, their one-line errors, and the rotary tables at their positions.

(The attention over them is held to transformers in families/llama3/tests/
test_llama3_segments.py, and to a masked softmax in kernels/torch/tests/
test_attention_segments.py. RoPE is relative, so a whole sequence's offset cannot show in
its logits: the tables are checked here, row by row.)"""

from __future__ import annotations

import pytest
import torch
from dataflow_training.kit import IGNORE_INDEX, Llama3Scaling, Rope, Segments
from dataflow_training.kit.rotary import tables


def test_cu_seqlens_pack_several_sequences_a_row_and_pad_the_rest() -> None:
    segments = Segments.from_cu_seqlens([0, 3, 6, 10], batch=2, seq_len=6, offsets=[0, 4, 0])
    assert segments.ids.tolist() == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, -1, -1]]
    assert segments.positions.tolist() == [[0, 1, 2, 4, 5, 6], [0, 1, 2, 3, 0, 0]]


def test_a_sequence_may_not_cross_a_row() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 \(tokens 3..7\) crosses the end of a row"):
        Segments.from_cu_seqlens([0, 3, 8], batch=2, seq_len=6)


def test_cu_seqlens_in_one_row_each() -> None:
    segments = Segments.from_cu_seqlens([0, 3, 6, 8], batch=2, seq_len=6, offsets=[0, 4, 1])
    assert segments.ids.tolist() == [[0, 0, 0, 1, 1, 1], [2, 2, -1, -1, -1, -1]]
    assert segments.positions.tolist() == [[0, 1, 2, 4, 5, 6], [1, 2, 0, 0, 0, 0]]
    assert segments.padded.sum() == 4


@pytest.mark.parametrize(
    ("cu_seqlens", "options", "message"),
    [
        ([1, 3], {}, "cu_seqlens must start at 0"),
        ([0, 4, 2], {}, "cu_seqlens must not decrease"),
        ([0, 13], {}, r"end at most at batch \* seq_len = 12"),
        ([0.0, 3.0], {}, "cu_seqlens must be a 1-d integer tensor"),
        ([0, 3], {"offsets": [0, 1]}, "offsets must be 1 positions >= 0"),
        ([0, 3], {"offsets": [-1]}, "offsets must be 1 positions >= 0"),
    ],
)
def test_bad_cu_seqlens_are_named(cu_seqlens, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        Segments.from_cu_seqlens(cu_seqlens, batch=2, seq_len=6, **options)


def test_an_attention_mask_pads_left_or_right_and_offsets_positions() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    segments = Segments.from_attention_mask(mask, offsets=[0, 7])
    assert segments.ids.tolist() == [[0, 0, 0, -1], [-1, -1, 0, 0]]
    assert segments.positions.tolist() == [[0, 1, 2, 0], [0, 0, 7, 8]]


def test_hf_position_ids_restarting_start_new_sequences() -> None:
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    position_ids = torch.tensor([[0, 1, 0, 1, 2, 0]])
    segments = Segments.from_attention_mask(mask, position_ids=position_ids)
    assert segments.ids.tolist() == [[1, 1, 2, 2, 2, -1]]
    assert segments.positions.tolist() == [[0, 1, 0, 1, 2, 0]]


@pytest.mark.parametrize(
    ("mask", "options", "message"),
    [
        (torch.tensor([[1, 2]]), {}, "attention_mask must hold only 0 and 1"),
        (torch.tensor([1, 1]), {}, "attention_mask must be a 2-d integer tensor"),
        (torch.ones(1, 2), {}, "attention_mask must be a 2-d integer tensor"),
        (torch.ones(1, 2, dtype=torch.int64), {"offsets": [1, 2]}, "offsets must be 1 positions"),
        (
            torch.ones(1, 2, dtype=torch.int64),
            {"position_ids": torch.zeros(1, 3, dtype=torch.int64)},
            r"position_ids \(1, 3\) must match attention_mask \(1, 2\)",
        ),
        (
            torch.ones(1, 2, dtype=torch.int64),
            {"position_ids": torch.zeros(1, 2, dtype=torch.int64), "offsets": [0]},
            "give position_ids or offsets, not both",
        ),
    ],
)
def test_a_bad_attention_mask_is_named(mask, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        Segments.from_attention_mask(mask, **options)


def test_bad_fields_are_named() -> None:
    ids = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Segments.ids must be an int64 \(batch, seq\) tensor"):
        Segments(ids.int(), ids)
    with pytest.raises(ValueError, match=r"Segments.ids must be >= -1"):
        Segments(ids - 2, ids)
    with pytest.raises(ValueError, match=r"Segments.positions \(1, 2\) on cpu must match ids"):
        Segments(ids, ids[:, :2])
    with pytest.raises(ValueError, match="Segments.positions must be >= 0"):
        Segments(ids, ids - 1)


def test_targets_stay_inside_each_sequence() -> None:
    segments = Segments.from_cu_seqlens([0, 2, 5], batch=1, seq_len=6)
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    x = IGNORE_INDEX
    assert segments.targets(tokens).tolist() == [[11, x, 13, 14, x, x]]
    with pytest.raises(ValueError, match=r"tokens \(1, 5\) must match the segments \(1, 6\)"):
        segments.targets(tokens[:, :5])


@pytest.mark.parametrize("scaling", [None, Llama3Scaling(factor=4.0, original_max_position=16)])
def test_rotary_tables_at_positions_are_the_tables_rows(scaling) -> None:
    """Each token's (cos, sin) is the row of its position in the tables of 0 .. n - 1."""
    config = type("C", (), {"head_dim": 8, "rope_theta": 500.0, "rope_scaling": scaling})()
    positions = torch.tensor([[0, 1, 2, 9, 10], [4, 0, 1, 2, 3]])
    like = torch.zeros(2, 5, 3, 8, dtype=torch.float64)
    cos, sin = Rope().tables(config, like, positions)
    full_cos, full_sin = tables(11, 8, 500.0, scaling=scaling, dtype=torch.float64)
    assert cos.shape == (2, 1, 5, 8)
    torch.testing.assert_close(cos[:, 0], full_cos[positions], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], full_sin[positions], rtol=0, atol=0)


def test_an_attention_part_that_takes_no_segments_refuses_them() -> None:
    """A block whose attention is not ``SelfAttention`` (GPT-2's fused one here) says so
    rather than attending across the batch's sequences."""
    from dataflow_training.kit import Block, Env, FusedQKVAttention
    from dataflow_training.testing import plain_ops

    # plain ops: the refusal runs no op, and the training plugin's isolated session has no
    # kernel package to load the registered ones from
    env = Env(plain_ops(), segments=Segments.dense(1, 4))
    with pytest.raises(ValueError, match="FusedQKVAttention does not take segments"):
        Block(FusedQKVAttention())._segments(env)


def test_rows_of_consecutive_documents_from_their_starts() -> None:
    from dataflow_training.kit import packed_documents

    starts = torch.tensor(
        [
            [False, False, True, False, False, True, True, False, False],
            [True, False, False, False, False, False, False, False, True],
        ]
    )
    tokens = torch.arange(16).view(2, 8)
    targets = tokens + 1
    tokens, kept, segments = packed_documents(tokens, targets, starts)
    # the row's first tokens (a document the row cut) from 0; each document from its start
    assert segments.ids.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]]
    assert segments.positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    # no target across a boundary: the token before each start predicts nothing (the
    # last column's start is the token after the row's)
    ignored = kept == IGNORE_INDEX
    assert ignored.tolist() == [
        [False, True, False, False, True, True, False, False],
        [False, False, False, False, False, False, False, True],
    ]
    assert torch.equal(kept[~ignored], targets[~ignored])
    with pytest.raises(ValueError, match=r"starts \(2, 8\) must be \(batch, seq_len \+ 1\)"):
        packed_documents(tokens, targets, starts[:, :-1])
    with pytest.raises(ValueError, match="starts must be a \\(batch, seq\\) bool tensor"):
        Segments.from_starts(torch.zeros(2, 3, dtype=torch.int64))
