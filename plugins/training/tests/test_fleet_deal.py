"""How a fleet deals the one-process stream: the rounds each member owns, the batches it
reads from a real (text) feed, the position a checkpoint keeps, and what a resume from
one of another split or of the old per-rank slices says. The fleets themselves, in real
processes, are in ``test_fleet.py`` and ``tests/chaos/test_fleet_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dataflow_feed_shards.opening import open_text
from dataflow_training.drive.fleet import DealtFeed, deal, stream_difference
from dataflow_training.drive.trainer import _resumed_position
from hypothesis import given
from hypothesis import strategies as st

BATCH, SEQ_LEN = 2, 8
#: the splits of four rounds a step: one process, 2 ranks, 3:1, three uneven ranks
SPLITS = [(4,), (2, 2), (3, 1), (1, 2, 1)]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_the_ranks_own_the_rounds_of_a_step_in_order(rounds):
    """Rank after rank, the owned rounds are 0..sum-1 once each, rank r's ``rounds[r]``."""
    owned = [deal(rounds, rank) for rank in range(len(rounds))]
    assert [r for one in owned for r in one] == list(range(sum(rounds)))
    assert [len(one) for one in owned] == list(rounds)


def test_deal_examples_and_a_bad_rank():
    assert deal((3, 1), 0) == range(0, 3) and deal((3, 1), 1) == range(3, 4)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        deal((3, 1), 2)
    with pytest.raises(ValueError, match="rounds 3..4 are not of 0..3"):
        DealtFeed(None, 4, range(3, 5))


@pytest.fixture
def corpus(tmp_path: Path) -> str:
    """A text folder of 3 files, 700 tokens in all: a step of 4 rounds reads 64, so the
    epoch ends within a step during the test's 14 steps (the wrap is dealt too)."""
    folder = tmp_path / "text"
    folder.mkdir()
    for index, size in enumerate((300, 250, 150)):
        (folder / f"part{index}.txt").write_bytes(
            bytes((index * 37 + i) % 251 for i in range(size))
        )
    return str(folder)


def members(corpus: str, split: tuple[int, ...]) -> list[DealtFeed]:
    """One ``DealtFeed`` a rank of ``split``, each over its own feed (as each process has)."""
    return [
        DealtFeed(
            open_text(corpus, batch=BATCH, seq_len=SEQ_LEN, seed=3), sum(split), deal(split, r)
        )
        for r in range(len(split))
    ]


def fleet_step(fleet: list[DealtFeed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's rounds as the fleet holds them: rank 0's, then rank 1's, ..."""
    return [batch for member in fleet for batch in member.next_step()]


def assert_same_rounds(got, expected, where: str) -> None:
    assert len(got) == len(expected), where
    for (tokens, targets), (want_tokens, want_targets) in zip(got, expected, strict=True):
        assert torch.equal(tokens, want_tokens) and torch.equal(targets, want_targets), where


@pytest.mark.parametrize("split", SPLITS[1:], ids=lambda s: ":".join(map(str, s)))
def test_a_fleet_step_is_the_one_process_step(corpus, split):
    """Every step, the fleet's rounds in rank order are one process's rounds of the step,
    and every member's feed then stands where the one process's does (across the end of
    an epoch)."""
    (one,) = members(corpus, (4,))
    fleet = members(corpus, split)
    for step in range(14):
        assert_same_rounds(fleet_step(fleet), one.next_step(), f"step {step}")
        for rank, member in enumerate(fleet):
            assert member.feed.state() == one.feed.state(), f"step {step} rank {rank}"
    assert one.feed.state()["epoch"] >= 1, "the test's steps never crossed an epoch's end"


@pytest.mark.parametrize("before", SPLITS, ids=lambda s: ":".join(map(str, s)))
@pytest.mark.parametrize("after", SPLITS, ids=lambda s: ":".join(map(str, s)))
def test_a_position_saved_by_one_split_continues_under_another(corpus, before, after):
    """A run of split ``before`` saves rank 0's position after 5 steps (what its checkpoint
    keeps); members of split ``after`` restore it and read on: the steps are those of one
    process that never stopped, no round repeated or skipped."""
    (whole,) = members(corpus, (4,))
    expected = [whole.next_step() for _ in range(12)]
    first = members(corpus, before)
    for _ in range(5):
        fleet_step(first)
    saved = first[0].feed.state()
    resumed = members(corpus, after)
    for member in resumed:
        member.feed.restore(saved)
    for step in range(5, 12):
        assert_same_rounds(fleet_step(resumed), expected[step], f"step {step}")


def manifest(rounds: int = 4, fleet: dict | None = None) -> dict:
    found = {"step": 2, "train": {"rounds": rounds}, "feed": {"position": 128}}
    return found if fleet is None else {**found, "fleet": fleet}


def test_a_resume_continues_the_stream_at_any_split_of_the_same_rounds():
    path = Path("run/step_000002")
    assert _resumed_position(manifest(), 4, path) == {"position": 128}
    fleet = manifest(3, {"rounds": [3, 1]})
    assert _resumed_position(fleet, 4, path) == {"position": 128}
    assert _resumed_position({"step": 2, "train": {"rounds": 4}}, 4, path) is None


def test_a_resume_with_other_rounds_in_all_says_what_would_work():
    path = Path("run/step_000002")
    with pytest.raises(ValueError, match=r"step_000002: its steps ran 4 rounds \(--rounds 3,1\); "):
        _resumed_position(manifest(3, {"rounds": [3, 1]}), 2, path)
    with pytest.raises(ValueError, match="ran 4 rounds; this run's have 6: resume with 4 rounds"):
        _resumed_position(manifest(), 6, path)


def test_a_checkpoint_of_per_rank_slices_is_named():
    """A fleet checkpoint written before the fleet dealt one stream kept every member's
    own slice position (``fleet.feeds``): no position of the stream, said in one line."""
    old = manifest(3, {"rounds": [3, 1], "feeds": [{"world": 2}, {"world": 2}]})
    with pytest.raises(ValueError, match="step_000002 was written by a fleet whose members read"):
        _resumed_position(old, 4, Path("run/step_000002"))


def test_a_member_on_another_stream_is_named_by_what_differs():
    ours = {"spec": "embedded:python-stdlib", "dataset": {"sha256": "a"}, "position": 0}
    theirs = {**ours, "dataset": {"sha256": "b"}, "position": 512}
    assert stream_difference(theirs, ours) == "dataset, position 512 (rank 0: 0)"
    assert stream_difference(None, ours).startswith("state is None")
