"""benchmarks/compare.py across models (issues 15 and 16): rows keyed by model, ratios
against the same model's fastest stock row, one table per model, a file of the GPT-2-only
format read as the GPT-2 run it was; the stock decoders (Llama 3, Qwen 3, OLMoE, Qwen 3
MoE, Qwen 3.5 and its MoE, DeepSeek V3, V3.2 and GLM 5) against each family's
plain-autograd reference; and a llama3_tiny run on the CPU appended beside GPT-2 rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks import compare  # noqa: E402
from benchmarks.harness import compare_doc, measure, stock_decoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

DECODERS = [
    ("llama3", "llama3_tiny"),
    ("qwen3", "qwen3_tiny"),
    ("olmoe", "olmoe_tiny"),
    ("qwen3_moe", "qwen3_moe_tiny"),
    ("qwen3_5", "qwen3_5_tiny"),
    ("qwen3_5_moe", "qwen3_5_moe_tiny"),
    ("deepseek_v3", "deepseek_v3_tiny"),
    ("deepseek_v32", "deepseek_v32_tiny"),
    ("glm5", "glm5_tiny"),
]
#: the family packages a checkout may lack: their cases skip without them
PACKAGES = {
    "deepseek_v3": "dataflow_family_deepseek",
    "deepseek_v32": "dataflow_family_deepseek",
    "glm5": "dataflow_family_glm",
}


def family(name):
    from dataflow_training.step.family import load_family

    return load_family(name)


def row(model, engine, budget, tok_s, **fields):
    return compare_doc.make_row(
        model, engine, "bf16", budget, tokens_per_step=100, measured_step_s=100 / tok_s, **fields
    )


# -- the document --------------------------------------------------------------------------
def test_ratios_are_against_the_fastest_stock_row_of_the_same_model() -> None:
    doc = {
        "rows": [
            row("a", "pytorch eager", None, 100.0),
            row("a", "pytorch compile", None, 200.0),
            row("a", "dataflow", 2**30, 150.0),
            row("b", "pytorch compile", None, 10.0),
            row("b", "dataflow", 2**30, 9.0),
            row("c", "dataflow", 2**30, 5.0),  # no stock row of its own: no ratio
        ],
        "meta": {"models": {"b": {}, "a": {}}},
    }
    compare_doc.finish(doc)
    ratios = {compare_doc.row_key(r): r["ratio_to_fastest_stock"] for r in doc["rows"]}
    assert ratios["a|pytorch eager|bf16|None|None|full"] == pytest.approx(0.5)
    assert ratios[f"a|dataflow|bf16|{2**30}|None|full"] == pytest.approx(0.75)
    assert ratios[f"b|dataflow|bf16|{2**30}|None|full"] == pytest.approx(0.9)
    assert ratios[f"c|dataflow|bf16|{2**30}|None|full"] is None
    assert [r["model"] for r in doc["rows"]] == ["b", "b", "a", "a", "a", "c"]  # meta order


def test_a_row_is_rated_against_stock_of_its_own_mode_and_sequence_length() -> None:
    """A LoRA or RL row against the stock row of that mode, a long-context row against
    the stock row of its length: never against pretraining's stock at another length."""
    doc = {
        "rows": [
            row("a", "pytorch compile", None, 200.0, seq_len=4096),
            row("a", "dataflow", 2**30, 150.0, seq_len=4096),
            row("a", "pytorch compile", None, 50.0, seq_len=32768),
            row("a", "dataflow", 2**30, 45.0, seq_len=32768),
            row("a", "pytorch compile", None, 100.0, seq_len=4096, mode="rl"),
            row("a", "dataflow", 2**30, 95.0, seq_len=4096, mode="rl"),
            row("a", "dataflow", 2**30, 80.0, seq_len=4096, mode="lora"),  # no stock: none
        ],
        "meta": {"models": {"a": {}}},
    }
    compare_doc.finish(doc)
    ratios = {compare_doc.row_key(r): r["ratio_to_fastest_stock"] for r in doc["rows"]}
    assert ratios[f"a|dataflow|bf16|{2**30}|4096|full"] == pytest.approx(0.75)
    assert ratios[f"a|dataflow|bf16|{2**30}|32768|full"] == pytest.approx(0.9)
    assert ratios[f"a|dataflow|bf16|{2**30}|4096|rl"] == pytest.approx(0.95)
    assert ratios[f"a|dataflow|bf16|{2**30}|4096|lora"] is None
    assert compare_doc.fastest_stock(doc["rows"]) == {"a": 200.0}
    assert [r["mode"] for r in doc["rows"]] == ["full"] * 4 + ["lora", "rl", "rl"]
    with pytest.raises(ValueError, match="mode is one of full, lora, rl"):
        row("a", "dataflow", None, 1.0, mode="sft")


