"""Stock PyTorch Llama-style decoders (Llama 3, Qwen 3), their mixture-of-experts kin
(OLMoE, Qwen 3 MoE) and Qwen 3.5's hybrid (Gated DeltaNet layers through ``fla``'s
chunked kernel on CUDA, gated full attention with partial rotary), dense or with routed
and shared experts: the models a user would
write to train a family's preset without dataflow, for ``benchmarks/compare.py``'s stock
rows.

The math is the family's (``dataflow_training.kit``: its reference model is the truth
``tests/benchmarks/test_compare_models.py`` holds these to), written the way stock
training code is: ``F.scaled_dot_product_attention`` with ``is_causal`` and
``enable_gqa`` (flash attention on the GPU), the rotary tables built once for the
sequence length, per-head (Qwen 3) or whole-projection (OLMoE) q/k RMSNorm, SwiGLU, a
tied or untied output projection, full-vocabulary logits with ``F.cross_entropy``.

The routed FFN sorts the token slots by expert and runs each projection as one grouped
GEMM (``torch._grouped_mm`` for bfloat16 CUDA tensors, where torch has it; a loop over
the experts elsewhere), then adds the weighted rows back per token. The objective adds
the family's router terms over the step (here one round): the load balance
``router_aux_loss_coef * E * sum_e f_e * P_e`` from the routed slots ``f`` and router
probabilities ``P`` pooled over the layers, and the router z-loss
``router_z_loss_coef / L * sum_l mean(logsumexp(logits_l)^2)`` (``kit/moe.py``).

Parameter names are the reference's ``state_dict`` keys (``emb.embed_tokens.weight``,
``0.self_attn.q_proj.weight``, ``0.mlp.experts.gate_up_proj``, ``head.lm_head.weight``), so
a reference state loads as is. DeepSeek V3, V3.2 and GLM 5 (multi-head latent attention)
are ``stock_deepseek.StockDeepseek``, this decoder with their blocks (``decoder_type``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from dataflow_training.kit import GatedDeltaNet as LinearAttentionPart
from dataflow_training.kit import MLAFields, linear_attention_reference, moe_reference
from dataflow_training.kit import decoder_reference as reference
from dataflow_training.kit.decoder_reference import inverse_frequencies
from torch import nn

from benchmarks.harness.stock import padded, vocab_loss


class RMSNorm(reference.RMSNorm):
    """The reference's norm (same parameter, scaling by ``offset + w``) through the fused
    ``F.rms_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + self.offset if self.offset else self.weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


