"""DeepSeek V3's experts (``sigmoid_moe.py``) and a decoder of them as plain-autograd
modules: the truth the kit's ``SigmoidExperts`` is checked against, itself held to
transformers' ``DeepseekV3ForCausalLM`` by the deepseek family's HF tests.

Written apart from the math: the group-limited choice is a loop-free mask written out
again, each chosen expert runs token by token group (``index_add`` over the tokens that
chose it; no sorting, no ``grouped_mm``), and the balance loss is the paper's formula
over each sequence. ``model(rounds)`` takes a step's ``(tokens, targets)`` rounds and
returns (per-round mean cross-entropies, the balance terms averaged over rounds); it
counts every MoE layer's routed tokens over the step, and ``apply_rules()`` then moves
each layer's selection bias by the sign rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dataflow_training.kit.decoder_reference import IGNORE_INDEX, MLP, DecoderReference


class Gate(nn.Module):
    """The router's weight and its selection bias (a parameter without gradient)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e = config.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e), requires_grad=False)


class SigmoidExperts(nn.Module):
    """Sigmoid-scored routed experts with shared experts; records what it decided."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        e, n, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Gate(config)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, n))
        self.experts.down_proj = nn.Parameter(torch.empty(e, n, inner))
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)
        #: (scores (batch, seq, E), ids (batch, seq, k)) of the last forward
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (tokens, E), ids (tokens, k), weights (tokens, k)) of x (tokens, n)."""
        c = self.config
        logits = x @ self.gate.weight.t()
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        with torch.no_grad():
            biased = scores + self.gate.e_score_correction_bias.to(scores.dtype)
            per_group = c.num_experts // c.n_group
            grouped = biased.view(-1, c.n_group, per_group)
            two_best = grouped.sort(dim=-1, descending=True).values[..., :2].sum(-1)
            group_rank = two_best.argsort(dim=-1, descending=True)
            allowed = torch.zeros_like(two_best, dtype=torch.bool)
            allowed.scatter_(1, group_rank[:, : c.topk_group], True)
            allowed = allowed.repeat_interleave(per_group, dim=1)
            masked = torch.where(allowed, biased, torch.full_like(biased, float("-inf")))
            ids = masked.argsort(dim=-1, descending=True)[:, : c.num_experts_per_tok]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, ids, weights * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, c.hidden_size)
        scores, ids, weights = self.route(flat)
        self.last = (scores.view(*x.shape[:-1], -1), ids.view(*x.shape[:-1], -1))
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        inner = c.moe_intermediate_size
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate_up = flat[token] @ self.experts.gate_up_proj[expert].t()
            gate, up = gate_up[:, :inner], gate_up[:, inner:]
            hidden = (F.silu(gate) * up) @ self.experts.down_proj[expert].t()
            out = out.index_add(0, token, hidden * weights[token, slot, None])
        return (out + self.shared_experts(flat)).view_as(x)

    def balance(self) -> torch.Tensor:
        """The paper's sequence-wise balance loss of the last forward, averaged over its
        sequences: per sequence ``alpha * sum_i f_i P_i``."""
        c = self.config
        scores, ids = self.last
        batch, seq, e = scores.shape
        k = c.num_experts_per_tok
        total = torch.zeros(batch, e, dtype=scores.dtype)
        for b in range(batch):
            total[b] = torch.bincount(ids[b].reshape(-1), minlength=e).to(scores.dtype)
        f = total * e / (k * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return c.seq_aux_loss_coef * (f * p).sum(-1).mean()


class SigmoidMoEReference(DecoderReference):
    """The decoder reference whose MoE layers are ``SigmoidExperts`` (its dense layers the
    plain MLP), over a step's rounds (module docstring)."""

    steps_over_rounds = True

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        super().init_weights(generator, std)
        for module in self.modules():
            if isinstance(module, SigmoidExperts):
                module.gate.weight.normal_(0.0, std, generator=generator)
                module.experts.gate_up_proj.normal_(0.0, std, generator=generator)
                module.experts.down_proj.normal_(0.0, std, generator=generator)

    def routers(self) -> list[SigmoidExperts]:
        return [b.mlp for b in self.blocks() if isinstance(b.mlp, SigmoidExperts)]

    def _cross_entropy(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens).flatten(0, 1)
        flat = targets.flatten()
        loss_sum = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum / (flat != IGNORE_INDEX).sum().clamp(min=1)

    def forward(self, rounds: list[tuple[torch.Tensor, torch.Tensor]]):
        """(per-round cross-entropies, the balance terms summed over the MoE layers and
        averaged over rounds); every MoE layer's loads over the step kept for
        ``apply_rules``."""
        c = self.config
        self.loads = [torch.zeros(c.num_experts) for _ in self.routers()]
        losses, balance = [], 0.0
        for tokens, targets in rounds:
            losses.append(self._cross_entropy(tokens, targets))
            for i, router in enumerate(self.routers()):
                ids = router.last[1].reshape(-1).cpu()
                self.loads[i] += torch.bincount(ids, minlength=c.num_experts).float()
                balance = balance + router.balance() / len(rounds)
        return losses, balance

    @torch.no_grad()
    def apply_rules(self) -> None:
        """Each MoE layer's selection bias moved by ``bias_update_speed * sign(mean load -
        load)``, its loads those of the last ``forward``'s step."""
        gamma = self.config.bias_update_speed
        for router, loads in zip(self.routers(), self.loads, strict=True):
            bias = router.gate.e_score_correction_bias
            bias += gamma * torch.sign(loads.mean() - loads).to(bias)
