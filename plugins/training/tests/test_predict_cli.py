"""``dataflow predict`` and ``dataflow measure`` on gpt2_tiny, on the CPU: one row per
cell, infeasible cells as rows that say why, the FLOPs against GPT-2's closed form, the
profile cache behind ``--measured``, and the one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

GRID = ("--preset", "gpt2_tiny", "--t-round", "32,48", "--seq-len", "16", "--tokens-step", "64")
ONE = ("--preset", "gpt2_tiny", "--t-round", "32", "--seq-len", "16", "--tokens-step", "64")


def _rows(path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_predict_prints_a_row_per_cell_and_says_why_a_cell_cannot_run(tmp_path) -> None:
    out = tmp_path / "p.json"
    result = invoke("predict", *GRID, "--budget", "1,0.00001", "--json", out)
    assert result.exit_code == 0, result.output
    rows = _rows(out)
    assert [(r["t_round"], r["budget_bytes"]) for r in rows] == [
        (32, 2**30),
        (32, int(0.00001 * 2**30)),
        (48, 2**30),
        (48, int(0.00001 * 2**30)),
    ]
    fits, small, uneven, _ = rows
    assert fits["feasible"] and fits["batch"] == 2 and fits["rounds"] == 2
    assert fits["tok_s"] == pytest.approx(64 / fits["step_s"])
    assert fits["fast_peak_bytes"] <= 2**30 and fits["recomputed_units"] == 0
    assert not small["feasible"] and "smallest budget that works" in small["reason"]
    assert not uneven["feasible"]
    assert uneven["reason"] == "tokens per step 64 is not a multiple of T_round 48"
    assert "infeasible: tokens per step 64" in result.stdout


def test_cells_planned_in_parallel_are_the_cells_planned_one_by_one(tmp_path) -> None:
    """``--jobs 2`` forks workers: the same rows in the same order (all but the planning
    time), an infeasible cell included."""
    rows = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"p{jobs}.json"
        result = invoke("predict", *GRID, "--budget", "1,0.00001", "--jobs", jobs, "--json", out)
        assert result.exit_code == 0, result.output
        rows[jobs] = [{k: v for k, v in r.items() if k != "planning_s"} for r in _rows(out)]
    assert len(rows["1"]) == 4 and rows["1"] == rows["2"]
    assert [r["feasible"] for r in rows["2"]] == [True, False, False, False]


def test_model_flops_follow_gpt2s_closed_form(tmp_path) -> None:
    """Per token: 6 x 12 n^2 per block for the matrix products (forward 2x, backward 4x),
    7 seq n per block for causal attention (forward 2, backward 5), and 6 V n for the
    head's three vocabulary products (the family's declared work, summed by hand)."""
    from dataflow_family_gpt2.presets import preset

    out = tmp_path / "p.json"
    assert invoke("predict", *GRID, "--budget", "1", "--json", out).exit_code == 0
    row = _rows(out)[0]
    c = preset("gpt2_tiny")
    n, seq, tokens = c.n_embd, 16, 64
    per_token = c.n_layer * (6 * (3 * n * n + n * n + 2 * n * 4 * n) + 7 * seq * n)
    per_token += 6 * c.vocab_size * n
    assert row["effective_tflops"] * 1e12 * row["step_s"] == pytest.approx(per_token * tokens)
    assert row["hardware_tflops"] == row["effective_tflops"]  # nothing recomputed


#: a device whose host link is slow next to its compute (user entry, --hw-file)
SLOW_LINK = """
[slowlink]
flops_per_us = { bfloat16 = 1e6 }
hbm_bytes_per_us = 1e5
h2d_bytes_per_us = 100.0
d2h_bytes_per_us = 100.0
"""


def test_a_tight_budget_is_met_by_recompute_and_not_without(tmp_path) -> None:
    out, off = tmp_path / "on.json", tmp_path / "off.json"
    hw = tmp_path / "hw.toml"
    hw.write_text(SLOW_LINK)
    grid = ("--preset", "gpt2_tiny", "--t-round", "64", "--seq-len", "16", "--tokens-step", "128")
    grid += ("--hw", "slowlink", "--hw-file", str(hw))
    assert invoke("predict", *grid, "--budget", "1", "--json", out).exit_code == 0
    peak = _rows(out)[0]["fast_peak_bytes"]
    budget = (
        f"{int(0.4 * peak)}B"  # (a steady-state plan keeps the weights: 0.5 needs no recompute)
    )
    assert invoke("predict", *grid, "--budget", budget, "--json", out).exit_code == 0
    assert (
        invoke("predict", *grid, "--budget", budget, "--no-recompute", "--json", off).exit_code == 0
    )
    on, alone = _rows(out)[0], _rows(off)[0]
    assert on["recomputed_units"] > 0 and alone["recomputed_units"] == 0
    assert on["step_s"] <= alone["step_s"]
    assert on["hardware_tflops"] > on["effective_tflops"]
    assert on["recompute_pct"] > 0


def test_measured_costs_come_from_the_profile_cache(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DATAFLOW_PROFILE_CACHE", str(cache))
    out = tmp_path / "m.json"
    args = ("predict", *ONE, "--budget", "1", "--measured")
    result = invoke(*args, "--device", "cpu", "--json", out)
    assert result.exit_code == 0, result.output
    entries = sorted(cache.glob("*.json"))
    assert entries and _rows(out)[0]["costs"] == "measured"
    stamps = [p.stat().st_mtime_ns for p in entries]
    assert invoke(*args, "--device", "cpu").exit_code == 0
    assert [p.stat().st_mtime_ns for p in sorted(cache.glob("*.json"))] == stamps  # all hits


def test_measure_runs_each_cell_beside_its_prediction(tmp_path) -> None:
    out = tmp_path / "fidelity.json"
    result = invoke(
        "measure", *ONE, "--budget", "1,0.00001",
        "--steps", "3", "--warmup", "1", "--device", "cpu", "--json", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run, small = _rows(out)
    for key in ("preset", "t_round", "seq_len", "budget_bytes", "predicted_step_s"):
        assert key in run
    assert len(run["steps_s"]) == 3 and run["warmup"] == 1
    assert len(run["losses"]) == 3 and all(abs(x - math.log(256)) < 1.0 for x in run["losses"])
    assert run["measured_step_s"] == pytest.approx(
        sorted(run["steps_s"][1:])[0] / 2 + sorted(run["steps_s"][1:])[1] / 2
    )
    assert run["ratio"] == pytest.approx(run["measured_step_s"] / run["predicted_step_s"])
    assert not small["feasible"] and small["reason"]
    assert run["resolver"] == small["resolver"] == "torch"  # --resolver auto on the CPU
    assert "ratio" in result.stdout


def test_measure_names_an_unknown_resolver_and_the_known_ones() -> None:
    result = invoke("measure", *ONE, "--budget", "1", "--device", "cpu", "--resolver", "jit")
    assert_one_line_error(result, 2, "--resolver", "'jit'", "torch-compiled")


def test_measure_plans_within_the_backing_and_tells_each_step(tmp_path) -> None:
    """``--backing`` is the slow budget the cell is planned under (as ``predict`` plans
    it), and each step's end is printed as it happens. The cell is priced by tasks
    measured on the device (``predict`` prices by the hardware entry)."""
    out = tmp_path / "fidelity.json"
    args = ("measure", *ONE, "--budget", "0.004", "--steps", "2", "--warmup", "1")
    result = invoke(*args, "--device", "cpu", "--backing", "0.1", "--json", out)
    assert result.exit_code == 0, result.output
    (row,) = _rows(out)
    assert row["feasible"] and row["backing_peak_bytes"] <= 0.1 * 2**30
    assert row["costs"] == "measured" and row["predicted_step_s"] > 0
    told = [line for line in result.stderr.splitlines() if "budget 4.1 MiB: " in line]
    assert "planned: " in told[0] and "step 1/2: " in told[1] and "step 2/2: " in told[2]
    # a backing too small even for the step's tokens (the weights and optimizer state may
    # be homed fast, 4 MiB holds them): a row that says why
    result = invoke(*args, "--device", "cpu", "--backing", "0.00000005", "--json", out)
    assert result.exit_code == 0, result.output
    (row,) = _rows(out)
    assert not row["feasible"] and "slow budget" in row["reason"]


@pytest.mark.parametrize(
    ("args", "culprits"),
    [
        (("--hw", "b300"), ("--hw", "b300", "h200")),
        (("--budget", "lots"), ("--budget", "lots")),
        (("--t-round", "0"), ("--t-round",)),
        (("--preset", "gpt2_huge"), ("--preset", "gpt2_huge")),
    ],
)
def test_bad_options_are_one_line(args, culprits) -> None:
    base = {"--preset": "gpt2_tiny", "--t-round": "32", "--seq-len": "16", "--budget": "1"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    flat = [x for pair in base.items() for x in pair]
    result = invoke("predict", *flat, "--tokens-step", "64")
    assert_one_line_error(result, 2, *culprits)


def test_measure_needs_a_measured_step(tmp_path) -> None:
    result = invoke("measure", *ONE, "--budget", "1", "--steps", "2", "--warmup", "2")
    assert_one_line_error(result, 2, "--warmup", "--steps")


def test_a_cell_that_runs_over_its_budget_is_a_row_that_says_so(tmp_path, monkeypatch) -> None:
    """The engine refuses a step whose allocator peak left the budget (CUDA); ``measure``
    reports that cell as a row and goes on with the grid."""
    from dataflow_training.drive.run import TrainingRun

    from dataflow import BudgetBreachError

    def breach(self, batches, lr=None):
        raise BudgetBreachError("the CUDA allocator's peak during load and run was 3 bytes")

    monkeypatch.setattr(TrainingRun, "step", breach)
    out = tmp_path / "fidelity.json"
    result = invoke("measure", *ONE, "--budget", "1,2", "--device", "cpu", "--json", out)
    assert result.exit_code == 0, result.output
    rows = _rows(out)
    assert len(rows) == 2
    for row in rows:
        assert not row["feasible"]
        assert row["reason"].startswith("ran over the budget: the CUDA allocator's peak")


def test_predict_ranks_prices_the_all_reduce_on_the_tables_link(tmp_path) -> None:
    """``--ranks 1,2,8``: a row per fleet size; each all-reduce of a gradient group takes
    the link's latency plus its bytes over the ring's algorithm bandwidth (busbw x n /
    (2 (n - 1)), summed here by hand over the step's gradients); exposed and hidden add
    up to it; efficiency is the plain step over the member's; fleet tok/s = n x a rank's."""
    from dataflow_training.plan.hardware import hardware

    out = tmp_path / "f.json"
    args = ("--budget", "1", "--ranks", "1,2,8", "--scope", "network", "--json", out)
    result = invoke("predict", *ONE, *args)
    assert result.exit_code == 0, result.output
    rows = _rows(out)
    assert [r["ranks"] for r in rows] == [1, 2, 8] and {r["scope"] for r in rows} == {"network"}
    h200 = hardware("h200")
    busbw = h200.allreduce_busbw_bytes_per_us["network"]
    latency = h200.allreduce_latency_us["network"]
    plain = _rows_of(tmp_path, "predict", *ONE, "--budget", "1")[0]
    for row in rows:
        n = row["ranks"]
        algbw = h200.hbm_bytes_per_us / 2 if n == 1 else busbw * n / (2 * (n - 1))
        assert row["collective_bw_gbps"] == pytest.approx(algbw / 1e3)
        groups, grad_bytes = row["allreduce_groups"], row["allreduce_gb"] * 1e9
        assert row["allreduce_s"] * 1e6 == pytest.approx(groups * latency + grad_bytes / algbw)
        assert row["allreduce_exposed_s"] + row["allreduce_hidden_s"] == pytest.approx(
            row["allreduce_s"]
        )
        assert row["single_step_s"] == pytest.approx(plain["step_s"])
        assert row["scaling_efficiency"] == pytest.approx(plain["step_s"] / row["step_s"])
        assert row["fleet_tok_s"] == pytest.approx(n * 64 / row["step_s"])
    # gpt2_tiny's gradient groups: the embedding (tied head), each block, the final norm
    assert rows[0]["allreduce_groups"] >= 3 and rows[0]["allreduce_gb"] > 0
    assert (
        "fleets predicted for hardware entry h200 (network)" in result.stdout
        and "scaling eff" in result.stdout
    )


def _rows_of(tmp_path, *args) -> list[dict]:
    out = tmp_path / "plain.json"
    assert invoke(*args, "--json", out).exit_code == 0
    return _rows(out)


def test_predict_ranks_takes_whole_numbers() -> None:
    result = invoke("predict", *ONE, "--budget", "1", "--ranks", "0,2")
    assert_one_line_error(result, 2, "--ranks")


def test_head_chunk_fits_a_quarter_of_the_budget() -> None:
    from dataflow_training.step.config import head_chunk_tokens

    vocab = 50257
    assert head_chunk_tokens(16 * 2**30, vocab) == 8192
    for budget in (8 * 2**30, 2**30, 64 * 2**20):
        chunk = head_chunk_tokens(budget, vocab)
        assert chunk * vocab * 6 <= budget // 4 < 2 * chunk * vocab * 6


def test_a_cells_head_chunk_follows_its_budget() -> None:
    """predict and measure size the head's chunk by the cell's budget: a 2 GiB cell of
    gpt2_124m at 16K tokens a round takes 1024-token chunks (8192 would be 2.5 GB of
    logits workspace beside a 2 GiB arena), a 16 GiB cell 8192."""
    from dataflow_training.plan.predict import Cell, train_config

    def chunk(budget_gib: int) -> int:
        cell = Cell("gpt2_124m", 16384, 1024, 65536, budget_gib * 2**30)
        return train_config(cell, vocab=50257).chunk_tokens

    assert chunk(16) == 8192
    assert chunk(2) == 1024


def test_optimizer_states_in_bf16_halve_their_bytes_in_the_plan(tmp_path) -> None:
    """``--optimizer-states bf16`` (predict and measure): the AdamW moments are bf16, so
    the step's optimizer state objects take half the bytes of fp32's, and every row says
    which it planned."""
    from dataflow_training.plan.predict import Cell, train_config
    from dataflow_training.step.config import STATE_DTYPES, optimizer_states
    from dataflow_training.step.family import load_family
    from dataflow_training.step.lowering import lower

    rows = {}
    for states in STATE_DTYPES:
        out = tmp_path / f"{states}.json"
        result = invoke(
            "predict", *ONE, "--budget", "1", "--optimizer-states", states, "--json", out
        )
        assert result.exit_code == 0, result.output
        (rows[states],) = _rows(out)
        assert rows[states]["optimizer_states"] == states
    cell = Cell("gpt2_tiny", 32, 16, 64, 2**30)
    sizes = {}
    for states in STATE_DTYPES:
        train = train_config(cell, "bf16", states=states)
        assert train.optimizer == optimizer_states(states)
        program = lower(load_family("gpt2"), "gpt2_tiny", train).program
        sizes[states] = sum(o.size_bytes for o in program.objects if o.id.startswith("O_"))
    assert sizes["fp32"] == 2 * sizes["bf16"] > 0
    measured = tmp_path / "m.json"
    result = invoke(
        "measure", *ONE, "--budget", "1", "--optimizer-states", "bf16", "--steps", "2",
        "--warmup", "1", "--device", "cpu", "--json", measured,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = _rows(measured)
    assert row["optimizer_states"] == "bf16" and math.isfinite(row["measured_step_s"])
    bad = invoke("predict", *ONE, "--budget", "1", "--optimizer-states", "fp8")
    assert_one_line_error(bad, 2, "--optimizer-states")


def test_predict_plans_only_what_trains(tmp_path) -> None:
    """``--lora`` and ``--freeze`` lower the step as ``dataflow train`` does: the rows say
    what trained, and the frozen step moves fewer bytes than full training (no gradient or
    optimizer state of a frozen field); ``--optimizer lion`` keeps one moment, not two."""
    from dataflow_training.plan.predict import Cell, Tuning, train_config
    from dataflow_training.step.family import load_family
    from dataflow_training.step.lora import LoraConfig
    from dataflow_training.step.lowering import lower

    tunings = {
        "full": ((), Tuning()),
        "lora": (("--lora", "4"), Tuning(lora=LoraConfig(4))),
        "frozen": (("--freeze", "embed", "--freeze", "layers.0"), Tuning(("embed", "layers.0"))),
        "lion": (("--optimizer", "lion"), Tuning(optimizer="lion")),
    }
    cell = Cell("gpt2_tiny", 32, 16, 64, 2**30)
    state = {}
    for name, (args, tuning) in tunings.items():
        out = tmp_path / f"{name}.json"
        result = invoke("predict", *ONE, "--budget", "1", *args, "--json", out)
        assert result.exit_code == 0, result.output
        (row,) = _rows(out)
        assert row["feasible"]
        assert (row.get("lora"), row.get("freeze"), row.get("optimizer")) == (
            tuning.lora and tuning.lora.rank,
            list(tuning.freeze) or None,
            None if tuning.optimizer == "adamw" else tuning.optimizer,
        )
        train = train_config(cell, "bf16", tuning=tuning)
        program = lower(load_family("gpt2"), "gpt2_tiny", train).program
        state[name] = sum(o.size_bytes for o in program.objects if o.id.startswith(("O_", "dW")))
    assert state["lora"] < state["frozen"] < state["full"]
    assert state["lion"] < state["full"]


@pytest.mark.parametrize(
    ("args", "code", "culprits"),
    [
        (("--lora-alpha", "8"), 2, ("--lora-alpha", "--lora")),
        (("--freeze", "nothing.here"), 1, ("--freeze nothing.here",)),
        (("--optimizer", "adam9"), 2, ("--optimizer", "adam9")),
        (("--lora", "4", "--lora-targets", "q_proj"), 1, ("--lora-targets q_proj",)),
    ],
)
def test_what_trains_is_checked_in_one_line(args, code, culprits) -> None:
    result = invoke("predict", *ONE, "--budget", "1", *args)
    assert_one_line_error(result, code, *culprits)
