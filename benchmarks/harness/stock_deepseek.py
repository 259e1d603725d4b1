"""Stock PyTorch DeepSeek V3, DeepSeek V3.2 and GLM 5 for ``benchmarks/compare.py``'s stock
rows of the deepseek_v3, deepseek_v32 and glm5 families: ``stock_decoder.StockDecoder``
with their blocks, written the way stock training code is.

The math is the families' references' (``kit.mla_reference``, ``kit.dsa_reference``,
``kit.sigmoid_moe_reference``, which ``tests/benchmarks/test_compare_models.py`` holds
these to); the modules here subclass theirs, keeping their parameters and names, and
override what stock code does otherwise:

- **MLA**: q through its low-rank latent and RMSNorm (or ``q_proj`` where
  ``q_lora_rank`` is None), k and v from the compressed latent and the shared rope key,
  the rope dims rotated by tables made once for the sequence length (the reference's
  frequencies and YaRN factor), attention through
  ``F.scaled_dot_product_attention(is_causal=True)`` (q and k heads wider than v's in
  DeepSeek's shapes: SDPA takes them, by a kernel other than flash attention, which
  needs one width).
- **DSA** (V3.2, GLM 5): the lightning indexer computed as the reference computes it, op
  for op (its top-K is the reference's), by the same tables; the selection and causality
  a boolean mask of dense SDPA (as transformers' ``DeepseekV32Attention`` masks its
  eager and SDPA paths). The indexer's KL loss needs the heads' mean attention
  distribution over the selection, which SDPA does not return: it is made again from q
  and k without gradient (as Megatron-LM's ``compute_dsa_indexer_loss`` does). GLM 5's
  shared-index layers attend to their leader's selection and join its KL target.
- **MoE**: the reference's router (sigmoid scores, the selection bias, group-limited
  top-k, routed scaling) and shared expert, the routed experts as grouped GEMMs
  (``stock_decoder.routed``); the first ``first_k_dense_replace`` layers the dense
  SwiGLU.

The objective is the reference's over a step of one round: the mean cross-entropy, every
MoE layer's sequence-wise balance loss and the indexer losses. The selection bias is a
parameter without gradient; the reference's sign-rule update of it between steps
(``apply_rules``) is no part of the stock step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from dataflow_training import kit
from dataflow_training.kit import dsa_reference, mla_reference, sigmoid_moe_reference
from torch import nn

from benchmarks.harness import stock_decoder
from benchmarks.harness.stock_decoder import MLP, StockDecoder, apply_rotary, routed, tables_of


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``r = 2 * cos.shape[-1]`` dims of (..., seq, dim) by position,
    pairs interleaved ``(x0, x1), (x2, x3), ..`` and left so, or half-split ``(i, i +
    r/2)`` (``apply_rotary``); the dims past ``r`` as they are."""
    if not interleaved:
        return apply_rotary(x, cos, sin)
    r = 2 * cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    first, second = x[..., 0:r:2], x[..., 1:r:2]
    pairs = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((pairs.flatten(-2), x[..., r:]), dim=-1)


def causal(seq: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bool, True where query i sees key j <= i."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()


class LatentAttention(mla_reference.LatentAttention):
    """The reference's MLA (its parameters and softmax scale), rotated by the step's
    tables, attending through SDPA."""

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v (batch, heads, seq, width), rotated, and the normed query latent (None
        without one)."""
        c = self.config
        batch, seq, _ = x.shape
        heads, nope, interleaved = c.num_attention_heads, c.qk_nope_head_dim, c.rope_interleave
        q_latent = None if c.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q = q.view(batch, seq, heads, -1).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            (c.kv_lora_rank, c.qk_rope_head_dim), dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, heads, -1)
        kv = kv.transpose(1, 2)
        k_rope = rotate_pairs(k_rope, cos, sin, interleaved)[:, None].expand(-1, heads, -1, -1)
        q = torch.cat((q[..., :nope], rotate_pairs(q[..., nope:], cos, sin, interleaved)), -1)
        return q, torch.cat((kv[..., :nope], k_rope), dim=-1), kv[..., nope:], q_latent

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v, _ = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale())
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Indexer(dsa_reference.Indexer):
    """The reference's lightning indexer, its parameters and its scores' ops in the
    reference's order, rotated by the step's tables, its causal mask made where its input
    is."""

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """I (batch, seq, seq), -inf past each query."""
        c = self.config
        batch, seq, _ = x.shape
        heads, width, interleaved = c.index_n_heads, c.index_head_dim, c.index_rope_interleave
        q = self.wq_b(q_latent).view(batch, seq, heads, width).transpose(1, 2)
        acc = torch.promote_types(x.dtype, torch.float32)
        q = rotate_pairs(q, cos, sin, interleaved).to(acc)
        k = rotate_pairs(self.k_norm(self.wk(x)), cos, sin, interleaved).to(acc)
        relu = torch.relu(torch.einsum("bhsd,btd->bhst", q, k) / width**0.5)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).to(acc) / heads**0.5
        scores = (w.transpose(1, 2)[..., None] * relu).sum(1)
        return scores.masked_fill(~causal(seq, x.device), float("-inf"))


@torch.no_grad()
def attention_target(
    q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """The heads' mean attention distribution (batch, seq, seq) over ``keep``, at least
    float32: the indexer loss's target, made again from q and k."""
    scores = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~keep[:, None], -torch.inf)
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1).mean(1)


