"""The math of a decoder's embedding and head (``decoder.py``); its blocks are composed of
parts (``block.Block``).

The embedding is ``embed_tokens.weight[tokens]`` (no positions: they are the attention's
part), its gradient the rows of the round's tokens. The head is the final RMSNorm, the
logits against ``lm_head.weight`` (the embedding's, when tied) chunk by chunk, and the
mean loss (``head.lm_head_loss``). Every op with a kernel goes through ``env.ops``.
"""

from __future__ import annotations

from typing import Any

import torch

from dataflow_training.kit.head import lm_head_loss
from dataflow_training.kit.linear import accumulation_dtype
from dataflow_training.step.family import Env, LayerCost, RowGradient, Work

Tensors = dict[str, torch.Tensor]

#: the embedding's weight, and the head's name for the output projection (tied or not)
EMBED_WEIGHT = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "norm.weight"

#: the ops the embedding and the head call through ``env.ops``
OPS = ("rms_norm_fwd", "rms_norm_bwd", "chunked_cross_entropy")


def check_seq_len(config: Any, seq_len: int) -> None:
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {seq_len} exceeds {type(config).__name__}.max_position_embeddings "
            f"({config.max_position_embeddings})"
        )


class DecoderEmbed:
    """``embed_tokens.weight[tokens]``; its gradient the rows of the round's tokens
    (``RowGradient``: no (vocab, dim) table)."""

    def forward(self, config: Any, params: Tensors, tokens: torch.Tensor, env: Env):
        check_seq_len(config, tokens.shape[1])
        return params[EMBED_WEIGHT][tokens]

    def backward(
        self, config: Any, tokens: torch.Tensor, d_hidden: torch.Tensor, env: Env
    ) -> Tensors:
        """Needs no weights; each token's rows summed in float32 at least."""
        n = config.hidden_size
        grad = RowGradient.summed(
            tokens,
            d_hidden.reshape(-1, n),
            (config.vocab_size, n),
            accumulation_dtype(d_hidden.dtype),
        )
        return {EMBED_WEIGHT: grad}

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.hidden_size
        rows = tokens * n * 4  # float32 row sums
        # read d_hidden; sum, gather and add the rows; read and write the gradient's rows
        return LayerCost(
            forward=Work(0, 2 * tokens * n * act_bytes),
            backward=Work(0, tokens * n * act_bytes + 4 * rows + 2 * tokens * n * act_bytes),
        )


class DecoderHead:
    """Final RMSNorm (the architecture's ``norm``), logits against ``lm_head.weight`` (the
    embedding's, when tied) chunk by chunk, mean loss."""

    def forward_backward(
        self, config: Any, params: Tensors, x: torch.Tensor, targets: Any, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
        norm = config.architecture.norm.op(config, FINAL_NORM.removesuffix(".weight"))
        return lm_head_loss(env, params, x, targets, norm=norm, projection=LM_HEAD)

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.hidden_size
        logits = 2 * tokens * config.vocab_size * n
        work = Work(3 * logits, tokens * act_bytes * 4 * n + tokens * config.vocab_size * 8)
        return LayerCost(forward=work, backward=Work())
