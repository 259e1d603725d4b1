"""DeepSeek Sparse Attention (``dsa.py``) as plain-autograd modules: the truth the kit's DSA
math is checked against, itself held to transformers' ``DeepseekV32ForCausalLM`` and
``GlmMoeDsaForCausalLM`` (logits, loss, the main model's gradients) by the families' HF
tests.

Written apart from the math (imports only torch and the MLA reference): the indexer's
scores over every (query, key) pair, its rope pair by pair where the pairs sit, the
selection as a (seq, seq) mask that the attention's scores are filled with -inf outside
of, and the indexer's KL loss by autograd of ``KL(target || log_softmax)`` on detached
inputs. ``DSAReference(rounds)`` returns (per-round cross-entropies, the balance terms
plus the indexer losses, averaged over rounds).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dataflow_training.kit import mla_reference
from dataflow_training.kit.sigmoid_moe_reference import SigmoidMoEReference


def rotate_first(x: torch.Tensor, config: Any) -> torch.Tensor:
    """x (..., seq, Di) with its first ``qk_rope_head_dim`` dims rotated by position,
    pairs interleaved (``index_rope_interleave``) or half-split."""
    inv, factor = mla_reference.frequencies(config)
    r = config.qk_rope_head_dim
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = (angles.cos() * factor).to(x), (angles.sin() * factor).to(x)
    head, rest = x[..., :r], x[..., r:]
    if config.index_rope_interleave:
        first, second = head[..., 0::2], head[..., 1::2]
    else:
        first, second = head[..., : r // 2], head[..., r // 2 :]
    a, b = first * cos - second * sin, second * cos + first * sin
    if config.index_rope_interleave:
        rotated = torch.stack((a, b), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((a, b), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


class Indexer(nn.Module):
    """The lightning indexer: parameters named as HF names them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        heads, width, n = config.index_n_heads, config.index_head_dim, config.hidden_size
        self.wq_b = nn.Linear(config.q_lora_rank, heads * width, bias=False)
        self.wk = nn.Linear(n, width, bias=False)
        self.k_norm = nn.LayerNorm(width, eps=1e-6)
        self.weights_proj = nn.Linear(n, heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
        """I (batch, seq, seq), -inf past each query."""
        c = self.config
        batch, seq, _ = x.shape
        heads, width = c.index_n_heads, c.index_head_dim
        q = self.wq_b(q_latent).view(batch, seq, heads, width).transpose(1, 2)
        acc = torch.promote_types(x.dtype, torch.float32)
        q = rotate_first(q, c).to(acc)
        k = rotate_first(self.k_norm(self.wk(x)), c).to(acc)
        relu = torch.relu(torch.einsum("bhsd,btd->bhst", q, k) / width**0.5)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).to(acc) / heads**0.5
        scores = (w.transpose(1, 2)[..., None] * relu).sum(1)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        return scores.masked_fill(~causal, float("-inf"))


class IndexedAttention(mla_reference.LatentAttention):
    """MLA over its indexer's top-K; records the selection (``keep``), its heads' mean
    distribution (``probs``) and its indexer's scores (``scores``) of the last forward."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.indexer = Indexer(config)
        self.last: dict[str, torch.Tensor] = {}

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, seq) bool: the indexer's top-K of each query, causal."""
        c = self.config
        q_latent = self.q_a_layernorm(self.q_a_proj(x)).detach()
        scores = self.indexer(x.detach(), q_latent)
        seq = x.shape[1]
        top = scores.detach().topk(c.selected(seq), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
        keep = keep & torch.ones(seq, seq, dtype=torch.bool).tril()
        self.last["scores"] = scores.masked_fill(~keep, float("-inf"))
        return keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        keep = self.keep(x)
        self.last["keep"] = keep
        q, k, v = self.heads(x)
        scores = ((q @ k.transpose(-2, -1)) * self.scale()).masked_fill(~keep[:, None], -torch.inf)
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
        self.last["probs"] = probs.mean(1).detach()
        out = probs.to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def indexer_loss(self, target: torch.Tensor) -> torch.Tensor:
        """Sum over queries of KL(target || softmax(scores over the selection)), over the
        tokens; ``target`` (batch, seq, seq), 0 outside the selection."""
        log_q = F.log_softmax(self.last["scores"], -1)
        log_q = log_q.masked_fill(~self.last["keep"], 0.0)
        kl = torch.xlogy(target, target) - target * log_q
        return kl.sum() / (target.shape[0] * target.shape[1])


class SharedIndexAttention(IndexedAttention):
    """MLA over its leader's selection (``leader``, set by ``DSAReference``); no indexer."""

    def __init__(self, config: Any) -> None:
        mla_reference.LatentAttention.__init__(self, config)
        self.last = {}
        self.leaders: list[IndexedAttention] = []  # a list: not a submodule

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaders[0].last["keep"]


class DSAReference(SigmoidMoEReference):
    """DeepSeek V3's decoder reference with sparse attention: each shared-index layer
    follows the nearest earlier indexed one; ``model(rounds)`` adds the indexer losses
    (each leader's towards its group's mean distribution) to the balance terms."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.groups: list[list[IndexedAttention]] = []
        for block in self.blocks():
            attention = block.self_attn
            if isinstance(attention, SharedIndexAttention):
                attention.leaders.append(self.groups[-1][0])
                self.groups[-1].append(attention)
            else:
                self.groups.append([attention])

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        super().init_weights(generator, std)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def indexer_losses(self) -> torch.Tensor:
        """The last forward's indexer losses, summed over the groups."""
        total = torch.zeros(())
        for leader, *followers in self.groups:
            members = [leader, *followers]
            target = sum(m.last["probs"] for m in members) / len(members)
            total = total + leader.indexer_loss(target)
        return self.config.index_loss_coef * total

    def forward(self, rounds: list[tuple[torch.Tensor, torch.Tensor]]):
        c = self.config
        self.loads = [torch.zeros(c.num_experts) for _ in self.routers()]
        losses, terms = [], 0.0
        for tokens, targets in rounds:
            losses.append(self._cross_entropy(tokens, targets))
            for i, router in enumerate(self.routers()):
                ids = router.last[1].reshape(-1).cpu()
                self.loads[i] += torch.bincount(ids, minlength=c.num_experts).float()
                terms = terms + router.balance() / len(rounds)
            terms = terms + self.indexer_losses() / len(rounds)
        return losses, terms