class IndexedAttention(LatentAttention, dsa_reference.IndexedAttention):
    """The reference's MLA over its indexer's top-K (its parameters, its ``last`` and its
    ``indexer_loss``), the selection a boolean mask of SDPA."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.indexer = Indexer(config)  # the reference's parameters, by the step's tables

    def select(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """(batch, seq, seq) bool: the indexer's top-K of each query, causal; the
        indexer's scores over them kept for its loss."""
        seq = x.shape[1]
        scores = self.indexer(x.detach(), q_latent.detach(), cos, sin)
        top = scores.detach().topk(self.config.selected(seq), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
        keep = keep & causal(seq, x.device)
        self.last["scores"] = scores.masked_fill(~keep, float("-inf"))
        return keep

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v, q_latent = self.project(x, cos, sin)
        keep = self.last["keep"] = self.select(x, q_latent, cos, sin)
        scale = self.scale()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], scale=scale)
        self.last["probs"] = attention_target(q, k, keep, scale)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class SharedIndexAttention(IndexedAttention, dsa_reference.SharedIndexAttention):
    """The reference's shared-index MLA (no indexer; ``leaders``, set by the model),
    attending through its leader's selection."""

    def __init__(self, config: Any) -> None:
        dsa_reference.SharedIndexAttention.__init__(self, config)

    def select(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        return self.leaders[0].last["keep"]


class SigmoidExperts(sigmoid_moe_reference.SigmoidExperts):
    """The reference's sigmoid-routed experts (its parameters, its router ``route``, its
    shared expert), the routed ones as grouped GEMMs; the balance loss counted on the
    device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, c.hidden_size)
        scores, ids, weights = self.route(flat)
        self.last = (scores.view(*x.shape[:-1], -1), ids.view(*x.shape[:-1], -1))
        out = routed(flat, self.experts, ids, weights.to(flat.dtype), c.num_experts)
        return (out + self.shared_experts(flat)).view_as(x)

    def balance(self) -> torch.Tensor:
        """The reference's sequence-wise balance loss of the last forward, each
        sequence's expert counts a scatter-add."""
        c = self.config
        scores, ids = self.last
        batch, seq, e = scores.shape
        slots = ids.reshape(batch, -1)
        counts = scores.new_zeros(batch, e).scatter_add_(1, slots, scores.new_ones(slots.shape))
        f = counts * e / (c.num_experts_per_tok * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return c.seq_aux_loss_coef * (f * p).sum(-1).mean()


#: the stock module of each attention part of these families
ATTENTION: dict[type, type[LatentAttention]] = {
    kit.LatentAttention: LatentAttention,
    kit.IndexedAttention: IndexedAttention,
    kit.SharedIndexAttention: SharedIndexAttention,
}


class Block(stock_decoder.Block):
    """A block of these families: plain, indexed or shared-index MLA, and the sigmoid-routed
    experts or the dense SwiGLU, by its parts."""

    def make_attention(self, config: Any, part: Any) -> nn.Module:
        return ATTENTION[type(part)](config)

    def make_ffn(self, config: Any, part: Any) -> nn.Module:
        return SigmoidExperts(config) if isinstance(part, kit.SigmoidExperts) else MLP(config)


class StockDeepseek(StockDecoder):
    """``StockDecoder`` of these families' blocks: MLA's rope tables (shared by the
    indexers), every MoE layer's balance loss and the indexer losses in the objective.
    Each shared-index layer follows the leader its config's architecture names
    (``leaders``: the nearest earlier indexed layer, as ``DSAReference`` groups them)."""

    block_type = Block

    def __init__(self, config: Any, seq_len: int, **options: Any) -> None:
        super().__init__(config, seq_len, **options)
        #: each indexed layer -> its attention, then its followers'
        self.groups: dict[int, list[IndexedAttention]] = {}
        blocks = self.blocks()
        for layer, leader in enumerate(config.architecture.leaders(config)):
            attention = blocks[layer].self_attn
            if leader is not None:  # a shared-index layer, in its leader's group
                attention.leaders.append(self.groups[leader][0])
                self.groups[leader].append(attention)
            elif isinstance(attention, IndexedAttention):
                self.groups[layer] = [attention]

    def tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's rope ``cos`` and ``sin`` (the reference's frequencies, times YaRN's
        factor where the config has one)."""
        with torch.device("cpu"):  # the tables are made on the host, whatever device builds
            frequencies, factor = mla_reference.frequencies(self.config)
            return tables_of(frequencies, seq_len, factor)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """``StockDecoder``'s, with the references' zeros: the selection biases and the
        indexers' key-norm biases."""
        super().init_weights(std)
        for module in self.modules():
            if isinstance(module, sigmoid_moe_reference.Gate):
                module.e_score_correction_bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.bias.zero_()

    def terms(self) -> torch.Tensor | float:
        """Every MoE layer's sequence-wise balance loss and each indexed layer's KL loss
        towards its group's mean distribution, of the latest forward."""
        total = sum(b.mlp.balance() for b in self.blocks() if isinstance(b.mlp, SigmoidExperts))
        for leader, *followers in self.groups.values():
            members = [leader, *followers]
            target = sum(m.last["probs"] for m in members) / len(members)
            total = total + self.config.index_loss_coef * leader.indexer_loss(target)
        return total
