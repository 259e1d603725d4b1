"""benchmarks/compare.py (issue 13's throughput comparison) on a CPU at a tiny size, so its
code paths cannot rot: every row kind, the JSON document, --append, --table-only and the
table of docs/throughput.md; and its measuring helpers against hand-computed answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks import compare  # noqa: E402
from benchmarks.harness import compare_dataflow, compare_doc, measure, stock  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

#: the per-row fields issue 13 names, in its order, with issue 15's model and the note
ISSUE_FIELDS = [
    "model",
    "engine",
    "dtype",
    "budget_bytes",
    "seq_len",
    "mode",
    "batch",
    "tokens_per_step",
    "tok_s",
    "mfu",
    "allocator_peak_bytes",
    "moved_bytes_per_step",
    "compute_idle_pct",
    "predicted_step_s",
    "measured_step_s",
    "ratio_to_fastest_stock",
    "note",
]
SHAPE = [
    *("--preset", "gpt2_tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1"),
    *("--batches", "2,1", "--dataflow-batches", "2,1", "--min-tokens", "128"),
]
#: on the CPU, torch.compile with its "eager" backend: dynamo's path without inductor
TINY = [*SHAPE, "--device", "cpu", "--compile-backend", "eager"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The stock, dataflow and deepspeed rows in a child process, as a user runs it."""
    folder = tmp_path_factory.mktemp("compare")
    page = folder / "throughput.md"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    out = folder / "compare.json"
    command = [
        *(sys.executable, "-m", "benchmarks.compare"),
        *TINY,
        *("--stock-dtypes", "bf16", "--budgets", "4MiB,1KiB"),
        *("--out", str(out), "--doc", str(page)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, page


def by_key(doc):
    return {compare_doc.row_key(row): row for row in doc["rows"]}


def test_every_row_kind_is_written_with_exactly_the_issues_fields(first_run) -> None:
    out, _ = first_run
    doc = json.loads(out.read_text())
    rows = by_key(doc)
    eager = rows["gpt2_tiny|pytorch eager|bf16|None|32|full"]
    compiled = rows["gpt2_tiny|pytorch compile|bf16|None|32|full"]
    fastest_engine = "eager" if eager["tok_s"] > compiled["tok_s"] else "compile"
    assert (
        set(rows)
        == {
            "gpt2_tiny|pytorch eager|bf16|None|32|full",
            "gpt2_tiny|pytorch compile|bf16|None|32|full",
            f"gpt2_tiny|pytorch {fastest_engine} + checkpointing|bf16|None|32|full",  # follows the fastest
            "gpt2_tiny|deepspeed zero-offload|bf16+fp32-master|None|32|full",
            f"gpt2_tiny|dataflow|bf16|{4 * 2**20}|32|full",
            "gpt2_tiny|dataflow|bf16|1024|32|full",
        }
    )
    for row in doc["rows"]:
        assert list(row) == ISSUE_FIELDS
    fastest = max(r["tok_s"] for r in doc["rows"] if r["budget_bytes"] is None and r["tok_s"])
    for row in doc["rows"]:
        if row["tok_s"] is None:
            assert row["note"] and row["ratio_to_fastest_stock"] is None
            continue
        assert row["tok_s"] == pytest.approx(row["tokens_per_step"] / row["measured_step_s"])
        assert row["ratio_to_fastest_stock"] == pytest.approx(row["tok_s"] / fastest)
        assert row["mfu"] is None  # no peak is known for a CPU
    meta = doc["meta"]
    assert meta["device"] == "cpu" and meta["runs"]
    model = meta["models"]["gpt2_tiny"]
    assert model["family"] == "gpt2" and model["seq_len"] == 32
    assert model["dataflow_matches"]["dataflow_dtype"] == "bf16"  # nearest the bf16 stock row
    # the stock rows' tricks, resolved (no cut_cross_entropy here: torch's loss)
    tricks = {"vocab_multiple": 64, "tf32": True, "compile_mode": None, "fused_ce": "torch"}
    assert meta["stock_tricks"] == tricks
    assert (
        meta["row_details"]["gpt2_tiny|pytorch eager|bf16|None|32|full"]["stock_tricks"] == tricks
    )


def test_dataflow_rows_come_from_the_engine_and_say_why_a_budget_has_none(first_run) -> None:
    out, _ = first_run
    doc = json.loads(out.read_text())
    rows = by_key(doc)
    fit = rows[f"gpt2_tiny|dataflow|bf16|{4 * 2**20}|32|full"]
    assert fit["tokens_per_step"] >= 128 and fit["note"] is None
    assert fit["predicted_step_s"] > 0 and 0 <= fit["compute_idle_pct"] < 100
    assert fit["moved_bytes_per_step"] > 0  # this lowering starts W and O in slow memory
    details = doc["meta"]["row_details"][f"gpt2_tiny|dataflow|bf16|{4 * 2**20}|32|full"]
    assert fit["batch"] * details["rounds"] * 32 == fit["tokens_per_step"]
    assert all(loss > 0 for loss in details["losses"])
    none = rows["gpt2_tiny|dataflow|bf16|1024|32|full"]
    assert none["tok_s"] is None and none["note"].startswith("1 KiB: no batch plans here")
    assert "the smallest budget that works is" in none["note"]
    deepspeed = rows["gpt2_tiny|deepspeed zero-offload|bf16+fp32-master|None|32|full"]
    try:
        import deepspeed as _  # noqa: F401
    except ImportError:
        assert "DeepSpeed cannot be imported" in deepspeed["note"]


def test_append_merges_new_rows_and_skips_rows_it_has(first_run, tmp_path) -> None:
    out, page = first_run
    copy, page_copy = tmp_path / "compare.json", tmp_path / "page.md"
    shutil.copy(out, copy)
    shutil.copy(page, page_copy)
    before = json.loads(copy.read_text())
    args = [*TINY, "--rows", "stock,dataflow", "--stock-engines", "eager", "--stock-dtypes", "bf16"]
    args += ["--dataflow-dtypes", "mixed", "--budgets", "4MiB", "--append"]
    args += ["--dataflow-orders", "round,layer"]
    assert compare.main([*args, "--out", str(copy), "--doc", str(page_copy)]) == 0
    after = json.loads(copy.read_text())
    old, new = by_key(before), by_key(after)
    by_layer = f"gpt2_tiny|dataflow by layer|mixed|{4 * 2**20}|32|full"
    assert set(new) == set(old) | {f"gpt2_tiny|dataflow|mixed|{4 * 2**20}|32|full", by_layer}
    assert new[by_layer]["tok_s"] > 0
    assert after["meta"]["row_details"][by_layer]["order"] == "layer"
    # the eager row was already measured: kept as it was, not run again
    key = "gpt2_tiny|pytorch eager|bf16|None|32|full"
    assert new[key]["measured_step_s"] == old[key]["measured_step_s"]
    assert len(after["meta"]["runs"]) == len(before["meta"]["runs"]) + 1
    assert "dataflow | full | 32 | mixed | 4 MiB" in page_copy.read_text()


def test_table_only_renders_every_row_between_the_markers(first_run, tmp_path) -> None:
    out, page = first_run
    fresh = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "throughput.md", fresh)
    assert compare.main(["--table-only", "--out", str(out), "--doc", str(fresh)]) == 0
    text = fresh.read_text()
    assert text == page.read_text()
    table = text.split(compare_doc.TABLE_START)[1].split(compare_doc.TABLE_END)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]  # head, rule
    assert len(rows) == len(json.loads(out.read_text())["rows"])
    prose = (ROOT / "docs" / "throughput.md").read_text().split(compare_doc.TABLE_START)[0]
    assert text.split(compare_doc.TABLE_START)[0] == prose


