"""``dataflow train --init`` (``hf_init``): a run started from a Hugging Face model folder.

A ``LlamaForCausalLM`` with llama3_tiny's config (every weight perturbed) saved by
``save_pretrained``: the run's first loss is the HF model's loss on the same batch
(float32, within 1e-5); one with a layer more trains as llama3_tiny with that override,
resumes, and exports a folder transformers loads with the run's weights. Failures are one
line naming the folder and the field. Skipped without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")

PRESET = "llama3_tiny"
SEQ = 32
BATCH = 2


def _hf_model(layers: int = 2):
    transformers = pytest.importorskip("transformers", reason="the --init tests need transformers")
    from dataflow_training.step.family import load_family

    preset = load_family("llama3").config(PRESET)
    scaling = preset.rope_scaling
    config = transformers.LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": preset.rope_theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        },
        tie_word_embeddings=preset.tie_word_embeddings,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # HF init leaves norms at 1: perturb everything
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _options(folder: Path, out: Path, steps: int, **more):
    from dataflow_training.drive.options import TrainOptions

    return TrainOptions(
        family="llama3",
        preset=PRESET,
        steps=steps,
        out=out,
        batch=BATCH,
        seq_len=SEQ,
        init=str(folder),
        **more,
    )


def _hf_loss(model, options) -> float:
    """The HF model's loss on the run's first batch (the same feed, opened again)."""
    from dataflow_training.drive.options import open_feed

    tokens, targets = open_feed(options).next()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.parametrize("layers", [2, 3], ids=["the preset", "a layer more"])
def test_the_first_loss_is_the_hf_models(tmp_path, layers):
    from dataflow_training.drive.trainer import train

    model = _hf_model(layers)
    model.save_pretrained(tmp_path / "hf")
    options = _options(tmp_path / "hf", tmp_path / "run", 1, budget_bytes=2 * 2**20)
    lines: list[str] = []
    summary = train(options, out=_Lines(lines))
    assert summary["first"][1] == pytest.approx(_hf_loss(model, options), rel=1e-5, abs=1e-5)
    (init,) = [line for line in lines if line.startswith("init:")]
    if layers == 2:
        assert init == f"init: weights from {tmp_path / 'hf'} (preset {PRESET})"
    else:
        assert "preset llama3_tiny with config.json's num_hidden_layers=3" in init
    manifest = json.loads((tmp_path / "run" / "step_000001" / "manifest.json").read_text())
    assert manifest["overrides"] == ({} if layers == 2 else {"num_hidden_layers": 3})


def test_an_overridden_run_resumes_and_exports_what_it_trained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    _hf_model(3).save_pretrained(tmp_path / "hf")
    base = ["train", "--preset", PRESET, "--init", tmp_path / "hf", "--device", "cpu"]
    base += ["--batch", BATCH, "--seq-len", SEQ, "--out", tmp_path / "run"]
    assert invoke(*base, "--steps", 2).exit_code == 0
    # a resumed run reads config.json only: its weights come from the checkpoint
    (tmp_path / "hf" / "model.safetensors").unlink()
    result = invoke(*base, "--steps", 3, "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert "not read (the run resumes)" in result.output
    checkpoint = tmp_path / "run" / "step_000003"
    assert invoke("export", "--hf", tmp_path / "out", "--from", checkpoint).exit_code == 0
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.num_hidden_layers == 3
    trained = load_file(checkpoint / "model.safetensors")
    assert torch.equal(
        reloaded.model.layers[2].mlp.down_proj.weight, trained["2.mlp.down_proj.weight"]
    )


def test_a_resume_keeps_the_init_runs_overrides_and_names_its_folder_on_a_clash(tmp_path):
    """Resumed without ``--init``, a run started from a folder keeps that folder's overrides
    (from its manifest: the folder is not needed again); resumed with another folder whose
    config does not fit, the error says which folder the run started from."""
    pytest.importorskip("transformers")
    _hf_model(3).save_pretrained(tmp_path / "hf")
    _hf_model(2).save_pretrained(tmp_path / "other")
    base = ["train", "--preset", PRESET, "--device", "cpu", "--out", tmp_path / "run"]
    base += ["--batch", BATCH, "--seq-len", SEQ]
    assert invoke(*base, "--init", tmp_path / "hf", "--steps", 1).exit_code == 0
    result = invoke(*base, "--steps", 3, "--resume", "auto", "--init", tmp_path / "other")
    assert_one_line_error(result, 1, "num_hidden_layers", f"started with --init {tmp_path / 'hf'}")
    shutil.rmtree(tmp_path / "hf")
    result = invoke(*base, "--steps", 2, "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert "overrides {'num_hidden_layers': 3}" in result.output.splitlines()[0]


def test_init_failures_are_one_line(tmp_path):
    pytest.importorskip("transformers")
    _hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "bare").mkdir()
    base = ["train", "--device", "cpu", "--steps", 1, "--out", tmp_path / "run"]
    cases = [
        (
            ["--preset", "l3_1b", "--init", tmp_path / "hf"],
            ["is preset 'llama3_tiny'", "--preset llama3_tiny"],
        ),
        (["--preset", "qwen3_tiny", "--init", tmp_path / "hf"], ["model_type", "qwen3"]),
        (["--preset", PRESET, "--init", tmp_path / "nowhere"], ["nowhere", "no such folder"]),
        (["--preset", PRESET, "--init", tmp_path / "bare"], ["bare", "config.json"]),
    ]
    for args, culprits in cases:
        assert_one_line_error(invoke(*base, *args), 1, *culprits)
    assert not (tmp_path / "run").exists()


def test_without_a_preset_the_folders_config_names_it(tmp_path):
    pytest.importorskip("transformers")
    from dataflow_training.drive.hf_init import preset_of

    _hf_model(3).save_pretrained(tmp_path / "hf")  # llama3_tiny with a layer more
    assert preset_of(tmp_path / "hf") == ("llama3", PRESET)
    base = ["train", "--device", "cpu", "--steps", 1, "--batch", BATCH, "--seq-len", SEQ]
    result = invoke(*base, "--init", tmp_path / "hf", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "preset llama3_tiny with config.json's num_hidden_layers=3" in result.output
    (tmp_path / "bare").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "mistral"}')
    cases = [
        (["--init", tmp_path / "bare"], ["bare", "config.json", "--preset"]),
        (["--init", other], ["model_type 'mistral'", "--preset"]),
        (["--init", tmp_path / "hf", "--family", "qwen3"], ["family 'qwen3'", "'llama'"]),
    ]
    for args, culprits in cases:
        assert_one_line_error(invoke(*base, *args, "--out", tmp_path / "x"), 1, *culprits)
    result = invoke(*base, "--out", tmp_path / "x")
    assert_one_line_error(result, 2, "--preset", "--init")
    assert not (tmp_path / "x").exists()


def test_byte_tokens_for_a_model_with_its_own_tokenizer_are_warned_of(tmp_path):
    from dataflow_training.drive.trainer import train

    _hf_model().save_pretrained(tmp_path / "hf")
    for with_tokenizer in (False, True):
        if with_tokenizer:
            (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # only its presence counts
        lines: list[str] = []
        out = tmp_path / f"run_{with_tokenizer}"
        options = _options(tmp_path / "hf", out, 1)  # the default feed: byte tokens
        train(options, out=_Lines(lines))
        warned = [line for line in lines if line.startswith("warning: --data")]
        assert bool(warned) == with_tokenizer, lines
    assert "dataflow data prepare --text PATH --tokenizer" in warned[0]


def test_a_family_without_an_hf_import_says_so(tmp_path):
    from dataflow_training.drive.hf_init import InitError, hf_overrides
    from dataflow_training.testing.toy import ToyFamily

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(InitError, match="family 'toy' has no Hugging Face import"):
        hf_overrides(ToyFamily(), "toy", "small", tmp_path / "model")


class _Lines:
    """A text stream that keeps the lines ``train`` prints."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> None:
        self.lines.extend(line for line in text.splitlines() if line)

    def flush(self) -> None:
        pass
