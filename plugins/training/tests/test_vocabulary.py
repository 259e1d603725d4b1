"""Vocabulary from the data: a tiny preset trains on ``bpe:300`` shards (its vocabulary
taken from their tokenizer, or ``--vocab-size``), the run keeps the tokenizer, and
``export --hf`` writes it so that ``transformers`` loads tokenizer and model; a byte run
exports a byte-level tokenizer; a vocabulary the data does not fit is one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from dataflow_training.drive.checkpoint import latest_checkpoint, read_checkpoint
from dataflow_training.drive.tokenizer import byte_chars, byte_level_tokenizer
from dataflow_training.drive.vocabulary import VocabError, choose_vocab
from dataflow_training.step.family import load_family

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")
tokenizers = pytest.importorskip("tokenizers")

SHAPE = ("--batch", "2", "--seq-len", "32", "--device", "cpu", "--checkpoint-minutes", "0")
TEXT = "The quick brown fox jumps over the lazy dog, then naps; 42 tokens é ü."
FAILED = 1


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory) -> Path:
    """``bpe:300`` shards of a few of this repository's pages (as docs/feeds.md does)."""
    corpus = tmp_path_factory.mktemp("corpus")
    docs = Path(__file__).parents[3] / "docs"
    for name in ("feeds.md", "usage.md", "checkpointing.md"):
        if (docs / name).is_file():
            shutil.copy(docs / name, corpus / name)
    (corpus / "extra.txt").write_text(TEXT * 50)
    shards = tmp_path_factory.mktemp("data") / "bpe300"
    result = invoke("data", "prepare", "--text", corpus, "--tokenizer", "bpe:300", "-o", shards)
    assert result.exit_code == 0, result.output
    return shards


def _train(data: str, out: Path, preset: str = "gpt2_tiny", steps: int = 2, *extra: str):
    return invoke(
        "train", "--preset", preset, "--data", data, "--steps", steps, *SHAPE, "--out", out,
        *extra,
    )  # fmt: skip


def _manifest(out: Path) -> dict:
    return json.loads((latest_checkpoint(out) / "manifest.json").read_text())


# -- the rule ---------------------------------------------------------------------------


class _Feed:
    def __init__(self, vocab_size: int, tokenizer) -> None:
        self.vocab_size, self.tokenizer = vocab_size, tokenizer


TOKENIZER = Path("tokenizer.json")


@pytest.mark.parametrize(
    ("feed", "given", "init", "kept", "size"),
    [
        (_Feed(256, "bytes"), None, None, None, 256),  # bytes: the preset's
        (_Feed(300, TOKENIZER), None, None, None, 300),  # a tokenizer: its vocabulary
        (_Feed(200, TOKENIZER), None, None, None, 200),  # smaller too
        (_Feed(300, TOKENIZER), 320, None, None, 320),  # --vocab-size wins
        (_Feed(200, None), None, None, None, 256),  # no tokenizer, ids fit: the preset's
        (_Feed(300, TOKENIZER), None, 512, None, 512),  # --init: the folder's
        (_Feed(300, TOKENIZER), None, None, 50257, 50257),  # a resume: the checkpoint's
    ],
)
def test_the_vocabulary_rule(feed, given, init, kept, size) -> None:
    assert choose_vocab(256, feed, "D", given=given, init_vocab=init, kept=kept).size == size


@pytest.mark.parametrize(
    ("feed", "given", "init", "kept", "culprits"),
    [
        (_Feed(300, TOKENIZER), 280, None, None, ("300", "--vocab-size 280", "leave it out")),
        (_Feed(300, None), None, None, None, ("300", "256", "--vocab-size 300")),
        (_Feed(300, TOKENIZER), 320, 512, None, ("--vocab-size 320", "512")),
        (_Feed(600, TOKENIZER), None, 512, None, ("600", "512", "--init")),
        (_Feed(300, TOKENIZER), 400, None, 320, ("--vocab-size 400", "320", "resumes")),
        (_Feed(400, TOKENIZER), None, None, 320, ("400", "320", "resumes")),
    ],
)
def test_a_vocabulary_the_data_does_not_fit_names_both(feed, given, init, kept, culprits) -> None:
    with pytest.raises(VocabError) as error:
        choose_vocab(256, feed, "D", given=given, init_vocab=init, kept=kept)
    assert "\n" not in str(error.value)
    for culprit in culprits:
        assert culprit in str(error.value)