def test_a_page_without_the_markers_is_a_clear_error(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# no table here\n")
    with pytest.raises(ValueError, match="page.md: no '<!-- compare.py table: start -->'"):
        compare_doc.write_table({"rows": [], "meta": {}}, page)


def test_bad_options_name_themselves(capsys) -> None:
    with pytest.raises(SystemExit):
        compare.main(["--rows", "stock,fast"])
    assert "fast: not one of stock, dataflow, deepspeed" in capsys.readouterr().err
    assert compare.main(["--table-only", "--out", "/nonexistent/compare.json"]) == 2


def test_a_row_with_other_fields_is_refused(tmp_path) -> None:
    path = tmp_path / "compare.json"
    row = compare_doc.make_row("m", "pytorch eager", "bf16", None) | {"extra": 1}
    path.write_text(json.dumps({"rows": [row], "meta": {}}))
    with pytest.raises(
        ValueError, match=r"row m\|pytorch eager\|bf16\|None\|None\|full has fields"
    ):
        compare_doc.load_doc(path)


# -- the measuring helpers ---------------------------------------------------------------
def test_device_activity_reads_kernels_and_copies_of_a_profiler_trace() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100.0, "dur": 50.0},
            {"ph": "X", "cat": "kernel", "name": "gelu", "ts": 140.0, "dur": 30.0},  # overlaps
            {"ph": "X", "cat": "kernel", "name": "adam", "ts": 300.0, "dur": 10.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
             "ts": 0.0, "dur": 40.0, "args": {"bytes": 4096}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)",
             "ts": 200.0, "dur": 20.0, "args": {"bytes": 1024}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
             "ts": 250.0, "dur": 5.0, "args": {"bytes": 8}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 999.0},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0},
        ]
    }  # fmt: skip
    activity = measure.device_activity(trace)
    assert activity.kernel_s == pytest.approx(80e-6)  # 100..170 and 300..310
    assert (activity.h2d_bytes, activity.d2h_bytes, activity.moved_bytes) == (4096, 1024, 5120)
    assert (activity.h2d_s, activity.d2h_s) == (pytest.approx(40e-6), pytest.approx(20e-6))
    assert measure.link_busy_pct(activity, 80e-6) == pytest.approx(50.0)
    assert measure.idle_pct(80e-6, 100e-6) == pytest.approx(20.0)
    assert measure.idle_pct(120e-6, 100e-6) == 0.0