def tables_of(
    frequencies: torch.Tensor, seq_len: int, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` of (seq_len, frequencies): position x frequency (the
    float64 ``frequencies``), times ``factor``."""
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * frequencies
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def rotary_tables(
    config: Any, seq_len: int, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` of (seq_len, rotary_dim / 2): position x frequency
    (``rotary_dim`` default all of ``head_dim``)."""
    with torch.device("cpu"):  # the tables are made on the host, whatever device builds
        return tables_of(inverse_frequencies(config, rotary_dim), seq_len)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, dim): pairs (i, i + r/2) of the first ``r = 2 *
    cos.shape[-1]`` dims by position x frequency, the rest as they are (partial rotation)."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)


class Attention(reference.Attention):
    """The reference's projections and q/k norms (its parameter names), attention through
    SDPA with the rotary tables made once for the step."""

    norm_type = RMSNorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.gated:  # per head: the query, then its gate (Qwen3-Next, Qwen 3.5)
            q, gate = q.view(batch, seq, c.num_attention_heads, 2 * c.head_dim).chunk(2, -1)
            q, gate = q.reshape(batch, seq, c.q_width), gate.reshape(batch, seq, c.q_width)
        if self.qk_norm == "projection":  # OLMoE: over the whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, c.num_attention_heads, c.head_dim)
        k = k.view(batch, seq, c.num_key_value_heads, c.head_dim)
        if self.qk_norm == "head":  # Qwen 3: per head, one weight for all heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if self.window is not None and self.window < seq:
            raise NotImplementedError("the stock decoder runs causal attention without a window")
        grouped = c.num_key_value_heads != c.num_attention_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        out = out.transpose(1, 2).reshape(batch, seq, c.q_width)
        return self.o_proj(out * torch.sigmoid(gate) if self.gated else out)


class GatedDeltaNet(linear_attention_reference.GatedDeltaNet):
    """The reference's Gated DeltaNet (its parameter names), its recurrence ``fla``'s
    chunked kernel on CUDA where ``fla`` is installed (what HF's Qwen 3.5 calls there),
    else the reference's loop."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().forward(x)

    def rule(self, q, k, v, g, beta) -> torch.Tensor:
        if q.is_cuda and importlib.util.find_spec("fla") is not None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta)[0]
        return super().rule(q, k, v, g, beta)


MLP = reference.MLP  # the dense SwiGLU FFN, as stock code writes it


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times each expert's ``weight[e]`` (E, out, in)
    transposed; ``ends`` (E,) int32 where each expert's rows end."""
    if hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    parts = [rows @ w.t() for rows, w in zip(x.split(counts), weight.unbind(0), strict=True)]
    return torch.cat(parts)


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many token slots chose each expert: a scatter-add into ``experts`` counters
    (a shape torch.compile knows ahead, unlike ``bincount``'s)."""
    flat = ids.flatten()
    return torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def routed(
    flat: torch.Tensor, experts: nn.Module, ids: torch.Tensor, weights: torch.Tensor, count: int
) -> torch.Tensor:
    """The routed SwiGLU experts (``experts.gate_up_proj`` (E, 2 inner, n) and
    ``experts.down_proj`` (E, n, inner)) of every token slot of ``flat`` (tokens, n):
    the slots ``ids`` (tokens, k) sorted by expert, each projection one grouped GEMM,
    the rows times their ``weights`` (tokens, k) added back per token."""
    order = ids.flatten().argsort(stable=True)
    token = order // ids.shape[-1]
    ends = expert_counts(ids, count).cumsum(0).to(torch.int32)
    gate, up = grouped_mm(flat[token], experts.gate_up_proj, ends).chunk(2, dim=-1)
    rows = grouped_mm(F.silu(gate) * up, experts.down_proj, ends)
    rows = rows * weights.flatten()[order, None].to(rows.dtype)
    return torch.zeros_like(flat).index_add(0, token, rows)


class Experts(moe_reference.Experts):
    """The reference's routed SwiGLU FFN and router parameters (and its shared expert,
    Qwen 3.5 MoE's), the experts run as grouped GEMMs; ``last`` keeps (router logits,
    expert ids) of the latest forward for the router terms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, c.hidden_size)
        logits = self.gate(flat)
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        self.last = (logits, ids)
        out = routed(flat, self.experts, ids, top, c.num_experts)
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class Block(nn.Module):
    """The family's block kind of ``layer``: its norms (scaling by ``offset + w``), its
    attention (softmax or Gated DeltaNet, under the part's module name) and FFN."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        block = config.architecture.block_of(config, layer)  # the family's settings
        part, offset = block.attention, block.norm.offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset)
        self.mixer = part.module  # ``self_attn`` or ``linear_attn``, the reference's names
        self.add_module(part.module, self.make_attention(config, part))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset)
        self.mlp = self.make_ffn(config, block.ffn)

    def make_attention(self, config: Any, part: Any) -> nn.Module:
        """The stock module of the attention part ``part``."""
        if isinstance(part, LinearAttentionPart):
            return GatedDeltaNet(config)
        return Attention(config, **part.reference_args(config))

    def make_ffn(self, config: Any, part: Any) -> nn.Module:
        """The stock module of the FFN part ``part``."""
        if is_moe(config):
            shared = part.shared
            return Experts(config, **(shared.reference_args(config) if shared else {}))
        return MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.get_submodule(self.mixer)(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


Embed = reference.Embed


class Head(reference.Head):
    """The reference's final norm (fused) and output projection."""

    norm_type = RMSNorm


def is_moe(config: Any) -> bool:
    return hasattr(config, "num_experts")


class StockDecoder(nn.Module):
    """``model(tokens, targets)`` -> the step's objective: the mean cross-entropy, plus the
    router terms for a mixture-of-experts config. ``checkpoint`` puts every block under
    ``torch.utils.checkpoint``. A sibling family's model (``decoder_type``) overrides the
    parts that differ: its ``block_type``, its rotary ``tables`` and its objective's
    ``terms``."""

    #: the module of each layer
    block_type: type[nn.Module] = Block

    def __init__(
        self,
        config: Any,
        seq_len: int,
        *,
        checkpoint: bool = False,
        vocab_multiple: int = 1,
        cce: bool = False,
    ) -> None:
        super().__init__()
        self.config, self.checkpoint, self.cce = config, checkpoint, cce
        # the token table and output projection padded (``stock.StockTricks``)
        stored = config.with_overrides(vocab_size=padded(config.vocab_size, vocab_multiple))
        self.emb = Embed(stored)
        for layer in range(config.num_hidden_layers):
            self.add_module(str(layer), self.block_type(config, layer))
        self.head = Head(stored, config.architecture.norm.offset)
        cos, sin = self.tables(seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.init_weights()

    def blocks(self) -> list[Block]:
        return [self.get_submodule(str(layer)) for layer in range(self.config.num_hidden_layers)]

    def tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos`` and ``sin`` of every position (``rotary_tables``, over the
        attention layers' rotated dims)."""
        rotated = {b.self_attn.rotary_dim for b in self.blocks() if b.mixer == "self_attn"}
        return rotary_tables(self.config, seq_len, *rotated)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Every matrix N(0, std), norms 1 (HF's initialization of these models); the
        vocabulary's padded rows zero."""
        for param in self.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            else:
                param.fill_(1.0)
        for module in self.modules():  # norms scaling by 1 + w start at w = 0
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0 - module.offset)
        self.emb.embed_tokens.weight[self.config.vocab_size :].zero_()
        self.output_weight()[self.config.vocab_size :].zero_()

    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.emb.embed_tokens.weight
        return self.head.lm_head.weight

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final norm's output (batch, seq, hidden)."""
        seq = tokens.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x = self.emb.embed_tokens(tokens)
        for block in self.blocks():
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head.norm(x)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The real vocabulary's logits (the padded columns sliced off)."""
        vocab = self.config.vocab_size
        return (self.hidden(tokens) @ self.output_weight().t())[..., :vocab]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        weight, vocab = self.output_weight(), self.config.vocab_size
        return vocab_loss(self.hidden(tokens), weight, vocab, targets, self.cce) + self.terms()

    def terms(self) -> torch.Tensor | float:
        """The objective's terms beside the cross-entropy, of the latest forward: a
        mixture-of-experts config's router terms, else none (0)."""
        return self.router_terms() if is_moe(self.config) else 0.0

    def router_terms(self) -> torch.Tensor:
        """Load balance and z-loss of the latest forward (the step's one round): the
        balance from the routed slots and router probabilities pooled over the layers,
        the z-loss averaged over them (``kit/moe.py``)."""
        c = self.config
        routers = [block.mlp.last for block in self.blocks()]
        counts = sum(expert_counts(ids, c.num_experts).float() for _, ids in routers)
        probs = torch.cat([torch.softmax(logits.float(), dim=-1) for logits, _ in routers])
        per_token = counts / (counts.sum() / c.num_experts_per_tok)  # sums to k
        balance = c.router_aux_loss_coef * c.num_experts * (per_token * probs.mean(0)).sum()
        z = sum(torch.logsumexp(logits.float(), dim=-1).pow(2).mean() for logits, _ in routers)
        return balance + c.router_z_loss_coef * z / len(routers)


def active_fraction(config: Any, name: str) -> float:
    """The share of parameter ``name`` one token's matrix products use: ``k / E`` for
    routed experts, 1 otherwise."""
    if is_moe(config) and ".experts." in name:
        return config.num_experts_per_tok / config.num_experts
    return 1.0


def decoder_type(config: Any) -> type[StockDecoder]:
    """The stock model of a decoder family's ``config``: ``StockDecoder``, or for multi-head
    latent attention (DeepSeek V3, V3.2, GLM 5) ``stock_deepseek.StockDeepseek``."""
    if isinstance(config, MLAFields):
        from benchmarks.harness.stock_deepseek import StockDeepseek

        return StockDeepseek
    return StockDecoder


def matmul_params(config: Any) -> float:
    """Parameters one token multiplies by (the token embedding is a lookup unless it is
    also the output projection), routed experts at their active share."""
    with torch.device("meta"):
        model = decoder_type(config)(config, 1)
    total = 0.0
    lookup = "" if config.tie_word_embeddings else "emb.embed_tokens.weight"
    for name, param in model.named_parameters():
        if param.dim() < 2 or name == lookup:
            continue
        total += param.numel() * active_fraction(config, name)
    return total
