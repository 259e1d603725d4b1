"""The deepseek family's HF parity test bases, for its own tests and for the families built
on it (glm5): ``DeepseekV3HFParity`` against ``transformers.DeepseekV3ForCausalLM`` and
``DeepseekV32HFParity`` against ``DeepseekV32ForCausalLM`` (each test file's docstring says
what they check). A test file subclasses one under a ``Test`` name; pytest imports test
files in importlib mode, where one test file cannot import another, so the bases live here.
They need pytest and transformers (``pip install -e 'families/deepseek[test]'``).
"""

from __future__ import annotations

import json
import logging

import attrs
import pytest
import torch
import torch.nn.functional as F
from dataflow_training import OptimizerPolicy, TrainConfig, TrainingRun
from dataflow_training.kit import CheckpointError
from dataflow_training.testing import DecoderHFParity
from safetensors.torch import load_file, save_file

# the kit's parity tolerances (dataflow_training.testing.decoder): float32 both sides
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
GRADS = {"rtol": 1e-4, "atol": 1e-6}
NOISE, LR, SEQ = 1e-4, 1e-3, 20
#: a balance coefficient and a bias rate large enough to show in one step
ALPHA, GAMMA = 0.05, 0.01


def hf_parameter_count(model_class: type, hf_config: object) -> int:
    """``model_class``'s (a transformers DeepSeek V3-architecture class) parameters of
    ``hf_config`` on the meta device, plus its selection biases (buffers there, parameters
    without gradient here)."""
    with torch.device("meta"):
        model = model_class(hf_config)
    biases = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    return sum(p.numel() for p in model.parameters()) + biases