def test_the_byte_level_tokenizer_ids_are_the_bytes() -> None:
    assert set(byte_chars().values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = byte_level_tokenizer()
    assert tokenizer.get_vocab_size() == 256
    for text in ("hello", TEXT, "  two  spaces\n\ttab", "日本語"):
        ids = tokenizer.encode(text).ids
        assert ids == list(text.encode("utf-8")), text
        assert tokenizer.decode(ids) == text


# -- train, resume, export ----------------------------------------------------------------


def _dataflow_logits(out: Path, family_name: str, ids: list[int]) -> torch.Tensor:
    """The logits of the run's latest checkpoint on ``ids``, by the family's reference."""
    weights, _opt, manifest, _rng = read_checkpoint(latest_checkpoint(out), weights_only=True)
    family = load_family(family_name)
    config = family.config(manifest["preset"], **manifest["overrides"])
    reference = family.reference_model(config)
    reference.load_state_dict(weights)
    with torch.no_grad():
        return reference.logits(torch.tensor([ids]))


def _moment_bytes(family, preset: str, overrides: dict) -> dict[str, int]:
    """Each ``O`` object's size, as the step of ``preset`` with ``overrides`` stores it."""
    from dataflow_training.step.config import TrainConfig
    from dataflow_training.step.lowering import lower

    layout = lower(family, preset, TrainConfig(seq_len=8), overrides=overrides).layout
    return {p.id: p.layout.size_bytes for p in layout.of_kind("O")}


@pytest.mark.parametrize(("preset", "family"), [("gpt2_tiny", "gpt2"), ("llama3_tiny", "llama3")])
def test_a_tiny_preset_trains_on_bpe_shards_and_exports_what_transformers_loads(
    bpe_shards, tmp_path, preset, family
) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip(f"dataflow_family_{family}")
    data = tmp_path / "data"
    shutil.copytree(bpe_shards, data)
    out = tmp_path / "run"
    result = _train(f"shards:{data}", out, preset)
    assert result.exit_code == 0, result.output
    assert "vocab 300" in result.output and "the tokenizer's vocab 300" in result.output
    manifest = _manifest(out)
    assert manifest["vocab_size"] == 300 and manifest["overrides"] == {"vocab_size": 300}
    assert manifest["tokenizer"]["kind"] == "file"
    assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    # the step stored the tables padded to 320 rows (vocab_multiple); the checkpoint has
    # the real vocabulary's, weights and AdamW moments alike
    weights, opt, _, _ = read_checkpoint(latest_checkpoint(out))
    family_ = load_family(family)
    config = family_.config(preset, vocab_size=300)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        k: tuple(v.shape) for k, v in family_.reference_model(config).state_dict().items()
    }
    sizes = {k: v.shape[0] for k, v in opt.items()}
    unpadded = _moment_bytes(family_, preset, {"vocab_size": 300, "vocab_multiple": 1})
    assert sizes == unpadded != _moment_bytes(family_, preset, {"vocab_size": 300})

    shutil.rmtree(data)  # the run keeps its own copy of the tokenizer
    hf = tmp_path / "hf"
    result = invoke("export", "--hf", hf, "--from", out)
    assert result.exit_code == 0, result.output
    assert "tokenizer" in result.output

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tokenizer(TEXT)["input_ids"]
    assert (
        ids == tokenizers.Tokenizer.from_file(str(bpe_shards / "tokenizer.json")).encode(TEXT).ids
    )
    assert max(ids) >= 256  # merges, not bytes
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0

    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.vocab_size == 300 and model.config.eos_token_id == 0
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(theirs, _dataflow_logits(out, family, ids), rtol=1e-4, atol=1e-4)


