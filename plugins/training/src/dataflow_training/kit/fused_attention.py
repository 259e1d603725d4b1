"""GPT-2's attention, as a part of a block: causal multi-head self-attention of one fused
q/k/v projection with biases, no positions of its own (GPT-2's are learned, added by the
embedding: ``decoder_math.LearnedPositions``).

Like ``attention.SelfAttention`` it saves what its projection leaves (``qkv``), the
attention's output (``attn``) and its logsumexp (``lse``), so backward runs no projection
and no attention forward again; unlike it, nothing is rotated or normed in between, so
the saved ``qkv`` is split into heads as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dataflow_training.kit import decoder_reference
from dataflow_training.kit.attention import (
    attention_backward,
    attention_flops,
    attention_forward,
    merge_heads,
    split_heads,
)
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.parts import conv1d
from dataflow_training.step.family import TensorSpec

Tensors = dict[str, torch.Tensor]

C_ATTN = Linear("attn.c_attn.weight", "attn.c_attn.bias")
C_PROJ = Linear("attn.c_proj.weight", "attn.c_proj.bias")


@dataclasses.dataclass(frozen=True)
class FusedQKVAttention:
    """``c_proj(attention(q, k, v))`` of ``q, k, v = c_attn(h).split(hidden_size)``: causal,
    ``num_attention_heads`` heads of ``hidden_size / num_attention_heads``, scaled by
    ``1 / sqrt(head_dim)``; as GPT-2's ``GPT2Attention``.

    Parameters (HF's names and order): ``attn.c_attn.{weight,bias}`` (3 * hidden, hidden),
    ``attn.c_proj.{weight,bias}``; weights stored ``(out, in)``, biases without weight
    decay; HF stores the weights as ``Conv1D`` ``(in, out)``, so its key rules transpose
    them. Saved, per token: ``qkv`` (3 * hidden), ``attn`` (hidden), ``c_proj``'s input;
    ``lse`` (heads, float32). Its key bias's gradient is returned as the exact zero (the
    softmax cancels it). Cost: the projections' matmuls and causal ``attention_flops``."""

    ops = ("attention_fwd", "attention_bwd")
    #: the reference module's name in a block (HF's)
    module = "attn"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n = config.hidden_size
        return (
            TensorSpec(C_ATTN.weight, (3 * n, n)),
            TensorSpec(C_ATTN.bias, (3 * n,), decay=False),
            TensorSpec(C_PROJ.weight, (n, n)),
            TensorSpec(C_PROJ.bias, (n,), decay=False),
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        n = config.hidden_size
        return (
            TensorSpec("qkv", (batch, seq_len, 3 * n)),
            TensorSpec("attn", (batch, seq_len, n)),
            TensorSpec("lse", (batch, config.num_attention_heads, seq_len), dtype="float32"),
        )

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return conv1d(self.params(config), prefix)

    def reference(self, config: Any) -> Any:
        return decoder_reference.FusedAttention(config)

    # -- math ----------------------------------------------------------------------------
    def _heads(self, config: Any, qkv: torch.Tensor) -> list[torch.Tensor]:
        """q, k and v (batch, heads, seq, head_dim) as views of the projection ``qkv``."""
        heads = config.num_attention_heads
        return [split_heads(part, heads) for part in qkv.split(config.hidden_size, -1)]

    def project(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        """The fused projection of the normed input ``h``: ``qkv`` (saved as it is)."""
        return {"qkv": C_ATTN.forward(ops, params, h)}

    def attend(
        self, config: Any, params: Tensors, projected: Tensors, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        """(the attention's output after ``c_proj``, what it saves beside ``qkv``: ``attn``
        and ``lse``)."""
        q, k, v = self._heads(config, projected["qkv"])
        out, lse = attention_forward(ops, q, k, v, causal=True)
        attn = merge_heads(out)
        return C_PROJ.forward(ops, params, attn), {"attn": attn, "lse": lse}

    def backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        d_out: torch.Tensor,
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> tuple[torch.Tensor]:
        """The gradient of the projection ``qkv`` (``project``'s one output) from that of the
        output; ``c_proj``'s gradients go into ``grads``."""
        d_attn, g = C_PROJ.backward(ops, params, saved["attn"], d_out)
        grads.update(g)
        heads = config.num_attention_heads
        q, k, v = self._heads(config, saved["qkv"])
        dq, dk, dv = attention_backward(
            ops,
            split_heads(d_attn, heads),
            q,
            k,
            v,
            split_heads(saved["attn"], heads),
            saved["lse"],
            causal=True,
        )
        del d_attn
        return (torch.cat((merge_heads(dq), merge_heads(dk), merge_heads(dv)), dim=-1),)

    def project_backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        d_projected: tuple[torch.Tensor],
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> torch.Tensor:
        """``dh`` from the projection's gradient; ``c_attn``'s gradients go into ``grads``.

        The key bias adds ``q_i . b_k`` to every score of query row ``i``, which the row's
        softmax cancels: its gradient is exactly zero. Computed, it is rounding noise that
        Adam (which divides by the gradient's own size) would turn into learning-rate-sized
        steps, so it is returned as the exact zero."""
        d_h, g = C_ATTN.backward(ops, params, h, d_projected[0])
        n = config.hidden_size
        if C_ATTN.bias in g:  # none under LoRA: the bias is frozen with the base
            g[C_ATTN.bias][n : 2 * n] = 0
        grads.update(g)
        return d_h

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        """(the projections' FLOPs, the attention's) of one forward."""
        tokens, n = batch * seq_len, config.hidden_size
        return 2 * tokens * n * 4 * n, attention_flops(batch, seq_len, n, None)