def test_one_table_per_model_each_with_its_own_rows() -> None:
    doc = {
        "rows": [row("a", "pytorch compile", None, 200.0), row("b", "dataflow", 2**30, 9.0)],
        "meta": {"models": {"a": {"seq_len": 7}, "b": {"seq_len": 9}}},
    }
    text = compare_doc.render_tables(compare_doc.finish(doc))
    first, second = text.split("### b\n")
    assert first.startswith("### a\n") and "| pytorch compile |" in first
    assert "| dataflow |" not in first and "| dataflow |" in second
    assert "| a |" not in first  # the model is the heading, not a column


def test_a_caption_names_each_run_of_its_rows() -> None:
    """A model's rows measured on two devices (its entry's run, and RL rows that recorded
    their own): the caption names both, each with the modes of its rows."""
    rl = row("a", "dataflow", 2**30, 9.0, mode="rl")
    doc = {
        "rows": [row("a", "pytorch compile", None, 200.0), rl],
        "meta": {
            "models": {"a": {"device": "H200", "torch": "2.11", "date": "d1"}},
            "row_details": {
                compare_doc.row_key(rl): {"run": {"device": "H100", "torch": "2.11", "date": "d2"}}
            },
        },
    }
    text = compare_doc.render_tables(compare_doc.finish(doc))
    assert "H200, torch 2.11, d1 (full rows); H100, torch 2.11, d2 (rl rows); a;" in text
    doc["rows"].pop()
    assert "\nH200, torch 2.11, d1; a;" in compare_doc.render_tables(doc)


def test_a_file_from_before_models_is_the_gpt2_run_it_was(tmp_path) -> None:
    legacy = compare_doc.make_row("x", "pytorch compile", "bf16", None)
    for field in ("model", "seq_len", "mode"):  # none of them then
        legacy.pop(field)
    meta = {
        "preset": "gpt2_124m",
        "family": "gpt2",
        "seq_len": 1024,
        "flops_per_token": 1.0,
        "peak_flops": 2.0,
        "device": "NVIDIA H200",
        "row_details": {"pytorch compile|bf16|None": {"kernel_s": 0.5}},
    }
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"rows": [legacy], "meta": meta}))
    doc = compare_doc.load_doc(path)
    (only,) = doc["rows"]
    assert list(only) == list(compare_doc.FIELDS) and only["model"] == "gpt2_124m"
    assert only["seq_len"] == 1024 and only["mode"] == "full"
    details = doc["meta"]["row_details"]
    assert details == {"gpt2_124m|pytorch compile|bf16|None|1024|full": {"kernel_s": 0.5}}
    entry = doc["meta"]["models"]["gpt2_124m"]
    assert entry["seq_len"] == 1024 and entry["peak_flops"] == 2.0
    assert entry["device"] == "NVIDIA H200"
    assert "preset" not in doc["meta"] and "seq_len" not in doc["meta"]


def test_the_committed_results_read_as_gpt2_rows_and_keep_their_table() -> None:
    doc = compare_doc.finish(compare_doc.load_doc(BENCHMARKS / "results" / "compare.json"))
    assert {r["model"] for r in doc["rows"]} >= {"gpt2_124m"}
    page = (ROOT / "docs" / "throughput.md").read_text()
    table = page.split(compare_doc.TABLE_START + "\n")[1].split(compare_doc.TABLE_END)[0]
    assert table == compare_doc.render_tables(doc)