def test_a_resumed_run_keeps_its_vocabulary_and_tokenizer(bpe_shards, tmp_path) -> None:
    out = tmp_path / "run"
    assert _train(f"shards:{bpe_shards}", out, "gpt2_tiny", 1, "--vocab-size", "320").exit_code == 0
    result = _train(f"shards:{bpe_shards}", out, "gpt2_tiny", 2, "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert "vocab_size 320" in result.output  # the resume: line
    manifest = _manifest(out)
    assert manifest["step"] == 2 and manifest["vocab_size"] == 320
    assert manifest["overrides"] == {"vocab_size": 320}


def test_byte_data_exports_a_byte_level_tokenizer(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "notes.txt"
    text.write_text(TEXT * 20)
    out = tmp_path / "run"
    result = _train(f"text:{text}", out, "gpt2_tiny", 1)
    assert result.exit_code == 0, result.output
    assert _manifest(out)["tokenizer"] == {"kind": "bytes"}
    assert _manifest(out)["overrides"] == {}  # the preset's vocabulary, as before
    hf = tmp_path / "hf"
    result = invoke("export", "--hf", hf, "--from", out)
    assert result.exit_code == 0, result.output
    assert "byte-level tokenizer" in result.output
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert tokenizer("hello")["input_ids"] == [104, 101, 108, 108, 111]
    assert tokenizer("é")["input_ids"] == [0xC3, 0xA9]
    assert tokenizer.decode(list(TEXT.encode())) == TEXT
    # fine-tuning the export on byte data is no mismatch of tokenizers: no warning
    result = _train(f"text:{text}", tmp_path / "tuned", "gpt2_tiny", 1, "--init", hf)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output

    # without the tokenizers library (an import of it fails): one line, nothing written
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    bare = tmp_path / "bare"
    result = invoke("export", "--hf", bare, "--from", out)
    assert_one_line_error(result, FAILED, "tokenizers", "--no-tokenizer")
    assert not bare.exists()
    result = invoke("export", "--hf", bare, "--from", out, "--no-tokenizer")
    assert result.exit_code == 0, result.output
    assert (bare / "config.json").is_file() and not (bare / "tokenizer.json").exists()


def test_a_vocabulary_smaller_than_the_data_is_one_line(bpe_shards, tmp_path) -> None:
    result = _train(f"shards:{bpe_shards}", tmp_path / "run", "gpt2_tiny", 1, "--vocab-size", "280")
    assert_one_line_error(result, FAILED, "300", "--vocab-size 280")
    # shards without their tokenizer: the ids past the preset's 256 need --vocab-size
    bare = tmp_path / "bare"
    shutil.copytree(bpe_shards, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    result = _train(f"shards:{bare}", tmp_path / "run2", "gpt2_tiny", 1)
    assert_one_line_error(result, FAILED, "256", "--vocab-size")


def test_predict_and_export_price_the_vocabulary_given(tmp_path) -> None:
    """``--vocab-size`` on the planning commands: the step of a 4096-token vocabulary."""
    grid = ("--t-round", "64", "--seq-len", "32", "--tokens-step", "128", "--budget", "1")
    rows = {}
    for vocab in (None, 4096):
        out = tmp_path / f"{vocab}.json"
        extra = () if vocab is None else ("--vocab-size", vocab)
        result = invoke(
            "predict", "--preset", "gpt2_tiny", *grid, "--jobs", 1, "--json", out, *extra
        )
        assert result.exit_code == 0, result.output
        rows[vocab] = json.loads(out.read_text())["rows"][0]
    assert rows[4096]["overrides"] == {"vocab_size": 4096} and rows[None]["overrides"] == {}
    assert rows[4096]["fast_peak_bytes"] > rows[None]["fast_peak_bytes"]
    bundle = ("--preset", "gpt2_tiny", "--budget", "64MiB", "--pricing", "roofline")
    result = invoke("export", *bundle, "-o", tmp_path / "b", "--vocab-size", 4096)
    assert result.exit_code == 0, result.output
