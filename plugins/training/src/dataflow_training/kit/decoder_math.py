"""The math of a decoder's embedding and head (``decoder.py``); its blocks are composed of
parts (``block.Block``).

The embedding is ``embed_tokens.weight[tokens]``, its gradient the rows of the round's
tokens; positions are the attention's part (``rotary.Rope``), or, where a model learns
them (GPT-2), the embedding's (``LearnedPositions``: a table's rows added). The head is the
final RMSNorm, the logits against ``lm_head.weight`` (the embedding's, when tied) chunk by
chunk, and the mean loss (``head.lm_head_loss``). Every op with a kernel goes through
``env.ops``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dataflow_training.kit.head import lm_head_loss
from dataflow_training.kit.linear import accumulation_dtype
from dataflow_training.step.family import Env, LayerCost, RowGradient, TensorSpec, Work

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


@dataclasses.dataclass(frozen=True)
class LearnedPositions:
    """Learned absolute positions, as a part of the embedding (GPT-2's ``wpe``): a table
    ``weight`` of ``config.<length>`` rows of ``hidden_size``, whose row ``p`` is added to
    the token at position ``p``. The table's length bounds the sequence (the error names
    the field). Its gradient is a float32 table (at least; rows past the sequence zero);
    it saves nothing. Cost: its rows read and added (forward); ``d_hidden`` read again and
    the float32 table zeroed, written and read (backward). HF keys: the family's table."""

    weight: str
    length: str = "max_position_embeddings"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.weight, (getattr(config, self.length), config.hidden_size)),)

    def check(self, config: Any, seq_len: int) -> None:
        longest = getattr(config, self.length)
        if seq_len > longest:
            raise ValueError(
                f"sequence length {seq_len} exceeds {type(config).__name__}.{self.length} "
                f"({longest})"
            )

    def forward(self, params: Tensors, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + params[self.weight][: hidden.shape[1]]

    def backward(self, config: Any, d_hidden: torch.Tensor) -> Tensors:
        """The table's gradient: each position's rows summed over the batch."""
        seq_len = d_hidden.shape[1]
        self.check(config, seq_len)
        acc = accumulation_dtype(d_hidden.dtype)
        table = torch.zeros(
            getattr(config, self.length), config.hidden_size, dtype=acc, device=d_hidden.device
        )
        table[:seq_len] = d_hidden.to(acc).sum(0)
        return {self.weight: table}

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.hidden_size
        table = getattr(config, self.length) * n * 4  # float32
        return LayerCost(
            forward=Work(0, tokens * n * act_bytes),
            backward=Work(0, tokens * n * act_bytes + 3 * table),
        )


@dataclasses.dataclass(frozen=True)
class DecoderEmbed:
    """``weight[tokens]`` (``embed_tokens.weight``), plus ``positions`` where the model
    learns them (a ``LearnedPositions``; None: none, they are the attention's); the
    token table's gradient the rows of the round's tokens (``RowGradient``: no (vocab,
    dim) table)."""

    weight: str = EMBED_WEIGHT
    positions: LearnedPositions | None = None

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        """The token table, then the positions' (HF's order)."""
        tokens = TensorSpec(self.weight, (config.vocab_size, config.hidden_size))
        return (tokens, *(self.positions.params(config) if self.positions is not None else ()))

    def _check(self, config: Any, seq_len: int) -> None:
        if self.positions is None:
            check_seq_len(config, seq_len)
        else:  # the table's rows bound the sequence
            self.positions.check(config, seq_len)

    def forward(self, config: Any, params: Tensors, tokens: torch.Tensor, env: Env):
        self._check(config, tokens.shape[1])
        hidden = params[self.weight][tokens]
        return hidden if self.positions is None else self.positions.forward(params, hidden)

    def backward(
        self, config: Any, tokens: torch.Tensor, d_hidden: torch.Tensor, env: Env
    ) -> Tensors:
        """Needs no weights; each token's rows summed in float32 at least (and come back in
        that dtype: the caller rounds them into its gradient buffers).

        The token table's gradient is the rows of the tokens, not a (vocab, hidden)
        float32 table: zeroing, filling, casting and adding the table took about 200 us of
        a round's backward on the H200 whatever its tokens (gpt2_124m profiles of session
        17: 241 us at 4,096 tokens, 280 us at 8,192), a step of 64 or 128 small rounds
        paying it each round."""
        n = config.hidden_size
        grad = RowGradient.summed(
            tokens,
            d_hidden.reshape(-1, n),
            (config.vocab_size, n),
            accumulation_dtype(d_hidden.dtype),
        )
        if self.positions is None:
            return {self.weight: grad}
        return {self.weight: grad, **self.positions.backward(config, d_hidden)}

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        """The tokens' rows gathered (forward); ``d_hidden`` read, the rows summed, gathered
        and added in float32, the gradient's rows read and written (backward); and the
        positions' work."""
        tokens, n = batch * seq_len, config.hidden_size
        rows = tokens * n * 4  # float32 row sums
        forward = 2 * tokens * n * act_bytes
        backward = tokens * n * act_bytes + 4 * rows + 2 * tokens * n * act_bytes
        if self.positions is not None:
            more = self.positions.cost(config, batch, seq_len, act_bytes)
            forward += more.forward.bytes
            backward += more.backward.bytes
        return LayerCost(forward=Work(0, forward), backward=Work(0, backward))


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