# -- the stock decoders ---------------------------------------------------------------------
def assert_stock_is_reference(fam, config) -> None:
    """The reference's state loads as is; logits, the step's objective (router terms
    included for MoE, and the indexer losses for sparse attention) and every gradient
    agree in float32 on the CPU. 32 tokens: the sparse presets' queries past the 16th
    attend to 16 keys of their own choice."""
    from dataflow_training.kit import DSAReference

    torch.manual_seed(0)
    reference = fam.reference_model(config)
    model = stock_decoder.decoder_type(config)(config, 32)
    model.load_state_dict(reference.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
    targets = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
    torch.testing.assert_close(model.logits(tokens), reference.logits(tokens), rtol=1e-5, atol=1e-5)
    if stock_decoder.is_moe(config):
        losses, terms = reference([(tokens, targets)])
        expected = losses[0] + terms
        assert float(terms.detach()) > 0  # the router terms are part of what is compared
    else:
        expected = reference(tokens, targets)
    loss = model(tokens, targets)
    if isinstance(reference, DSAReference):  # the indexers' KL losses, over sparse choices
        assert float(reference.indexer_losses().detach()) > 0
        first = model.blocks()[0].self_attn.last["keep"]
        assert not first.equal(first.new_ones(32, 32).tril().expand_as(first))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    grads = dict(reference.named_parameters())
    for key, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[key].grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize(("name", "preset"), DECODERS)
def test_stock_decoder_is_the_family_reference(name, preset) -> None:
    if name in PACKAGES:
        pytest.importorskip(PACKAGES[name])
    fam = family(name)
    assert_stock_is_reference(fam, fam.config(preset))


@pytest.mark.parametrize(
    "overrides",
    [
        # YaRN with a cos/sin factor (mscale_all_dim 0) and a softmax scale (1)
        {"rope_yarn": {"factor": 4.0, "original_max_position": 16, "mscale_all_dim": 0.0}},
        {"rope_yarn": {"factor": 4.0, "original_max_position": 16, "mscale_all_dim": 1.0}},
        {"q_lora_rank": None},  # a plain q_proj (Moonlight)
    ],
    ids=["yarn factor", "yarn scale", "no q latent"],
)
def test_stock_deepseek_is_the_reference_with_yarn_or_without_a_query_latent(overrides) -> None:
    """The MLA settings the tiny preset lacks: YaRN's frequencies, cos/sin factor and
    softmax scale in the step's tables, and the query without its latent."""
    pytest.importorskip(PACKAGES["deepseek_v3"])
    fam = family("deepseek_v3")
    assert_stock_is_reference(fam, fam.config("deepseek_v3_tiny", **overrides))


def test_checkpointed_stock_decoder_has_the_same_gradients() -> None:
    config = family("olmoe").config("olmoe_tiny")
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)
    )
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = stock_decoder.StockDecoder(config, 16, checkpoint=checkpoint)
        loss = model(tokens, tokens.roll(1, dims=1))
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-6, atol=1e-7, msg=key)


def test_matmul_params_of_a_decoder_by_hand() -> None:
    llama = family("llama3").config("llama3_tiny")  # tied: the embedding is the head
    n, q, kv, inner, vocab = 64, 64, 32, 160, 256
    block = n * q + 2 * n * kv + q * n + 3 * n * inner
    assert measure.matmul_params(llama) == vocab * n + 2 * block
    olmoe = family("olmoe").config("olmoe_tiny")  # untied: the embedding is a lookup
    e, k, inner = 8, 2, 32
    attention = 4 * 64 * 64
    experts = e * (2 * inner * 64 + 64 * inner) * k / e
    block = attention + 64 * e + experts
    assert measure.matmul_params(olmoe) == pytest.approx(256 * 64 + 2 * block)
    assert measure.flops_per_token(olmoe, 32) == pytest.approx(
        6 * (256 * 64 + 2 * block) + 12 * 2 * 64 * 32
    )