def test_flops_per_token_counts_matrix_parameters_and_attention() -> None:
    from dataflow.plugins import families

    config = families().get("gpt2").load().config("gpt2_124m")
    d, layers, vocab = 768, 12, 50257
    # by hand: per block qkv, attn proj, fc, mlp proj (+ biases) and two norms; the tied
    # embedding once; the final norm; no position embedding
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    params = vocab * d + layers * block + 2 * d
    assert measure.matmul_params(config) == params
    assert measure.flops_per_token(config, 1024) == 6 * params + 12 * layers * d * 1024
    assert measure.flops_per_token(config, 1024, causal=True) == 6 * params + 6 * layers * d * 1024
    # MLA: scores over 192 (128 + 64 rotated) and values of 128 a head, DeepSeek V3's widths
    from dataflow_training.step.family import load_family

    v3 = load_family("deepseek_v3").config("deepseek_v3_cut") if has_deepseek() else None
    if v3 is not None:
        attention = 6 * 2 * v3.num_attention_heads * (192 + 128) * 4096
        assert measure.attention_flops_per_token(v3, 4096) == attention
    assert measure.peak_flops("NVIDIA H200") == 990e12
    assert measure.peak_flops("NVIDIA H100 80GB HBM3") == 990e12
    assert measure.peak_flops("cpu") is None


def has_deepseek() -> bool:
    import importlib.util

    return importlib.util.find_spec("dataflow_family_deepseek") is not None


def test_time_limit_interrupts_and_is_not_an_exception() -> None:
    with pytest.raises(measure.RowTimeout, match="time limit of 0 s"):
        with measure.time_limit(0.05):
            try:
                while True:
                    pass
            except Exception:  # noqa: BLE001  (what torch.compile's wrappers do)
                pytest.fail("RowTimeout was caught as an Exception")
    assert not issubclass(measure.RowTimeout, Exception)


def test_limited_by_rule() -> None:
    row = compare_doc.make_row("m", "x", "bf16", None, tokens_per_step=1, measured_step_s=1.0)
    assert compare_doc.limited_by(row | {"compute_idle_pct": 4.0}, {}) == "compute"
    assert compare_doc.limited_by(row | {"compute_idle_pct": 30.0}, {"link_busy_pct": 85}) == "link"
    assert compare_doc.limited_by(row | {"compute_idle_pct": 30.0}, {"link_busy_pct": 40}) == "host"
    assert compare_doc.limited_by(compare_doc.make_row("m", "x", "bf16", None), {}) == ""


def test_shapes_run_in_the_order_of_their_predicted_speed() -> None:
    from dataflow.plugins import families

    family = families().get("gpt2").load()

    def ranked(budget):
        return compare_dataflow.ranked_shapes(
            family, "gpt2_tiny", "bf16", budget, 32, [1, 2, 4], 128, 1024
        )

    # 600,000 bytes: every batch plans, none at its lower bound
    shapes, said = ranked(600_000)
    assert sorted(shapes) == [(1, 4), (2, 2), (4, 1)]
    speed = {s: said[str(s[0])]["roofline_tok_s"] for s in shapes}
    best = max(speed.values())
    near = [s for s in shapes if speed[s] >= 0.98 * best]
    assert shapes[: len(near)] == sorted(near, reverse=True)  # larger batch first
    rest = shapes[len(near) :]
    assert [speed[s] for s in rest] == sorted((speed[s] for s in rest), reverse=True)
    # unbounded: the largest batch plans at its lower bound, the rest are not planned
    shapes, said = ranked(2**40)
    assert shapes == [(4, 1), (2, 2), (1, 4)] and list(said) == ["4"] and said["4"]["at_bound"]
    nothing, said = ranked(1024)
    assert nothing == [] and said["1"].startswith("roofline plan: InfeasibleBudget")