def sequence_balance(gates: list, experts: int, k: int, batch: int) -> torch.Tensor:
    """The DeepSeek V3 report's sequence-wise balance loss (eq. 17-20) of transformers'
    recorded router outputs, summed over the MoE layers: per sequence ``sum_i f_i P_i``,
    ``f_i = E / (k T) * count_i``, ``P_i`` the mean of ``s_i / sum_j s_j``; mean over
    sequences."""
    total = torch.zeros(())
    for logits, _, ids in gates:
        scores = torch.sigmoid(logits.float()).view(batch, -1, experts)
        seq = scores.shape[1]
        counts = F.one_hot(ids.view(batch, -1), experts).sum(1).float()
        f = counts * experts / (k * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        total = total + (f * p).sum(-1).mean()
    return total


class DeepseekV3HFParity(DecoderHFParity):
    family_name = "deepseek_v3"
    preset = "deepseek_v3_tiny"
    hf_class = "DeepseekV3ForCausalLM"
    q_lora_rank: int | None = 24

    def hf_config(self, transformers, tied):
        return transformers.DeepseekV3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            max_position_embeddings=64,
            rope_interleave=True,
            tie_word_embeddings=tied,
        )

    def adjust(self, model):
        """Selection biases away from zero (a buffer the fixture does not perturb)."""
        generator = torch.Generator().manual_seed(7)
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))

    @staticmethod
    def _record(model) -> tuple[list, list]:
        """Forward hooks on every router: their (logits, weights, ids) per call."""
        gates, handles = [], []
        for layer in model.model.layers[1:]:
            handles.append(layer.mlp.gate.register_forward_hook(lambda m, i, o: gates.append(o)))
        return gates, handles

    def _hf_objective(self, model, tokens, targets, alpha=None):
        c = model.config
        gates, handles = self._record(model)
        try:
            logits = model(input_ids=tokens).logits
        finally:
            for handle in handles:
                handle.remove()
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        alpha = 0.0001 if alpha is None else alpha  # the family's default
        balance = sequence_balance(gates, c.n_routed_experts, c.num_experts_per_tok, len(tokens))
        self.gates = gates
        return ce + alpha * balance, ce

    def _reference_objective(self, reference, tokens, targets):
        losses, terms = reference([(tokens, targets)])
        return losses[0] + terms

    def _hf_names(self, family, config):
        names = {
            "emb.embed_tokens.weight": "model.embed_tokens.weight",
            "head.norm.weight": "model.norm.weight",
            "head.lm_head.weight": "lm_head.weight",
        }
        state = family.reference_model(config).state_dict()
        return {
            key: names.get(key) or f"model.layers.{key}"
            for key in state
            if key in names or key.split(".")[0].isdigit()
        }

    def test_one_training_step_agrees_with_transformers(self, family, hf_checkpoint):
        """Gradients and AdamW's step as transformers' of the same objective (balance
        loss included); each MoE layer's selection bias moved by ``GAMMA * sign(mean load -
        load)`` of transformers' own routing."""
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tokens, targets = self._batch(config.vocab_size, seed=5)
        optimizer = OptimizerPolicy(lr=LR)
        train = TrainConfig(seq_len=SEQ, batch=3, chunk_tokens=17, optimizer=optimizer)
        overrides = {f.name: getattr(config, f.name) for f in attrs.fields(type(config))}
        overrides |= {"seq_aux_loss_coef": ALPHA, "bias_update_speed": GAMMA}
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
        objective, loss = self._hf_objective(model, tokens, targets, alpha=ALPHA)
        objective.backward()
        hf_grads = {name: p.grad.detach().clone() for name, p in params.items()}
        torch_adamw.step()

        torch.testing.assert_close(torch.tensor(stats.losses[0]), loss.detach(), **FLOAT32)
        names = self._hf_names(family, config)
        biases = {k for k in names if k.endswith("e_score_correction_bias")}
        assert len(biases) == 2 and set(grads) == set(names) - biases
        for key in sorted(set(names) - biases):
            hf_grad, after = hf_grads[names[key]], params[names[key]].detach()
            torch.testing.assert_close(
                grads[key], hf_grad, **GRADS, msg=lambda m, k=key: f"{k}: {m}"
            )
            noise = hf_grad.abs() <= NOISE * hf_grad.abs().max()
            torch.testing.assert_close(
                weights[key][~noise], after[~noise], **FLOAT32, msg=lambda m, k=key: f"{k}: {m}"
            )
            flipped = (weights[key][noise] - after[noise]).abs()
            assert flipped.numel() == 0 or flipped.max() <= 2 * LR + 1e-6, key
        for layer, (_, _, ids) in zip((1, 2), self.gates, strict=True):
            load = torch.bincount(ids.reshape(-1), minlength=config.num_experts).float()
            before = model.model.layers[layer].mlp.gate.e_score_correction_bias
            expected = before + GAMMA * torch.sign(load.mean() - load)
            assert not torch.equal(expected, before)
            torch.testing.assert_close(
                weights[f"{layer}.mlp.gate.e_score_correction_bias"], expected, rtol=0, atol=1e-7
            )

    def test_the_parts_are_there(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        kinds = [layer.kind for layer in family.layers(config)[1:-1]]
        assert kinds == ["dense", "moe", "moe"]
        assert (config.num_experts, config.n_group, config.topk_group) == (8, 4, 2)
        assert state["1.mlp.experts.gate_up_proj"].shape == (8, 2 * 16, 32)
        assert state["1.mlp.shared_experts.up_proj.weight"].shape == (16, 32)
        assert state["0.self_attn.kv_b_proj.weight"].shape == (4 * (8 + 12), 16)
        bias = model.model.layers[2].mlp.gate.e_score_correction_bias
        assert torch.equal(state["2.mlp.gate.e_score_correction_bias"], bias)

    def test_mtp_layers_are_dropped_with_a_line(self, family, hf_checkpoint, caplog):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
        tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
        save_file(tensors, folder / "model.safetensors")
        with caplog.at_level(logging.WARNING):
            again, read = family.import_hf(folder)
        assert again == config and all(torch.equal(read[k], state[k]) for k in state)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "dropped 2 multi-token-prediction tensors (layers 3" in lines[0]

    def test_fp8_checkpoints_are_refused_naming_the_field(self, family, hf_checkpoint):
        _, folder = hf_checkpoint
        written = json.loads((folder / "config.json").read_text())
        written["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        (folder / "config.json").write_text(json.dumps(written))
        with pytest.raises(CheckpointError, match=r"config.json: quantization_config = .*FP8"):
            family.import_hf(folder)


INDEXER = ".self_attn.indexer."


class DeepseekV32HFParity(DeepseekV3HFParity):
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
        optimizer = OptimizerPolicy(lr=LR)
        train = TrainConfig(seq_len=SEQ, batch=3, chunk_tokens=17, optimizer=optimizer)
        overrides = {f.name: getattr(config, f.name) for f in attrs.fields(type(config))}
        overrides |= {"seq_aux_loss_coef": ALPHA, "bias_update_speed": GAMMA}
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
            lr=LR,
            betas=(optimizer.beta1, optimizer.beta2),
            eps=optimizer.eps,
        )
        objective, loss = self._hf_objective(model, tokens, targets, alpha=ALPHA)
        objective.backward()
        for key in indexer:
            assert params[names[key]].grad is None  # transformers' indexer: no gradient
            params[names[key]].grad = own[key].grad.clone()
        hf_grads = {name: p.grad.detach().clone() for name, p in params.items()}
        torch_adamw.step()

        torch.testing.assert_close(torch.tensor(stats.losses[0]), loss.detach(), **FLOAT32)
        biases = {k for k in names if k.endswith("e_score_correction_bias")}
        assert set(grads) == set(names) - biases
        for key in sorted(set(names) - biases):
            hf_grad, after = hf_grads[names[key]], params[names[key]].detach()
            assert hf_grad.abs().max() > 0, key
            torch.testing.assert_close(
                grads[key], hf_grad, **GRADS, msg=lambda m, k=key: f"{k}: {m}"
            )
            noise = hf_grad.abs() <= NOISE * hf_grad.abs().max()
            torch.testing.assert_close(
                weights[key][~noise], after[~noise], **FLOAT32, msg=lambda m, k=key: f"{k}: {m}"
            )