# -- a second model's rows beside GPT-2's ---------------------------------------------------
def test_llama3_rows_append_beside_gpt2_rows(tmp_path) -> None:
    page, out = tmp_path / "page.md", tmp_path / "compare.json"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    shutil.copy(BENCHMARKS / "results" / "compare.json", out)
    before = compare_doc.load_doc(out)
    args = [
        *("--family", "llama3", "--preset", "llama3_tiny", "--seq-len", "32"),
        *("--device", "cpu", "--compile-backend", "eager", "--steps", "1", "--warmup", "1"),
        *("--rows", "stock,dataflow", "--stock-engines", "eager", "--stock-dtypes", "bf16"),
        *("--batches", "2", "--dataflow-batches", "2", "--min-tokens", "128"),
        *("--budgets", "4MiB", "--backing", "64MiB", "--no-checkpoint-row"),
        *("--append", "--out", str(out), "--doc", str(page)),
    ]
    assert compare.main(args) == 0
    doc = json.loads(out.read_text())
    rows = {compare_doc.row_key(r): r for r in doc["rows"]}
    gpt2 = {k for k in rows if k.startswith("gpt2_124m|")}
    assert gpt2 == {compare_doc.row_key(r) for r in before["rows"] if r["model"] == "gpt2_124m"}
    stock_row = rows["llama3_tiny|pytorch eager|bf16|None|32|full"]
    flow = rows[f"llama3_tiny|dataflow|bf16|{4 * 2**20}|32|full"]
    assert stock_row["ratio_to_fastest_stock"] == 1.0
    assert flow["ratio_to_fastest_stock"] == pytest.approx(flow["tok_s"] / stock_row["tok_s"])
    details = doc["meta"]["row_details"][f"llama3_tiny|dataflow|bf16|{4 * 2**20}|32|full"]
    assert 0 < details["pinned_bytes"] <= 64 * 2**20
    assert doc["meta"]["models"]["llama3_tiny"]["family"] == "llama3"
    text = page.read_text()
    assert "### gpt2_124m" in text and "### llama3_tiny" in text