def test_given_batch_order_runs_the_first_batch_given_without_ranking(tmp_path) -> None:
    """``--dataflow-batch-order given``: the row runs the first batch given (here the
    smaller, which the roofline ranking would try last) and its details say so."""
    page = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    out = tmp_path / "compare.json"
    args = [*TINY, "--rows", "dataflow", "--budgets", "4MiB", "--dataflow-dtypes", "bf16"]
    args += ["--dataflow-batches", "1,2", "--dataflow-batch-order", "given"]
    assert compare.main([*args, "--out", str(out), "--doc", str(page)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert (row["batch"], row["tokens_per_step"]) == (1, 128), row
    details = doc["meta"]["row_details"][compare_doc.row_key(row)]
    assert details["tried"] == {"given": ["1 x 4", "2 x 2"]} and details["rounds"] == 4


def test_an_int8_states_row_trains_its_moments_in_8_bits_and_says_its_causal_mfu(
    tmp_path,
) -> None:
    """``--dataflow-dtypes bf16-int8``: a row of its own dtype whose step keeps AdamW's
    moments block-wise in 8 bits (issue 50's 14B rows); with a peak known every row's
    details carry ``mfu_causal``, the attention FLOPs counted causally, which the table
    shows beside the PaLM convention's MFU."""
    from benchmarks.harness.compare_dataflow import train_config

    train = train_config("bf16-int8", 2, 2, 32, 32)
    assert train.optimizer.name == "adamw_int8"
    assert train.optimizer.state_dtypes["exp_avg"] == "int8"
    page = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    out = tmp_path / "compare.json"
    args = [*TINY, "--rows", "dataflow", "--budgets", "4MiB", "--dataflow-dtypes", "bf16-int8"]
    args += ["--dataflow-batches", "2", "--dataflow-batch-order", "given", "--peak-tflops", "1"]
    assert compare.main([*args, "--out", str(out), "--doc", str(page)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["dtype"] == "bf16-int8" and row["tok_s"], row
    details = doc["meta"]["row_details"][compare_doc.row_key(row)]
    flops = doc["meta"]["models"]["gpt2_tiny"]["flops_per_token"]
    assert row["mfu"] == pytest.approx(row["tok_s"] * flops / 1e12)
    # the causal saving, half the attention term: 6 L a T (gpt2_tiny's L, a from its config)
    from dataflow_training.step.family import load_family

    tiny = load_family("gpt2").config("gpt2_tiny")
    layers, width, seq = tiny.n_layer, tiny.n_embd, 32
    causal = row["tok_s"] * (flops - 6 * layers * width * seq) / 1e12
    assert details["mfu_causal"] == pytest.approx(causal)
    assert f"({100 * details['mfu_causal']:.1f} % causal)" in page.read_text()


def test_where_no_plain_stock_batch_fits_checkpointing_is_measured(monkeypatch, tmp_path) -> None:
    """Issue 50's stock rows (a 14B model, a long sequence): when every batch of the plain
    stock rows runs out of memory, the checkpointing row still runs, with the last engine
    given over every batch, and the plain row says why it has no figure."""
    trial = compare.Bench.stock_trial

    def plain_out_of_memory(self, engine, dtype, checkpoint, batch):
        if not checkpoint:
            raise torch.cuda.OutOfMemoryError("no room")
        return trial(self, engine, dtype, checkpoint, batch)

    monkeypatch.setattr(compare.Bench, "stock_trial", plain_out_of_memory)
    page = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    out = tmp_path / "compare.json"
    args = [*TINY, "--rows", "stock", "--stock-engines", "eager", "--stock-dtypes", "bf16"]
    assert compare.main([*args, "--batches", "2,1", "--out", str(out), "--doc", str(page)]) == 0
    rows = by_key(json.loads(out.read_text()))
    plain = rows["gpt2_tiny|pytorch eager|bf16|None|32|full"]
    assert plain["tok_s"] is None and "out of memory" in plain["note"], plain
    checkpointed = rows["gpt2_tiny|pytorch eager + checkpointing|bf16|None|32|full"]
    assert checkpointed["tok_s"] and checkpointed["batch"] in (1, 2), checkpointed
    # --only-checkpoint-row: that row alone (a long sequence's stock row)
    alone = tmp_path / "alone.json"
    assert (
        compare.main(
            [*args, "--only-checkpoint-row", "--batches", "1"]
            + ["--out", str(alone), "--doc", str(page)]
        )
        == 0
    )
    (row,) = json.loads(alone.read_text())["rows"]
    assert row["engine"] == "pytorch eager + checkpointing" and row["tok_s"], row


def test_checkpointing_leaves_the_stock_step_unchanged() -> None:
    """Checkpointed blocks recompute in backward: the loss and every gradient are the
    plain model's (float32 on the CPU)."""
    from dataflow.plugins import families

    config = families().get("gpt2").load().config("gpt2_tiny")
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = stock.StockGPT2(
            config.vocab_size, config.n_positions, config.n_embd, config.n_layer, config.n_head,
            checkpoint=checkpoint,
        )  # fmt: skip
        loss = model(tokens, tokens.roll(1, dims=1))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = grads
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7, msg=name)


def test_stock_step_trains_in_both_dtypes() -> None:
    from dataflow.plugins import families

    config = families().get("gpt2").load().config("gpt2_tiny")
    for dtype in ("autocast", "bf16"):
        step = stock.build_stock(config, 2, 16, dtype=dtype, device="cpu")
        step(0)  # one update: it runs, in the dtype asked for
    with pytest.raises(ValueError, match="dtype: 'fp8' is not"):
        stock.build_stock(config, 2, 16, dtype="fp8", device="cpu")


@pytest.mark.gpu
def test_compare_runs_on_cuda_at_tiny_size(tmp_path) -> None:
    """Every row kind on the GPU at gpt2_tiny (inductor, the profiler, the engine on CUDA):
    the paths the H200 run takes, in about a minute."""
    page = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    out = tmp_path / "compare.json"
    args = [*SHAPE, "--device", "cuda", "--budgets", "64MiB", "--rows", "stock,dataflow"]
    traces = tmp_path / "traces"
    args += ["--trace-dir", str(traces)]
    assert compare.main([*args, "--out", str(out), "--doc", str(page)]) == 0
    doc = json.loads(out.read_text())
    # the dataflow row's profiled step and simulated step, set side by side
    (sim,) = traces.glob("*.sim.json.gz")
    stem = str(sim).removesuffix(".sim.json.gz")
    assert Path(f"{stem}.trace.json.gz").is_file()
    from benchmarks import trace_vs_sim

    report = trace_vs_sim.main([stem])
    for way in ("h2d", "d2h"):
        link = report["links"][way]
        assert link["trace_bytes"] >= link["sim_bytes"], link  # the fed tokens come on top
    for row in doc["rows"]:
        if row["engine"].startswith(("pytorch", "dataflow")):
            assert row["tok_s"] and row["allocator_peak_bytes"], row
            assert row["compute_idle_pct"] is not None, row
        if row["engine"] == "dataflow":
            assert row["allocator_peak_bytes"] <= row["budget_bytes"]


@pytest.mark.slow
def test_deepspeed_row_measures_where_deepspeed_is_installed(tmp_path) -> None:
    """The ZeRO-Offload row itself, where DeepSpeed is installed (its CPU Adam op is
    compiled on first use: minutes). On a CPU it runs on DeepSpeed's CPU accelerator."""
    pytest.importorskip("deepspeed")
    from benchmarks.harness import deepspeed_row

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "row.json"
    args = ["--device", device, "--preset", "gpt2_tiny", "--seq-len", "32", "--batches", "2"]
    command = [sys.executable, "-m", "benchmarks.harness.deepspeed_row", *args, "--out", str(out)]
    done = subprocess.run(
        [*command, "--steps", "2", "--warmup", "2"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    row = result["row"]
    assert list(row) == ISSUE_FIELDS and row["note"] is None, row
    assert (row["engine"], row["dtype"]) == (deepspeed_row.ENGINE, deepspeed_row.DTYPE)
    assert row["tok_s"] > 0 and row["tokens_per_step"] == 64
    if device == "cuda":  # gradients go to the host, updated weights come back
        assert row["moved_bytes_per_step"] > 0 and row["allocator_peak_bytes"] > 0
