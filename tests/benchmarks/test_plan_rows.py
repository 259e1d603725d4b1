"""benchmarks/plan_rows.py: every throughput row planned on the CPU from the H200
profile archives, beside the fastest stock row of compare.json."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks import place_llama3_8b, plan_rows

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_each_models_fastest_stock_row_is_the_baseline() -> None:
    stock = plan_rows.stock_tok_s(BENCHMARKS / "results" / "compare.json")
    # gpt2's rows from before compare.json named models count as gpt2_124m's
    assert stock["gpt2_124m"] == pytest.approx(547_313.56, rel=1e-6)
    assert {"l3_1b", "llama3_8b", "olmoe_1b_7b"} <= set(stock)


def test_every_row_parses_and_names_an_archive_that_exists() -> None:
    for name, argv in plan_rows.ROWS.items():
        args = place_llama3_8b.parser().parse_args(argv)
        assert args.profiles.exists(), name
        assert args.preset.split("_")[0] in name or args.preset in name


def test_a_row_planned_and_placed_and_its_ratio_to_stock() -> None:
    """gpt2_124m at 4 GiB (16 x 32 rounds: no re-derivation, every task profiled): the
    placed step, and the stock ratio as tokens / stock tok/s / step."""
    name = "gpt2_124m 4 GiB, 16 x 32"
    row = plan_rows.planned(name, plan_rows.ROWS[name], {"gpt2_124m": 500_000.0})
    assert row["error"] is None and row["stand_ins"] == 0
    assert row["placed_s"] == pytest.approx(row["planned_s"], rel=0.02)
    assert row["rederived_whole"] == row["rederived_partial"] == 0
    assert row["tokens"] == 16 * 32 * 1024
    assert row["vs_stock"] == pytest.approx(row["tokens"] / 500_000.0 / row["placed_s"])
    table = plan_rows.table([row])
    assert f"| {name} | {row['planned_s']:.3f} |" in table


def test_a_row_that_cannot_be_planned_says_why() -> None:
    """gpt2_124m at 2 GiB in rounds of 64 x 1024 tokens: one block's backward needs 1.15 GiB
    beside the head's workspace, and no steady-state plan packs into one arena under
    1.17 GiB (the planner's error); at 1 GiB that workspace alone takes the budget (said
    before planning)."""
    rows = [
        plan_rows.planned(f"{budget}", [*plan_rows.GPT2, "--budget", budget, "--batch", "64"], {})
        for budget in ("2GiB", "1GiB")
    ]
    for row in rows:
        assert row["planned_s"] is None and row["placed_s"] is None and row["vs_stock"] is None
    assert "smallest budget that works is 1.17 GiB" in rows[0]["error"]
    assert "plans fit from 1.15 GiB" in rows[0]["error"]
    assert "task 'bwd_0_0_11', 1.15 GiB" in rows[0]["error"]
    assert "leaves no room beside the largest task workspace" in rows[1]["error"]
    assert "| 2GiB |  |  |  |" in plan_rows.table(rows)


def test_a_sharded_blocks_tasks_are_priced_as_shares_of_the_whole_blocks() -> None:
    """``--expert-shards`` on an archive profiled whole: each routed task is a share of
    its whole block's phase by the kit's work; the routing task and every shard make up
    the whole forward and backward; a shard's backward that makes its ``gate_up`` rows
    again is a larger share."""
    pytest.importorskip("dataflow_family_qwen3_5_moe")
    from dataflow_training.step.config import TrainConfig
    from dataflow_training.step.family import load_family
    from dataflow_training.step.lowering import lower

    family = load_family("qwen3_5_moe")
    train = TrainConfig(seq_len=8, batch=2)
    step = lower(family, "qwen3_5_moe_tiny", train, overrides={"expert_shards": 2}, recompute=[0])
    shares: dict[tuple[str, str], float] = {}
    for task in step.program.tasks:
        found = place_llama3_8b.routed_share(step, task)
        if task.kind in ("fwd", "efwd", "rec", "ebwd", "bwd"):
            assert found is not None and found[0].startswith("qwen3_5_moe."), task.id
            whole, share = found
            assert 0 < share < 1.5, task.id
            shares[task.params["layer"], task.kind] = share
            shares.setdefault((task.params["layer"], whole), 0.0)
            shares[task.params["layer"], whole] += share
        else:
            assert found is None, task.id
    for layer in ("0", "1"):
        kind = step.layout.layer(layer).kind
        assert shares[layer, f"qwen3_5_moe.{kind}.forward"] == pytest.approx(1.0)
    kept, rederived = (
        shares["1", f"qwen3_5_moe.{step.layout.layer('1').kind}.backward"],
        shares["0", f"qwen3_5_moe.{step.layout.layer('0').kind}.backward"],
    )
    assert kept == pytest.approx(1.0)
    assert rederived > kept