def test_a_backing_the_slow_pool_does_not_fit_is_a_row_that_says_so(tmp_path) -> None:
    page, out = tmp_path / "page.md", tmp_path / "compare.json"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    args = [
        *("--family", "llama3", "--preset", "llama3_tiny", "--seq-len", "32"),
        *("--device", "cpu", "--steps", "1", "--warmup", "1", "--rows", "dataflow"),
        *("--dataflow-dtypes", "bf16", "--dataflow-batches", "2", "--min-tokens", "64"),
        *("--budgets", "4MiB", "--backing", "512B", "--out", str(out), "--doc", str(page)),
    ]
    assert compare.main(args) == 0
    (only,) = json.loads(out.read_text())["rows"]
    assert only["tok_s"] is None and "512 B" in only["note"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "preset"),
    [("olmoe", "olmoe_tiny"), ("deepseek_v3", "deepseek_v3_tiny"), ("glm5", "glm5_tiny")],
)
def test_stock_moe_on_cuda_uses_grouped_mm_and_matches_the_loop(name, preset) -> None:
    """On a GPU in bfloat16 the experts run through ``torch._grouped_mm`` (eager and under
    torch.compile): the objective agrees with the expert loop on the same weights (GLM 5:
    with sparse attention through SDPA's mask)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        pytest.skip("needs a CUDA device and torch._grouped_mm")
    if name in PACKAGES:
        pytest.importorskip(PACKAGES[name])
    from benchmarks.harness import stock

    config = family(name).config(preset)
    model = stock.stock_model(config, 32, device="cuda", dtype="bf16")
    tokens = torch.randint(0, config.vocab_size, (2, 32), device="cuda")
    targets = tokens.roll(1, dims=1)
    grouped = model(tokens, targets)
    compiled = torch.compile(model)(tokens, targets)
    loop = stock_decoder.decoder_type(config)(config, 32).to(torch.float32)
    loop.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    expected = loop(tokens.cpu(), targets.cpu())
    torch.testing.assert_close(grouped.float().cpu(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_model_rows_run_on_cuda_at_tiny_presets(tmp_path) -> None:
    """llama3_tiny and olmoe_tiny rows on the GPU (inductor, the profiler, the engine
    with its pinned pool bounded by the host's memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    page, out = tmp_path / "page.md", tmp_path / "compare.json"
    shutil.copy(ROOT / "docs" / "throughput.md", page)
    for name, preset in (("llama3", "llama3_tiny"), ("olmoe", "olmoe_tiny")):
        args = [
            *("--family", name, "--preset", preset, "--seq-len", "64", "--device", "cuda"),
            *("--rows", "stock,dataflow", "--stock-engines", "compile", "--stock-dtypes", "bf16"),
            *("--dataflow-dtypes", "bf16", "--batches", "4", "--dataflow-batches", "4"),
            *("--min-tokens", "512", "--budgets", "64MiB", "--no-checkpoint-row", "--steps", "2"),
            *("--warmup", "1", "--append", "--out", str(out), "--doc", str(page)),
        ]
        assert compare.main(args) == 0
    for r in json.loads(out.read_text())["rows"]:
        assert r["tok_s"], r
        if r["engine"] == "dataflow":
            assert r["allocator_peak_bytes"] <= r["budget_bytes"]


def test_place_llama3_8b_reads_the_committed_h200_profiles() -> None:
    """benchmarks/place_llama3_8b.py (a minute of planning, not run here) imports and
    reads the committed profile archive: its head task's workspace is the one the 8 GiB
    row was placed with (3.29 GB after the in-place head accumulator)."""
    from benchmarks import place_llama3_8b

    profiles = place_llama3_8b.measured_profiles(BENCHMARKS / "results" / "profiles_llama3_8b.tgz")
    heads = [p for key, p in profiles.items() if "llama3.head.loss" in key]
    assert heads and max(p.workspace_bytes for p in heads) < 3.5e9


def test_place_llama3_8b_estimates_the_tiled_head_from_the_archive() -> None:
    """``--head-vocab-tiles`` prices the head under its tiled signature at 4/3 of its time
    with the float32 (vocab, dim) accumulator out of its workspace, and the embedding
    backward with its float32 table replaced by the row sums' buffers."""
    import json

    from benchmarks import place_llama3_8b

    known = place_llama3_8b.measured_profiles(BENCHMARKS / "results" / "profiles_llama3_8b.tgz")
    tokens, vocab, dim = 8192, 128256, 4096
    found = place_llama3_8b.estimated_tiles(known, tokens, vocab, dim)
    table = vocab * dim * 4
    heads = 0
    for key, profile in known.items():
        signature = json.loads(key)
        if signature[0] == "llama3.head.loss":
            signature[1] = sorted([*signature[1], ["vocab_tiles", "True"]])
            tiled = found[json.dumps(signature)]
            assert tiled.cost_us == profile.cost_us * 4 / 3
            assert tiled.workspace_bytes == profile.workspace_bytes - table
            heads += 1
        elif signature[0] == "llama3.embed.backward":
            rows = place_llama3_8b.ROWS_TEMPORARIES * tokens * dim * 4
            assert found[key].workspace_bytes == profile.workspace_bytes - table + rows
    assert heads


def test_place_llama3_8b_what_if_gives_a_compute_key_its_workspace() -> None:
    """``--workspace KEY=SIZE`` re-prices every profile of that compute key (any preset the
    archive has; here gpt2_124m's) with that workspace and leaves the others and every
    cost alone."""
    import json

    from benchmarks import place_llama3_8b

    known = place_llama3_8b.measured_profiles(BENCHMARKS / "results" / "profiles_gpt2.tgz")
    lookup = place_llama3_8b.Lookup(known, caps={"gpt2.head.loss": 180_000_000})
    heads = 0
    for key, profile in known.items():
        capped = lookup.profile_of(key)
        assert capped.cost_us == profile.cost_us
        if json.loads(key)[0] == "gpt2.head.loss":
            assert capped.workspace_bytes == 180_000_000 != profile.workspace_bytes
            heads += 1
        else:
            assert capped.workspace_bytes == profile.workspace_bytes
    assert heads
    assert not lookup.stand_ins


def test_place_llama3_8b_prices_another_batch_from_the_archive_by_its_tokens() -> None:
    """A signature at a batch the archive lacks is priced from the key's largest shape,
    time and workspace scaled by the tokens; the what-if still wins over the scaled
    workspace."""
    import json

    from benchmarks import place_llama3_8b

    known = place_llama3_8b.measured_profiles(BENCHMARKS / "results" / "profiles_olmoe16.tgz")
    text = next(k for k in known if json.loads(k)[0] == "olmoe.moe.backward")
    signature = json.loads(text)
    assert signature[2] == [4, 4096]
    costliest = max(
        (p for k, p in known.items() if json.loads(k)[0] == signature[0]),
        key=lambda p: p.cost_us,
    )
    signature[2] = [2, 4096]
    activations = 4 * 4096 * 2048 * 2  # (tokens, hidden) in bf16: half as many at batch 2
    signature[3] = [n // 2 if n == activations else n for n in signature[3]]
    halved = json.dumps(signature)
    lookup = place_llama3_8b.Lookup(known)
    scaled = lookup.profile_of(halved)
    assert scaled.cost_us == costliest.cost_us / 2
    assert scaled.workspace_bytes == costliest.workspace_bytes // 2
    assert lookup.scaled == {"olmoe.moe.backward"} and halved in lookup.stand_ins
    capped = place_llama3_8b.Lookup(known, caps={"olmoe.moe.backward": 123}).profile_of(halved)
    assert (capped.cost_us, capped.workspace_bytes) == (scaled.cost_us, 123)
    faster = place_llama3_8b.Lookup(known, scales={"olmoe.moe.backward": 0.5}).profile_of(halved)
    assert (faster.cost_us, faster.workspace_bytes) == (scaled.cost_us / 2, scaled.workspace_bytes)
    update = json.loads(next(k for k in known if json.loads(k)[0] == "optim.adamw"))
    profiled = known[json.dumps(update)]
    update[2] = [2, 4096]
    assert place_llama3_8b.Lookup(known).profile_of(json.dumps(update)) == profiled
    signature[0] = "olmoe.nothing"
    try:
        lookup.profile_of(json.dumps(signature))
    except KeyError as exc:
        assert "olmoe.nothing" in str(exc)
    else:
        raise AssertionError("a compute key the archive lacks was priced")


def test_place_llama3_8b_reads_one_resolvers_profiles_the_newest_first(tmp_path) -> None:
    """An archive may hold two resolvers' entries (or two code versions') for one
    signature: only ``resolver``'s count, and of those the newest file."""
    import json
    import os

    from benchmarks import place_llama3_8b

    signature = ["olmoe.moe.backward", [], [4, 4096]]

    def entry(name: str, resolver: str, cost_us: float, mtime: int) -> None:
        key = {"signature": signature, "kernels": [f"resolver {resolver}"]}
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps({"key": json.dumps(key), "cost_us": cost_us, "workspace_bytes": 1})
        )
        os.utime(path, (mtime, mtime))

    entry("a", "torch-compiled", 18_000.0, 200)
    entry("b", "torch-compiled", 17_000.0, 100)
    entry("z", "torch", 15_000.0, 300)  # sorts last by name and by time
    (compiled,) = place_llama3_8b.measured_profiles(tmp_path, "torch-compiled").values()
    assert compiled.cost_us == 18_000.0
    (eager,) = place_llama3_8b.measured_profiles(tmp_path, "torch").values()
    assert eager.cost_us == 15_000.0


def test_place_llama3_8b_link_scale_multiplies_each_direction_and_keeps_the_rest() -> None:
    """``--link-scale F``: both directions' bandwidth, and their duplex total, times F;
    latencies and the collective link as they were."""
    from benchmarks import place_llama3_8b
    from dataflow.schema.program import Link, Links

    links = Links(h2d=Link(54_804.6, 10.0), d2h=Link(55_228.2, 12.0), duplex_bytes_per_us=98_947.0)
    faster = place_llama3_8b.scaled_links(links, 3.0)
    assert faster.h2d == Link(54_804.6 * 3, 10.0)
    assert faster.d2h == Link(55_228.2 * 3, 12.0)
    assert faster.duplex_bytes_per_us == 98_947.0 * 3
    assert faster.collective is None
    assert place_llama3_8b.scaled_links(links, 1.0) == links
