"""HF parity against ``transformers.DeepseekV32ForCausalLM``: DeepSeek V3's parity tests
(``test_deepseek_v3_hf``: logits, the objective, export, the MTP layers, FP8 refused) on
random small V3.2 configs whose indexer keeps 6 of the 20 tokens (the sparse path; 8
indexer heads, so that exact ties of the ReLU'd scores at the top-k's edge are
unlikely), and one training step: transformers' indexer runs under ``no_grad`` and has
no loss, so the main model's gradients are held to transformers' (its objective: the
cross-entropy and the balance term) and the indexer's to autograd of the plain
reference's KL loss (``kit.dsa_reference``), then AdamW over both against
``torch.optim.AdamW``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs
import torch
from dataflow_training import OptimizerPolicy, TrainConfig, TrainingRun

# the V3 tests' parity base and constants, by path: pytest imports test files in importlib
# mode (pyproject.toml), where a test file is no module a sibling can import by name
_V3 = importlib.util.spec_from_file_location(
    "deepseek_v3_hf_parity", Path(__file__).with_name("test_deepseek_v3_hf.py")
)
v3 = importlib.util.module_from_spec(_V3)
_V3.loader.exec_module(v3)

INDEXER = ".self_attn.indexer."


class TestDeepseekV32Parity(v3.TestDeepseekV3Parity):
    family_name = "deepseek_v32"
    preset = "deepseek_v32_tiny"
    hf_class = "DeepseekV32ForCausalLM"
    #: the indexer tensors of the model (3 layers, 5 each)
    indexers = 5 * 3

    def hf_config(self, transformers, tied):
        fields = super().hf_config(transformers, tied).to_dict()
        keep = set(transformers.DeepseekV32Config().to_dict()) - {"rope_interleave"}
        fields = {k: v for k, v in fields.items() if k in keep}
        return transformers.DeepseekV32Config(
            **fields | {"index_n_heads": 8, "index_head_dim": 16, "index_topk": 6}
        )

    def _reference_objective(self, reference, tokens, targets):
        """The cross-entropy and balance term (transformers' model has no indexer loss)."""
        losses, terms = reference([(tokens, targets)])
        return losses[0] + terms - reference.indexer_losses()

    def test_the_parts_are_there(self, family, hf_checkpoint):
        _, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (8, 16, 6)
        assert state["1.self_attn.indexer.wq_b.weight"].shape == (8 * 16, 24)
        assert state["1.self_attn.indexer.k_norm.bias"].shape == (16,)
        assert not config.index_rope_interleave and config.rope_interleave

    def test_one_training_step_agrees_with_transformers(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tokens, targets = self._batch(config.vocab_size, seed=5)
        optimizer = OptimizerPolicy(lr=v3.LR)
        train = TrainConfig(seq_len=v3.SEQ, batch=3, chunk_tokens=17, optimizer=optimizer)
        overrides = {f.name: getattr(config, f.name) for f in attrs.fields(type(config))}
        overrides |= {"seq_aux_loss_coef": v3.ALPHA, "bias_update_speed": v3.GAMMA}
        run = TrainingRun.of(
            family, self.preset, train, overrides=overrides, state=state, keep_grads=True
        )
        with run:
            stats = run.step([(tokens, targets)])
            grads, weights = run.grads(), run.state()[0]

        # the indexer's gradients: autograd of the reference's KL loss alone
        reference = family.reference_model(family.config(self.preset, **overrides))
        reference.load_state_dict(state)
        reference([(tokens, targets)])
        reference.indexer_losses().backward()
        own = dict(reference.named_parameters())
        names = self._hf_names(family, config)
        indexer = {k for k in names if INDEXER in k}
        assert len(indexer) == self.indexers
        model.train()
        params = dict(model.named_parameters())
        torch_adamw = torch.optim.AdamW(
            [
                {"params": [p for p in params.values() if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params.values() if p.dim() == 1], "weight_decay": 0.0},
            ],
            lr=v3.LR,
            betas=(optimizer.beta1, optimizer.beta2),
            eps=optimizer.eps,
        )
        objective, loss = self._hf_objective(model, tokens, targets, alpha=v3.ALPHA)
        objective.backward()
        for key in indexer:
            assert params[names[key]].grad is None  # transformers' indexer: no gradient
            params[names[key]].grad = own[key].grad.clone()
        hf_grads = {name: p.grad.detach().clone() for name, p in params.items()}
        torch_adamw.step()

        torch.testing.assert_close(torch.tensor(stats.losses[0]), loss.detach(), **v3.FLOAT32)
        biases = {k for k in names if k.endswith("e_score_correction_bias")}
        assert set(grads) == set(names) - biases
        for key in sorted(set(names) - biases):
            hf_grad, after = hf_grads[names[key]], params[names[key]].detach()
            assert hf_grad.abs().max() > 0, key
            torch.testing.assert_close(
                grads[key], hf_grad, **v3.GRADS, msg=lambda m, k=key: f"{k}: {m}"
            )
            noise = hf_grad.abs() <= v3.NOISE * hf_grad.abs().max()
            torch.testing.assert_close(
                weights[key][~noise], after[~noise], **v3.FLOAT32, msg=lambda m, k=key: f"{k}: {m}"
            )
