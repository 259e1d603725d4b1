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

import attrs
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

#: the default ``vocab_multiple`` of a config: the token table and the output projection
#: are stored with their rows rounded up to a multiple of it. 64 is nanoGPT's and llm.c's
#: (GPT-2's 50,257 stored as 50,304): a (tokens, vocab) logits matmul whose vocabulary no
#: 16-byte vector divides falls back to slow cuBLAS kernels, and stock torch.compile
#: GPT-2 124M measured 571,000-573,000 tokens/s on the H200 with the vocabulary padded
#: against 544,000 without (issue 44's table). 1 stores the vocabulary as it is.
VOCAB_MULTIPLE = 64


def padded_vocab(config: Any) -> int:
    """The rows the step stores the vocabulary tables with: ``config.vocab_size`` rounded
    up to a multiple of ``config.vocab_multiple``."""
    multiple = config.vocab_multiple
    return -(-config.vocab_size // multiple) * multiple


def vocab_table(config: Any, name: str, **fields: Any) -> TensorSpec:
    """A (vocabulary, hidden) parameter stored padded (``padded_vocab``); the model state
    holds its ``config.vocab_size`` real rows (``TensorSpec.rows``). The math never lets
    a padded row into a result: the embedding gathers only real ids, the head masks the
    padded logits out of the softmax (``chunked_cross_entropy(..., vocab=)``), so those
    rows get no gradient and AdamW, weight decay included, keeps them zero."""
    stored = padded_vocab(config)
    rows = None if stored == config.vocab_size else config.vocab_size
    return TensorSpec(name, (stored, config.hidden_size), rows=rows, **fields)


def vocab_multiple_field() -> Any:
    """The config field ``vocab_multiple: int = VOCAB_MULTIPLE`` (``padded_vocab``): a
    storage choice of the step, not part of the model, so no HF ``config.json`` field maps
    to it and a checkpoint holds the real rows whatever it is (1: no padding)."""
    return attrs.field(default=VOCAB_MULTIPLE, kw_only=True, validator=_positive_int)


def _positive_int(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive int (1: no "
            f"padding), got {value!r}"
        )


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

    def refuses_segments(self, config: Any) -> str | None:
        """Learned absolute positions take no per-token positions: a step with segments
        (``TrainConfig.segments``) is refused for them; the token table alone reads none."""
        return None if self.positions is None else type(self.positions).__name__

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        """The token table, then the positions' (HF's order)."""
        tokens = vocab_table(config, self.weight)
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
            (padded_vocab(config), n),
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
        return lm_head_loss(
            env, params, x, targets, norm=norm, projection=LM_HEAD, vocab=config.vocab_size
        )

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        return head_cost(config, batch, seq_len, act_bytes)


def head_cost(config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
    """The fused head's work (``backward`` included in ``forward``'s figure): three logits
    matmuls over the stored (padded) vocabulary, each token's hidden state read and
    written four times and eight bytes a logit."""
    tokens, n, vocab = batch * seq_len, config.hidden_size, padded_vocab(config)
    logits = 2 * tokens * vocab * n
    work = Work(3 * logits, tokens * act_bytes * 4 * n + tokens * vocab * 8)
    return LayerCost(forward=work, backward=Work())
