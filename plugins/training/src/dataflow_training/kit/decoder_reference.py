"""A Llama-style decoder (``decoder.py``) as one plain-autograd ``nn.Module``: the truth the
kit's decoder math is checked against, shared by the families built on it (Llama 3, Qwen 3,
and with ``moe_reference``'s experts OLMoE and Qwen 3 MoE).

Isolated on purpose: it imports only torch and shares no code with the kit's math (no
``ops``, no rotary tables of ``rotary.py``: the frequencies, Llama 3's scaling, the
rotation, the norms and the softmax of masked scores are all written out again here), so
a bug in a kernel or in a hand-written backward cannot hide in it. It is itself checked
against ``transformers`` (``LlamaForCausalLM``, ``Qwen3ForCausalLM``) by each family's HF
tests. Its ``state_dict()`` keys are the layers' ``f"{layer}.{param}"`` names
(``emb.embed_tokens.weight``, ``0.self_attn.q_proj.weight``, ``head.norm.weight``, and
``head.lm_head.weight`` unless the output projection is the embedding). No dropout.

Each block is built by the part that declares it (``DecoderReference.make_block`` asks the
config's architecture, ``config.architecture.reference_block(config, layer)``): a part
passes its settings to these modules as plain values (``Attention(config, qk_norm="head",
window=4)``), and never its code. GPT-2's parts (fused attention with biases, the GELU
MLP) have their modules here too (``FusedAttention``, ``GELUMLP``), checked against
``GPT2LMHeadModel`` by the gpt2 family's tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def inverse_frequencies(config: Any, rotary_dim: int | None = None) -> torch.Tensor:
    """float64 RoPE frequencies of ``config`` over the first ``rotary_dim`` of each head
    (default all of ``head_dim``), with Llama 3's scaling where it has one: wavelengths
    longer than ``original / low_freq_factor`` are divided by ``factor``, shorter than
    ``original / high_freq_factor`` kept, and the band between blended."""
    dim, scaling = rotary_dim or config.head_dim, config.rope_scaling
    inv = config.rope_theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling is None:
        return inv
    original = scaling.original_max_position
    out = []
    for freq in inv.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / scaling.high_freq_factor:
            out.append(freq)
        elif wavelength > original / scaling.low_freq_factor:
            out.append(freq / scaling.factor)
        else:
            smooth = (original / wavelength - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def rotate(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, dim) by position: pairs (i, i + r/2) of the first
    ``r = 2 * len(inv)`` dims, angle pos * inv_i; the dims past ``r`` pass unrotated."""
    half = inv.numel()
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = angles.cos().to(x), angles.sin().to(x)
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)


