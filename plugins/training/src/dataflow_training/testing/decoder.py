"""Tests every family built on the kit's decoder subclasses (they need pytest).

``DecoderFamilyChecks`` (no transformers needed): parameter counts against the reference
model's ``numel`` for every preset (built on the meta device, so the 8B costs nothing) and
the published counts, the preset table and ``docs/models/<family>.md`` against the code,
config and checkpoint errors that name the field and file, and ``dataflow train`` then
``dataflow export --hf`` on the tiny preset.

``DecoderHFParity`` (each test skips itself without ``transformers``)::

    class TestLlamaParity(DecoderHFParity):
        family_name, preset, hf_class = "llama3", "llama3_tiny", "LlamaForCausalLM"

        def hf_config(self, transformers, tied):
            return transformers.LlamaConfig(..., tie_word_embeddings=tied)

Each test runs for an untied and a tied random model (every weight perturbed, so no norm
is 1), saved by ``save_pretrained``:

- its import gives the family's reference model the HF model's logits and loss;
- one training step of the lowered program on the engine (``TrainingRun``, fp32, AdamW)
  agrees with one ``torch.optim.AdamW`` step of the HF model on the same tokens: the loss,
  every weight gradient, every weight after the step;
- export reloads in transformers bit for bit, one file or sharded, and a checkpoint
  sharded by transformers imports; a preset's reference exported loads into the HF class
  with the reference's logits (the exported ``config.json`` means what the family means).

Tolerances: the HF model and the reference both compute in float32, with different
summation orders (HF's RMSNorm and SDPA attention): logits and losses within ``FLOAT32``.
Gradients within ``GRADS``. After the step, Adam moves every weight by about ``lr`` in the
direction of its gradient's sign, so a weight whose gradient is rounding noise (below
``NOISE`` of its tensor's largest) may move the other way: those may differ by ``2 * lr``,
all others within ``FLOAT32``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dataflow.testing import invoke
from dataflow_training.drive.run import TrainingRun
from dataflow_training.kit.decoder import expected_state, parameter_count
from dataflow_training.kit.decoder_hf import key_map
from dataflow_training.kit.hf import CheckpointError
from dataflow_training.step.config import OptimizerPolicy, TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.testing.task_doc import BLOCK, stale_blocks

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
GRADS = {"rtol": 1e-4, "atol": 1e-6}
NOISE = 1e-4
LR = 1e-3
SEQ = 20


def _transformers() -> Any:
    return pytest.importorskip(
        "transformers",
        reason="transformers is not installed: the HF parity tests need it "
        "(pip install the family with its [test] extra)",
    )


class DecoderHFParity:
    family_name: ClassVar[str] = ""
    #: a preset of the family (its fields are all overridden by the HF model's)
    preset: ClassVar[str] = ""
    #: the ``transformers`` class name, e.g. ``"LlamaForCausalLM"``
    hf_class: ClassVar[str] = ""

    def hf_config(self, transformers: Any, tied: bool) -> Any:
        """A small random config of ``hf_class`` (vocab that no chunk divides, GQA)."""
        raise NotImplementedError

    def adjust(self, model: Any) -> None:
        """Change the perturbed random model before it is saved (a family whose HF model
        computes some weights' gradients too coarsely at their random init moves them)."""

    # -- fixtures ----------------------------------------------------------------------
    @pytest.fixture
    def family(self) -> Any:

        return load_family(self.family_name)

    @pytest.fixture(params=[False, True], ids=["untied", "tied"])
    def hf_checkpoint(self, request: Any, tmp_path: Path) -> tuple[Any, Path]:
        transformers = _transformers()
        torch.manual_seed(0)
        model = getattr(transformers, self.hf_class)(self.hf_config(transformers, request.param))
        with torch.no_grad():  # HF init leaves norms at 1: perturb everything
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
            self.adjust(model)
        folder = tmp_path / "hf"
        model.save_pretrained(folder)
        return model, folder

    @staticmethod
    def _batch(vocab: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(
            0, vocab, (3, SEQ + 1), generator=torch.Generator().manual_seed(seed)
        )
        targets = tokens[:, 1:].clone()
        targets[0, 3] = -100
        return tokens[:, :-1].contiguous(), targets

    @staticmethod
    def _hf_loss(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def _hf_objective(
        self, model: Any, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the HF model trains on, the cross-entropy a step reports): the same for a
        dense model; an MoE adds its router terms to the first."""
        loss = self._hf_loss(model, tokens, targets)
        return loss, loss

    def _reference_objective(self, reference: Any, tokens: Any, targets: Any) -> torch.Tensor:
        return reference(tokens, targets)

    def _hf_names(self, family: Any, config: Any) -> dict[str, str]:
        """family state key -> the HF model's parameter of it."""

        entries = key_map(family.name, config).expand(expected_state(config))
        return {entry.key: entry.hf_names[0] for entry in entries}

    # -- tests -------------------------------------------------------------------------
    def test_an_hf_checkpoint_gives_the_same_logits_and_loss(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        assert config.tie_word_embeddings == model.config.tie_word_embeddings
        reference = family.reference_model(config)
        reference.load_state_dict(state)
        tokens, targets = self._batch(config.vocab_size)
        with torch.no_grad():
            torch.testing.assert_close(
                reference.logits(tokens), model(input_ids=tokens).logits, **FLOAT32
            )
            torch.testing.assert_close(
                self._reference_objective(reference, tokens, targets),
                self._hf_objective(model, tokens, targets)[0],
                **FLOAT32,
            )

    def test_one_training_step_agrees_with_transformers(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tokens, targets = self._batch(config.vocab_size, seed=5)
        optimizer = OptimizerPolicy(lr=LR)
        train = TrainConfig(seq_len=SEQ, batch=3, chunk_tokens=17, optimizer=optimizer)
        overrides = {
            field.name: getattr(config, field.name) for field in attrs.fields(type(config))
        }
        run = TrainingRun.of(
            family, self.preset, train, overrides=overrides, state=state, keep_grads=True
        )
        with run:
            stats = run.step([(tokens, targets)])
            grads, weights = run.grads(), run.state()[0]

        model.train()
        params = dict(model.named_parameters())
        torch_adamw = torch.optim.AdamW(
            [
                {"params": [p for p in params.values() if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params.values() if p.dim() == 1], "weight_decay": 0.0},
            ],
            lr=LR,
            betas=(optimizer.beta1, optimizer.beta2),
            eps=optimizer.eps,
        )
        objective, loss = self._hf_objective(model, tokens, targets)
        objective.backward()
        hf_grads = {name: p.grad.detach().clone() for name, p in params.items()}
        torch_adamw.step()

        torch.testing.assert_close(torch.tensor(stats.losses[0]), loss.detach(), **FLOAT32)
        names = self._hf_names(family, config)
        assert set(grads) == set(names) == set(weights)
        for key, hf_name in names.items():
            hf_grad = hf_grads[hf_name]
            torch.testing.assert_close(
                grads[key], hf_grad, **GRADS, msg=lambda m, k=key: f"{k}: {m}"
            )
            after = params[hf_name].detach()
            noise = hf_grad.abs() <= NOISE * hf_grad.abs().max()
            torch.testing.assert_close(
                weights[key][~noise], after[~noise], **FLOAT32, msg=lambda m, k=key: f"{k}: {m}"
            )
            flipped = (weights[key][noise] - after[noise]).abs()
            assert flipped.numel() == 0 or flipped.max() <= 2 * LR + 1e-6, key

    def test_export_reloads_in_transformers_bit_exact(self, family, hf_checkpoint, tmp_path):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        family.export_hf(config, state, tmp_path / "back")
        reloaded = type(model).from_pretrained(tmp_path / "back")
        original, again = model.state_dict(), reloaded.state_dict()
        assert set(again) == set(original)
        for name, tensor in original.items():
            assert torch.equal(again[name], tensor), name
        assert family.import_hf(tmp_path / "back")[0] == config

    def test_a_sharded_export_reloads_and_imports_back(self, family, hf_checkpoint, tmp_path):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        family.export_hf(config, state, tmp_path / "sharded", max_shard_bytes=20_000)
        index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3
        assert not (tmp_path / "sharded" / "model.safetensors").exists()
        again = type(model).from_pretrained(tmp_path / "sharded").state_dict()
        for name, tensor in model.state_dict().items():
            assert torch.equal(again[name], tensor), name
        _, back = family.import_hf(tmp_path / "sharded")
        assert list(back) == list(state)
        assert all(torch.equal(back[key], state[key]) for key in state)

    def test_a_checkpoint_sharded_by_transformers_imports(self, family, hf_checkpoint, tmp_path):
        model, _ = hf_checkpoint
        model.save_pretrained(tmp_path / "hf_sharded", max_shard_size="20KB")
        assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
        config, state = family.import_hf(tmp_path / "hf_sharded")
        reference = family.reference_model(config)
        reference.load_state_dict(state)
        tokens, _ = self._batch(config.vocab_size, seed=3)
        with torch.no_grad():
            torch.testing.assert_close(
                reference.logits(tokens), model(input_ids=tokens).logits, **FLOAT32
            )

    def test_the_preset_exported_loads_in_transformers_with_the_same_logits(self, family, tmp_path):
        transformers = _transformers()
        config = family.config(self.preset)
        torch.manual_seed(1)
        reference = family.reference_model(config)
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(0.05 * torch.randn_like(param))
        family.export_hf(config, reference.state_dict(), tmp_path / "preset")
        model = getattr(transformers, self.hf_class).from_pretrained(tmp_path / "preset")
        tokens, _ = self._batch(config.vocab_size, seed=4)
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=tokens).logits, reference.logits(tokens), **FLOAT32
            )

    def test_the_published_config_spelling_imports(self, family, tmp_path):
        """Hub files spell rotary as ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
        config = family.config(self.preset)
        state = family.reference_model(config).state_dict()
        family.export_hf(config, state, tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        written.pop("rope_parameters")
        (tmp_path / "config.json").write_text(json.dumps(written))
        assert family.import_hf(tmp_path)[0] == config


class DecoderFamilyChecks:
    family_name: ClassVar[str] = ""
    #: a tiny preset (CPU: trained by ``dataflow train`` here)
    preset: ClassVar[str] = ""
    #: preset -> its HF model's parameter count as published (tied weights once)
    published_counts: ClassVar[dict[str, int]] = {}
    #: the repository's docs/ folder (None: installed outside it, doc tests skip)
    docs: ClassVar[Path | None] = None
    #: a block tensor that a checkpoint must have
    block_tensor: ClassVar[str] = "0.mlp.up_proj.weight"

    @staticmethod
    def count(config: Any) -> int:
        """The family's parameter count of ``config``."""
        return parameter_count(config)

    @pytest.fixture
    def family(self) -> Any:

        return load_family(self.family_name)

    def test_parameter_counts_equal_the_reference_and_the_published_ones(self, family):
        for name in family.presets:
            config = family.config(name)
            with torch.device("meta"):
                reference = family.reference_model(config)
            numel = sum(p.numel() for p in reference.parameters())
            assert self.count(config) == numel, name
            if name in self.published_counts:
                assert numel == self.published_counts[name], name

    def test_layers_are_the_reference_state_tied_and_untied(self, family):
        for tied in (True, False):
            config = family.config(self.preset, tie_word_embeddings=tied)
            layers = family.layers(config)
            declared = {
                f"{layer.name}.{p.name}": p.state_shape for layer in layers for p in layer.params
            }
            state = family.reference_model(config).state_dict()
            assert {k: tuple(v.shape) for k, v in state.items()} == declared
            assert ("head.lm_head.weight" in declared) is not tied
            assert layers[-1].tied == (
                {"lm_head.weight": "emb.embed_tokens.weight"} if tied else {}
            )
            decay = {f"{layer.name}.{p.name}": p.decay for layer in layers for p in layer.params}
            assert decay == {key: len(shape) > 1 for key, shape in declared.items()}  # norms

    def _doc(self, name: str) -> str:
        if self.docs is None or not (self.docs / name).exists():
            pytest.skip(f"docs/{name} is not here (package installed outside the monorepo)")
        return (self.docs / name).read_text()

    def test_the_preset_table_is_the_one_in_the_docs(self, family):
        assert family.preset_table() in self._doc("builtin_models.md"), (
            f"docs/builtin_models.md is out of date: paste `python -m "
            f"dataflow_family_{self.family_name}.presets`"
        )

    def test_the_models_page_matches_the_lowering(self):
        page = self._doc(f"models/{self.family_name}.md")
        assert len(BLOCK.findall(page)) >= 1
        assert stale_blocks(page) == [], (
            f"docs/models/{self.family_name}.md is out of date: run `python -m "
            f"dataflow_training.testing.task_doc --write docs/models/{self.family_name}.md`"
        )

    def test_config_errors_name_the_field(self, family):
        with pytest.raises(KeyError, match=rf"unknown {self.family_name} preset 'nope'; known"):
            family.config("nope")
        with pytest.raises(TypeError, match=r"no field\(s\) 'n_embd'; known fields: vocab_size"):
            family.config(self.preset, n_embd=8)
        with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of "):
            family.config(self.preset, num_attention_heads=4, num_key_value_heads=3)
        with pytest.raises(ValueError, match=r"num_hidden_layers must be a positive int, got 0"):
            family.config(self.preset, num_hidden_layers=0)
        base = family.config(self.preset)
        wider = family.config(self.preset, hidden_size=2 * base.hidden_size)
        follows = base.head_dim == base.hidden_size // base.num_attention_heads
        assert wider.head_dim == (2 * base.head_dim if follows else base.head_dim)

    def test_checkpoint_errors_name_the_field_or_tensor_and_the_file(self, family, tmp_path):
        config = family.config(self.preset)
        state = family.reference_model(config).state_dict()
        family.export_hf(config, state, tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        for field, value, why in [
            ("attention_bias", True, "no biases"),
            ("hidden_act", "gelu", "silu"),
            ("model_type", "gpt2", "not a"),
            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "'yarn' is not implemented"),
        ]:
            (tmp_path / "config.json").write_text(json.dumps({**written, field: value}))
            with pytest.raises(CheckpointError, match=rf"config.json: {field} = .*{why}"):
                family.import_hf(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps(written))
        del state[self.block_tensor]
        with pytest.raises(CheckpointError, match=rf"state has no tensor '{self.block_tensor}'"):
            family.export_hf(config, state, tmp_path / "partial")
        assert not (tmp_path / "partial" / "config.json").exists()

    def test_dataflow_train_then_export_hf(self, family, tmp_path):
        out = tmp_path / "run"
        args = ["--batch", "2", "--seq-len", "32", "--device", "cpu", "--out", out]
        result = invoke("train", "--preset", self.preset, "--steps", "2", *args)
        assert result.exit_code == 0, result.output
        hf = tmp_path / "hf"
        result = invoke("export", "--hf", hf, "--from", out / "step_000002")
        assert result.exit_code == 0, result.output
        trained = load_file(out / "step_000002" / "model.safetensors")
        config, state = family.import_hf(hf)
        assert config == family.config(self.preset)
        assert state.keys() == trained.keys()
        assert all(torch.equal(state[key], trained[key]) for key in state)
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
        assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
