"""GPT-2's math, composed of the kit's parts: embed, block, head.

- the embedding: the token table ``wte`` and learned positions ``wpe`` (the kit's
  ``DecoderEmbed`` with ``LearnedPositions``);
- the block: the kit's pre-norm ``Block`` of LayerNorms ``ln_1`` and ``ln_2``, GPT-2's
  attention (``FusedQKVAttention``: the fused ``c_attn`` and ``c_proj``, with biases) and
  its MLP (``GELUFFN``: ``c_fc``, the tanh GELU and ``c_proj``, with biases);
- the head: the final LayerNorm ``ln_f`` and the logits against the tied ``wte``.

``wte`` is stored padded (``GPT2Config.vocab_multiple``: 50,257 rows as 50,304, zero past
the vocabulary); the head leaves the padded logits out of its softmax.

Every op with a kernel (linear, the norms, attention, GELU, the chunked cross-entropy) is
called through ``env.ops``.

What a block saves for backward (the contents of ``A_<layer>``), per token:

- ``qkv``   (3 * n_embd): the attention input, ``c_attn(ln_1(x))``;
- ``attn``  (n_embd): the attention output before ``c_proj`` (its backward needs it);
- ``lse``   (n_head, float32): the attention's logsumexp;
- ``h_mid`` (n_embd): the residual stream between the sublayers, ``x + attn(x)``;
- ``fc``    (4 * n_embd): the MLP's pre-activation, ``c_fc(ln_2(h_mid))``.

That is ``9 * n_embd`` activation values plus ``n_head`` floats per token: 13,872 bytes
per token for GPT-2 124M in bf16, where autograd keeps about ``16 * n_embd`` values (x,
ln_1(x), qkv, the attention output, h_mid, ln_2(h_mid), fc and gelu(fc)). With them,
backward runs no projection and no attention forward again: it recomputes only
elementwise work (the two layer norms from ``x`` and ``h_mid``, GELU from ``fc``) and
calls the fused backward kernels (``attention_bwd`` with the saved logsumexp,
``layer_norm_bwd``, ``gelu_bwd``); every projection's gradients are ``linear`` calls.

The block offers one partial save, ``mlp``: forward keeps ``qkv``, ``attn``, ``lse`` and
``h_mid`` (5 * n_embd values and the logsumexp a token: the attention's, costly to
derive) and ``rederive`` makes ``fc`` again from ``h_mid`` (``ln_2`` and ``c_fc``: about a
third of the forward's matmul FLOPs and no attention), freeing 4 of the 9 * n_embd.

No dropout anywhere (see ``config.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch
from dataflow_training.kit import (
    GELUFFN,
    Block,
    DecoderEmbed,
    Env,
    FusedQKVAttention,
    LayerCost,
    LearnedPositions,
    Norm,
    Work,
    head_cost,
    lm_head_loss,
)

from dataflow_family_gpt2.config import GPT2Config

Tensors = dict[str, torch.Tensor]

#: GPT-2's norms: LayerNorm with a bias, epsilon ``layer_norm_epsilon``
LAYER_NORM = Norm("layer", eps="layer_norm_epsilon")


@dataclasses.dataclass(frozen=True)
class GPT2Embed(DecoderEmbed):
    """``wte[tokens] + wpe[position]``; ``wte``'s gradient the rows of the round's tokens
    (``RowGradient``), ``wpe``'s a table of the positions."""

    weight: str = "wte"
    positions: LearnedPositions | None = LearnedPositions("wpe", length="n_positions")


@dataclasses.dataclass(frozen=True)
class GPT2Block(Block):
    """Pre-norm block: ``h = x + attn(ln_1(x))``, ``y = h + mlp(ln_2(h))``.

    Its activation bytes are GPT-2's own count, coarser than the kit block's: forward
    reads ``x``, writes ``y`` and the 9 * n_embd saved values and reads 8 * n_embd of them
    back (``qkv``, ``attn``, ``fc``; not ``h_mid``); backward twice that; recompute reads
    ``x`` and writes the saved values, reading none back. (The kit's block also counts
    ``h_mid`` read back in forward, and the attention's saved values and ``h_mid`` read
    back in recompute.) Its FLOPs are the kit block's."""

    attention: Any = FusedQKVAttention()
    ffn: Any = GELUFFN(width="n_inner")
    norm: Norm = LAYER_NORM
    norm_names: tuple[str, str] = ("ln_1", "ln_2")

    def cost(self, config: GPT2Config, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        work = super().cost(config, batch, seq_len, act_bytes)
        tokens, n = batch * seq_len, config.n_embd
        activations = tokens * act_bytes * (2 * n + 9 * n + 8 * n)
        return attrs.evolve(
            work,
            forward=Work(work.forward.flops, activations),
            backward=Work(work.backward.flops, 2 * activations),
            recompute=Work(work.recompute.flops, tokens * act_bytes * 10 * n),
        )


class GPT2Head:
    """Final layer norm, logits against the tied ``wte`` chunk by chunk, mean loss."""

    def forward_backward(
        self, config: GPT2Config, params: Tensors, x: torch.Tensor, targets: Any, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
        norm = LAYER_NORM.op(config, "ln_f")
        return lm_head_loss(
            env, params, x, targets, norm=norm, projection="wte", vocab=config.vocab_size
        )

    def cost(self, config: GPT2Config, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        return head_cost(config, batch, seq_len, act_bytes)


#: every op the math calls through ``env.ops``
OPS = (*GPT2Block().ops, "chunked_cross_entropy")


def math_of(kind: str) -> Any:
    """The math object of a layer kind (``embed``, ``block``, ``head``)."""
    kinds = {"embed": GPT2Embed, "block": GPT2Block, "head": GPT2Head}
    if kind not in kinds:
        raise KeyError(f"gpt2 has no layer kind {kind!r}; its kinds: {', '.join(kinds)}")
    return kinds[kind]()