def window_mask(seq: int, window: int) -> torch.Tensor:
    """(seq, seq) bool, True where query i sees key j: causal, and at most ``window``
    tokens back counting itself (``i - window < j <= i``, HF's sliding window)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    return (j <= i) & (j > i - window)


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``; ``offset`` 1 for norms stored as ``w`` for ``1 + w``."""

    def __init__(self, width: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight + self.offset if self.offset else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


class Embed(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


class Attention(nn.Module):
    """Grouped-query self-attention, causal. ``qk_norm``: None, ``"head"`` (an RMSNorm over
    each head, one ``head_dim`` weight: Qwen 3) or ``"projection"`` (over the whole q and
    k projections: OLMoE), before the rotation; ``qk_norm_offset``: its norms scale by
    ``offset + w``. ``window``: None, or the tokens a query sees counting itself (a
    sliding window). ``rotary_dim``: the rotated dims of each head (default all).
    ``gated``: ``q_proj`` makes each head's query and then its gate (``head_dim`` each),
    and ``o_proj`` takes the attention's output times ``sigmoid(gate)`` (Qwen3-Next).
    ``mask``: None, or a function of the sequence length giving the (seq, seq) bool pairs
    a query may see beside causal and the window (None: no more cut)."""

    #: the q/k norms' module (a subclass with another forward may keep these parameters)
    norm_type = RMSNorm

    def __init__(
        self,
        config: Any,
        *,
        qk_norm: str | None = None,
        qk_norm_offset: float = 0.0,
        window: int | None = None,
        rotary_dim: int | None = None,
        gated: bool = False,
        mask: Any = None,
    ) -> None:
        super().__init__()
        self.config, self.qk_norm, self.window, self.gated = config, qk_norm, window, gated
        self.mask = mask
        self.rotary_dim = rotary_dim or config.head_dim
        n, q, kv = config.hidden_size, config.q_width, config.kv_width
        self.q_proj = nn.Linear(n, 2 * q if gated else q, bias=False)
        self.k_proj = nn.Linear(n, kv, bias=False)
        self.v_proj = nn.Linear(n, kv, bias=False)
        self.o_proj = nn.Linear(q, n, bias=False)
        self.per_head = qk_norm == "head"
        if qk_norm is not None:
            self.q_norm = self.norm_type(
                config.head_dim if self.per_head else q, config.rms_norm_eps, qk_norm_offset
            )
            self.k_norm = self.norm_type(
                config.head_dim if self.per_head else kv, config.rms_norm_eps, qk_norm_offset
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor, count: int, norm: Any) -> torch.Tensor:
            if norm is not None and not self.per_head:  # OLMoE: over the whole projection
                t = norm(t)
            t = t.view(batch, seq, count, c.head_dim)
            return (norm(t) if norm is not None and self.per_head else t).transpose(1, 2)

        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q = self.q_proj(x)
        if self.gated:  # per head: the query, then its gate
            q, gate = q.view(batch, seq, c.num_attention_heads, 2 * c.head_dim).chunk(2, -1)
            q, gate = q.reshape(batch, seq, c.q_width), gate.reshape(batch, seq, c.q_width)
        q = heads(q, c.num_attention_heads, q_norm)
        k = heads(self.k_proj(x), c.num_key_value_heads, k_norm)
        v = heads(self.v_proj(x), c.num_key_value_heads, None)
        inv = inverse_frequencies(c, self.rotary_dim)
        q, k = rotate(q, inv), rotate(k, inv)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # stock PyTorch attention: in float64 (the truth of verify's checks) SDPA runs its
        # math kernel, softmax(q k^T / sqrt(d)) v as written; in bf16 on a GPU the fused
        # kernels a stock run uses, so the bf16 yardstick is stock training's rounding
        cut = None if self.mask is None else self.mask(seq)
        if cut is None and (self.window is None or self.window >= seq):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = window_mask(seq, self.window if self.window is not None else seq)
            mask = (mask if cut is None else mask & cut).to(x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch, seq, c.q_width)
        return self.o_proj(out * torch.sigmoid(gate) if self.gated else out)


class MLP(nn.Module):
    """SwiGLU of width ``width`` (default ``intermediate_size``)."""

    def __init__(self, config: Any, width: int | None = None) -> None:
        super().__init__()
        n, inner = config.hidden_size, width or config.intermediate_size
        self.gate_proj = nn.Linear(n, inner, bias=False)
        self.up_proj = nn.Linear(n, inner, bias=False)
        self.down_proj = nn.Linear(inner, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedAttention(nn.Module):
    """Multi-head self-attention, causal, of one fused projection with biases (GPT-2's):
    ``c_proj(attention(q, k, v))`` of ``q, k, v = c_attn(x).split(hidden_size)``, scaled by
    ``1 / sqrt(head_dim)``, no positions. Attention written out as the softmax of masked
    scores."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.n_head = config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, n_embd = x.shape
        head_dim = n_embd // self.n_head
        q, k, v = (
            part.view(batch, seq_len, self.n_head, head_dim).transpose(1, 2)
            for part in self.c_attn(x).split(n_embd, dim=-1)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq_len, n_embd)
        return self.c_proj(out)


class GELUMLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))`` of width ``width``, with biases (GPT-2's MLP)."""

    def __init__(self, config: Any, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, width)
        self.c_proj = nn.Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


#: the submodule names of a block (HF's Llama names)
BLOCK_NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class Block(nn.Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``h + mlp(
    post_attention_layernorm(h))``, of the modules it is given, registered under
    ``names`` (GPT-2's are ``ln_1``, ``attn``, ``ln_2``, ``mlp``)."""

    def __init__(
        self,
        norm_1: nn.Module,
        self_attn: nn.Module,
        norm_2: nn.Module,
        mlp: nn.Module,
        names: tuple[str, str, str, str] = BLOCK_NAMES,
    ) -> None:
        super().__init__()
        self.names = names
        for name, module in zip(names, (norm_1, self_attn, norm_2, mlp), strict=True):
            self.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm_1, attention, norm_2, ffn = (self.get_submodule(name) for name in self.names)
        x = x + attention(norm_1(x))
        return x + ffn(norm_2(x))


class Head(nn.Module):
    #: the final norm's module (as ``Attention.norm_type``)
    norm_type = RMSNorm

    def __init__(self, config: Any, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.norm = self.norm_type(config.hidden_size, config.rms_norm_eps, norm_offset)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DecoderReference(nn.Module):
    """``model(tokens, targets)`` -> mean cross-entropy over the scored tokens (targets
    other than -100; 0 when none is). Blocks are the submodules ``"0"`` ..
    ``"num_hidden_layers-1"``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.emb = Embed(config)
        for layer in range(config.num_hidden_layers):
            self.add_module(str(layer), self.make_block(config, layer))
        self.head = Head(config, config.architecture.norm.offset)
        self.init_weights()

    def make_block(self, config: Any, layer: int) -> nn.Module:
        """Block ``layer``, built from its parts' settings by the config's architecture."""
        return config.architecture.reference_block(config, layer)

    def blocks(self) -> list[Block]:
        return [self.get_submodule(str(layer)) for layer in range(self.config.num_hidden_layers)]

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """HF's initialization of these models: every matrix (and convolution kernel)
        N(0, std), norms 1 (their stored weight 0 where they scale by ``1 + w``)."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0 - module.offset)

    def output_weight(self) -> torch.Tensor:
        """The output projection (vocab, hidden): ``lm_head``'s, or the embedding when tied."""
        if self.config.tie_word_embeddings:
            return self.emb.embed_tokens.weight
        return self.head.lm_head.weight

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        x = self.emb.embed_tokens(tokens)
        for block in self.blocks():
            x = block(x)
        return self.head.norm(x) @ self.output_weight().t()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens).flatten(0, 1)
        flat = targets.flatten()
        loss_sum = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum / (flat != IGNORE_INDEX).sum().clamp(min=1)
