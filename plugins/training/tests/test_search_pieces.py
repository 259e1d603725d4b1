"""The step search chooses the vocabulary tables' row pieces (``plan.search``,
``TrainConfig.vocab_pieces``) and the experts' shards (``--expert-shards``): on llama3_tiny with an 8,192-token vocabulary, whose
table's AdamW update (weights, gradient and two moments in float32: 8 MiB) is the step's
largest task, a budget below it gets the fewest pieces whose update fits, one above it
keeps the table whole, a pinned count is the run's, and counts the step refuses are not
tried; olmoe_tiny's experts are sharded where their update does not fit. Priced by a hardware entry's declared costs (measured CPU timings move from run to
run), except the command line's run."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from dataflow.testing import invoke

pytest.importorskip("dataflow_family_llama3")

from dataflow_training.drive.options import TrainOptions  # noqa: E402
from dataflow_training.drive.step_search import (  # noqa: E402
    SEARCH_CACHE_ENV,
    SEARCHED,
    NothingFits,
    search_for,
)
from dataflow_training.plan.hardware import hardware  # noqa: E402
from dataflow_training.plan.search import Pricing, Searcher, task_floor_bytes  # noqa: E402
from dataflow_training.plan.shapes import Shape, same_tasks  # noqa: E402
from dataflow_training.step.family import load_family  # noqa: E402

MiB = 2**20
VOCAB = 8192  # x 64 dims x 4 bytes: a 2 MiB table, its update 8 MiB


@pytest.fixture(autouse=True)
def _no_search_cache(monkeypatch):
    monkeypatch.setenv(SEARCH_CACHE_ENV, "1")


@pytest.fixture(scope="module")
def family():
    return load_family("llama3")


@pytest.fixture(scope="module")
def declared():
    entry = hardware("h200")
    return Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())


def options(tmp_path: Path, budget: int, vocab: int = VOCAB, **given) -> TrainOptions:
    free = [name for name in SEARCHED if name not in given]
    return TrainOptions(
        family="llama3",
        preset="llama3_tiny",
        steps=1,
        out=tmp_path,
        budget_bytes=budget,
        overrides={"vocab_size": vocab},
        **given,
        search=free,
    )


def largest_task(family, o: TrainOptions, pieces: int, pricing: Pricing) -> tuple[int, int]:
    """(the largest task's bytes, the arena) of ``o``'s one-round step in ``pieces``."""
    searcher = Searcher(
        family, o.preset, o.train_config(family), budget_bytes=o.budget_bytes,
        overrides=o.overrides, pricing=pricing,
    )  # fmt: skip
    shape = Shape(64, 1, 1, "round", "end", False, "torch", pieces)
    one = searcher.lowered(same_tasks(shape, 1), rewrite=False)
    return task_floor_bytes(one.step.program), searcher.arena(shape)


def test_a_table_whose_update_the_budget_cannot_hold_is_cut(family, declared, tmp_path) -> None:
    o = options(tmp_path, 6 * MiB)
    whole, arena = largest_task(family, o, 1, declared)
    assert whole > arena  # the table's update alone: no plan keeps it whole
    chosen, found = search_for(o, family, host_bytes=2**40, pricing=declared)
    assert chosen.vocab_pieces == 2 and found.chosen.shape.vocab_pieces == 2
    assert largest_task(family, o, 2, declared)[0] <= arena
    assert "vocab in 2 pieces" in found.line()
    # the table kept whole (pinned): nothing fits, and the line names a budget that would
    pinned = r"a --budget of at least (8|9)(\.\d+)? MiB, .*--vocab-pieces 2 \(a smaller"
    with pytest.raises(NothingFits, match=pinned):
        search_for(options(tmp_path, 6 * MiB, vocab_pieces=1), family, host_bytes=2**40,
                   pricing=declared)  # fmt: skip


def test_a_budget_that_holds_the_table_keeps_it_whole(family, declared, tmp_path) -> None:
    """Two pieces are tried for the chosen shape (the table's update is its largest task)
    and plan slower: the whole table stays."""
    chosen, found = search_for(options(tmp_path, 16 * MiB), family, host_bytes=2**40,
                               pricing=declared)  # fmt: skip
    assert chosen.vocab_pieces == 1
    two = [t for t in found.tried if t.shape.vocab_pieces == 2 and t.reason is None]
    assert two and all(t.tok_s < found.chosen.tok_s for t in two)


def test_a_pinned_count_is_the_run_s(family, declared, tmp_path) -> None:
    chosen, found = search_for(options(tmp_path, 16 * MiB, vocab_pieces=4), family,
                               host_bytes=2**40, pricing=declared)  # fmt: skip
    assert chosen.vocab_pieces == 4
    assert {t.shape.vocab_pieces for t in found.tried} == {4}


@pytest.mark.parametrize(
    "o",
    [
        {"vocab": VOCAB + 1},  # an odd vocabulary: no count divides it
        {"optimizer": "adafactor"},  # factored moments: not element by element
    ],
    ids=["odd-vocabulary", "adafactor"],
)
def test_pieces_the_step_refuses_are_not_tried(family, declared, tmp_path, o) -> None:
    found = None
    try:
        chosen, found = search_for(options(tmp_path, 6 * MiB, **o), family, host_bytes=2**40,
                                   pricing=declared)  # fmt: skip
    except NothingFits as exc:  # the whole table's update does not fit: said, not raised
        assert "--budget of at least" in str(exc)
    else:
        assert chosen.vocab_pieces == 1
    if found is not None:
        assert {t.shape.vocab_pieces for t in found.tried} == {1}


def test_dataflow_train_chooses_pieces_and_resumes_with_them(tmp_path) -> None:
    out = tmp_path / "run"
    common = ["--preset", "llama3_tiny", "--vocab-size", str(VOCAB), "--device", "cpu"]
    first = invoke("train", *common, "--budget", "6MiB", "--steps", "2", "--out", out)
    assert first.exit_code == 0, first.output
    assert "vocab in 2 pieces" in next(x for x in first.output.splitlines() if "search:" in x)
    manifest = json.loads(next(out.glob("**/manifest.json")).read_text())
    assert manifest["options"]["vocab_pieces"] == 2
    resumed = invoke("train", "--resume", "auto", "--steps", "3", "--out", out)
    assert resumed.exit_code == 0, resumed.output
    assert "search:" not in resumed.output  # the run's shape, pieces included
    assert "step 3/3" in resumed.output


def test_experts_whose_update_the_budget_cannot_hold_are_sharded(declared, tmp_path) -> None:
    """olmoe_tiny's experts (0.75 MiB of float32 update a layer) at 512 KiB: two shards,
    a model override the run's options carry; the search's line says so."""
    olmoe = load_family("olmoe")
    o = TrainOptions(family="olmoe", preset="olmoe_tiny", steps=1, out=tmp_path,
                     budget_bytes=512 * 1024, search=SEARCHED)  # fmt: skip
    chosen, found = search_for(o, olmoe, host_bytes=2**40, pricing=declared)
    assert chosen.overrides == {"expert_shards": 2}
    assert "experts in 2 shards" in found.line()
    whole, arena = largest_task(olmoe, attrs.evolve(o, overrides={"expert_shards": 1}), 1, declared)
    assert whole > arena
    # a model without experts: none tried
    llama = load_family("llama3")
    _, plain = search_for(options(tmp_path, 16 * MiB), llama, host_bytes=2**40, pricing=declared)
    assert {t.shape.expert_shards for t in plain.tried} == {0}


def test_expert_shards_on_the_command_line(tmp_path) -> None:
    """``--expert-shards`` is checked against the model, the run keeps it, and a resume
    may give another count."""
    out = tmp_path / "run"
    common = ["--preset", "olmoe_tiny", "--device", "cpu", "--budget", "1MiB", "--out", out]
    first = invoke("train", *common, "--expert-shards", "4", "--steps", "1")
    assert first.exit_code == 0, first.output
    assert "experts in 4 shards" in first.output
    manifest = json.loads(next(out.glob("**/manifest.json")).read_text())
    assert manifest["overrides"] == {"expert_shards": 4}
    # another count on resume: the optimizer state is cut again (TrainingRun.restore)
    again = invoke(
        "train", "--resume", "auto", "--expert-shards", "2", "--steps", "2", "--out", out
    )
    assert again.exit_code == 0, again.output
    assert "step 2/2" in again.output
    manifest = json.loads(next(out.glob("step_000002/manifest.json")).read_text())
    assert manifest["overrides"] == {"expert_shards": 2}
    for preset, shards, said in [("llama3_tiny", "2", "has no routed experts"),
                                 ("olmoe_tiny", "3", "3 does not divide the 8 experts")]:  # fmt: skip
        refused = invoke("train", "--preset", preset, "--expert-shards", shards, "--steps", "1",
                         "--device", "cpu", "--out", tmp_path / preset)  # fmt: skip
        assert refused.exit_code == 2 and said in refused.output, refused.output
        assert "Traceback" not in refused.output


def test_predict_pins_the_pieces_as_train_does(tmp_path) -> None:
    """``dataflow predict --vocab-pieces`` / ``--expert-shards``: pinned in its search,
    and the step of each cell of a grid (``--t-round``)."""
    searched = invoke("predict", "--preset", "olmoe_tiny", "--budget", "0.0005", "--hw", "h200",
                      "--dtype", "fp32", "--vocab-pieces", "2", "--expert-shards", "4")  # fmt: skip
    assert searched.exit_code == 0, searched.output
    line = next(x for x in searched.output.splitlines() if x.startswith("search:"))
    assert line.count("vocab in 2 pieces, experts in 4 shards") == 2, line  # chosen, runner-up
    grid = invoke("predict", "--preset", "olmoe_tiny", "--budget", "0.0005", "--hw", "h200",
                  "--dtype", "fp32", "--t-round", "128", "--seq-len", "128", "--tokens-step",
                  "512", "--vocab-pieces", "2", "--expert-shards", "4", "--json",
                  tmp_path / "grid.json")  # fmt: skip
    assert grid.exit_code == 0, grid.output
    (row,) = json.loads((tmp_path / "grid.json").read_text())["rows"]
    assert row["vocab_pieces"] == 2 and row["overrides"] == {"expert_shards": 4}
    assert row["tok_s"] > 0
