"""Which sequence each token of a batch belongs to, and its position: padded batches,
packed variable-length sequences, and sequences that continue from an offset.

A batch of ``(batch, seq)`` tokens is by default one sequence per row, positions ``0 ..
seq - 1``. ``Segments`` says otherwise, per token:

- ``ids`` (batch, seq) int64: the sequence the token belongs to, ``-1`` for padding. A
  query sees a key only of its own row and its own id (and causally, in the window, as
  the attention says); a padded token sees nothing: the attention gives it zero output
  and zero gradients, and its target should be ``IGNORE_INDEX``.
- ``positions`` (batch, seq) int64: the token's rotary position, from its sequence's own
  start or from an offset (a completion continuing its prompt, a document of a packed
  row); 0 for padding.

Made from ``cu_seqlens`` (packed sequences, flash attention's cumulative boundaries over
the flattened batch, ``from_cu_seqlens``) or from HF's ``attention_mask`` and
``position_ids`` (``from_attention_mask``); ``targets`` gives a batch's next-token
targets with the padding and each sequence's last token left out. Ids only need to
differ between the sequences of one row; the attention compares them, nothing counts
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from dataflow_training.kit.head import IGNORE_INDEX

#: the id of a padded token
PADDING = -1


def _as_index(name: str, value: Any, dims: int) -> torch.Tensor:
    """``value`` as an int64 CPU-or-device tensor of ``dims`` dims, or a one-line error."""
    tensor = torch.as_tensor(value)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dim() != dims:
        raise ValueError(
            f"Segments: {name} must be a {dims}-d integer tensor, got {tensor.dtype} "
            f"{tuple(tensor.shape)}"
        )
    return tensor.to(torch.int64)


def _check_ids(instance: Any, attribute: attrs.Attribute, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 2:
        raise ValueError(f"Segments.{attribute.name} must be an int64 (batch, seq) tensor")
    if bool((value < PADDING).any()):
        raise ValueError(f"Segments.ids must be >= {PADDING} ({PADDING}: padding)")


def _check_positions(instance: Any, attribute: attrs.Attribute, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        raise ValueError("Segments.positions must be an int64 (batch, seq) tensor")
    if value.shape != instance.ids.shape or value.device != instance.ids.device:
        raise ValueError(
            f"Segments.positions {tuple(value.shape)} on {value.device} must match ids "
            f"{tuple(instance.ids.shape)} on {instance.ids.device}"
        )
    if bool((value < 0).any()):
        raise ValueError("Segments.positions must be >= 0")


@attrs.frozen(eq=False)
class Segments:
    """The sequences and positions of a batch's tokens (module doc)."""

    ids: torch.Tensor = attrs.field(validator=_check_ids)
    positions: torch.Tensor = attrs.field(validator=_check_positions)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)

    @property
    def padded(self) -> torch.Tensor:
        """(batch, seq) bool: True at padded tokens."""
        return self.ids == PADDING

    def to(self, device: Any) -> Segments:
        return Segments(self.ids.to(device), self.positions.to(device))

    def stacked(self) -> torch.Tensor:
        """(2, batch, seq) int64: the ids, then the positions; what a lowered step with
        segments holds a round's in (its ``S_s_r`` object, ``TrainConfig.segments``)."""
        return torch.stack((self.ids, self.positions))

    @classmethod
    def of_stacked(cls, stacked: torch.Tensor) -> Segments:
        """The segments of a ``stacked`` tensor, viewed, not copied nor checked again:
        what a step's task reads (checked when the batch was fed, ``TrainingRun.step``;
        a check here would wait on the device, and could not be captured in a graph)."""
        made = object.__new__(cls)
        object.__setattr__(made, "ids", stacked[0])
        object.__setattr__(made, "positions", stacked[1])
        return made

    @classmethod
    def dense(cls, batch: int, seq_len: int, device: Any = "cpu") -> Segments:
        """One sequence per row from position 0: what a batch is without segments."""
        ids = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len).clone()
        return cls(ids, positions)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: Sequence[int] | torch.Tensor,
        *,
        batch: int,
        seq_len: int,
        offsets: Sequence[int] | torch.Tensor | None = None,
    ) -> Segments:
        """Packed sequences: sequence ``i`` is tokens ``cu_seqlens[i] .. cu_seqlens[i+1] -
        1`` of the batch flattened row by row (flash attention's boundaries); tokens at or
        past ``cu_seqlens[-1]`` are padding. A sequence may not cross a row's end (a row
        may hold several). ``offsets[i]``: the position of sequence ``i``'s first token
        (default 0)."""
        cu = _as_index("cu_seqlens", cu_seqlens, 1)
        total = batch * seq_len
        if cu.numel() < 1 or int(cu[0]) != 0:
            raise ValueError("Segments: cu_seqlens must start at 0")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()) or int(cu[-1]) > total:
            raise ValueError(
                f"Segments: cu_seqlens must not decrease and end at most at batch * seq_len "
                f"= {total}, got {cu.tolist()}"
            )
        count = lengths.numel()
        starts = torch.zeros(count, dtype=torch.int64) if offsets is None else None
        if offsets is not None:
            starts = _as_index("offsets", offsets, 1)
            if starts.numel() != count or bool((starts < 0).any()):
                raise ValueError(
                    f"Segments: offsets must be {count} positions >= 0, one per sequence of "
                    f"cu_seqlens, got {starts.tolist()}"
                )
        crossing = [
            i
            for i in range(count)
            if lengths[i] > 0 and int(cu[i]) // seq_len != (int(cu[i + 1]) - 1) // seq_len
        ]
        if crossing:
            raise ValueError(
                f"Segments: cu_seqlens sequence {crossing[0]} (tokens {int(cu[crossing[0]])}.."
                f"{int(cu[crossing[0] + 1]) - 1}) crosses the end of a row of {seq_len} tokens"
            )
        ids = torch.full((total,), PADDING, dtype=torch.int64)
        positions = torch.zeros(total, dtype=torch.int64)
        sequence = torch.repeat_interleave(torch.arange(count), lengths)
        end = int(cu[-1])
        ids[:end] = sequence
        positions[:end] = torch.arange(end) - cu[:-1][sequence] + starts[sequence]
        return cls(ids.view(batch, seq_len), positions.view(batch, seq_len))

    @classmethod
    def from_attention_mask(
        cls,
        attention_mask: Any,
        *,
        position_ids: Any = None,
        offsets: Sequence[int] | torch.Tensor | None = None,
    ) -> Segments:
        """HF's batch: ``attention_mask`` (batch, seq), 1 at a token, 0 at padding (left or
        right). Without ``position_ids`` each row is one sequence and its tokens take
        positions ``offsets[row] + 0, 1, ..`` (``offsets`` default 0). With HF's
        ``position_ids`` (batch, seq) the tokens take them, and a row holds several
        sequences where they say so: a new sequence starts wherever a position is not
        the one before plus one (HF's packed rows restart at 0)."""
        mask = _as_index("attention_mask", attention_mask, 2)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("Segments: attention_mask must hold only 0 and 1")
        kept = mask == 1
        batch = mask.shape[0]
        if position_ids is None:
            starts = torch.zeros(batch, dtype=torch.int64)
            if offsets is not None:
                starts = _as_index("offsets", offsets, 1)
                if starts.numel() != batch or bool((starts < 0).any()):
                    raise ValueError(
                        f"Segments: offsets must be {batch} positions >= 0, one per row, got "
                        f"{starts.tolist()}"
                    )
            positions = (kept.cumsum(1) - 1).clamp(min=0) + starts[:, None]
            ids = torch.zeros_like(mask)
        else:
            if offsets is not None:
                raise ValueError("Segments: give position_ids or offsets, not both")
            positions = _as_index("position_ids", position_ids, 2)
            if positions.shape != mask.shape:
                raise ValueError(
                    f"Segments: position_ids {tuple(positions.shape)} must match "
                    f"attention_mask {tuple(mask.shape)}"
                )
            if bool((positions[kept] < 0).any()):
                raise ValueError("Segments: position_ids must be >= 0")
            previous = torch.cat((torch.full((batch, 1), -2), positions[:, :-1]), dim=1)
            previous_kept = torch.cat((torch.zeros(batch, 1, dtype=torch.bool), kept[:, :-1]), 1)
            start = kept & ((positions != previous + 1) | ~previous_kept)
            ids = start.cumsum(1)
        return cls(torch.where(kept, ids, PADDING), torch.where(kept, positions, 0).contiguous())

    @classmethod
    def from_starts(cls, starts: Any) -> Segments:
        """Rows of consecutive documents (a feed's stream, packed): ``starts`` (batch,
        seq) bool, True at a token that begins a document. A document runs to the next
        start or the row's end; its positions count from 0 at its start, and a row's
        first tokens, before its first start (a document the row cut), from 0 at the
        row's start, as an unpacked row's do."""
        begins = torch.as_tensor(starts)
        if begins.dtype != torch.bool or begins.dim() != 2:
            raise ValueError(
                f"Segments: starts must be a (batch, seq) bool tensor, got {begins.dtype} "
                f"{tuple(begins.shape)}"
            )
        ids = begins.to(torch.int64).cumsum(1)
        index = torch.arange(begins.shape[1]).expand_as(ids)
        first = torch.where(begins, index, 0).cummax(1).values  # the document's first token
        return cls(ids, (index - first).contiguous())

    def targets(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token targets of ``tokens`` (batch, seq): each token's successor in its own
        sequence, ``IGNORE_INDEX`` at padding and at each sequence's last token."""
        if tuple(tokens.shape) != self.shape:
            raise ValueError(
                f"Segments.targets: tokens {tuple(tokens.shape)} must match the segments "
                f"{self.shape}"
            )
        following = torch.full_like(tokens, IGNORE_INDEX)
        following[:, :-1] = tokens[:, 1:]
        same = torch.zeros_like(self.ids, dtype=torch.bool)
        same[:, :-1] = (self.ids[:, 1:] == self.ids[:, :-1]) & ~self.padded[:, :-1]
        return torch.where(same, following, IGNORE_INDEX)


def packed_documents(
    tokens: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Segments]:
    """A feed's batch as a step with segments takes it (``dataflow train
    --pack-documents``): ``tokens`` and ``targets`` (batch, seq), ``starts`` (batch, seq
    + 1) bool, True at a token that begins a document, its last column the token after
    the row (``TokenFeed.next_documents``). -> (tokens, the targets with
    ``IGNORE_INDEX`` where the next token begins a document: nothing predicts across a
    boundary, the segments of ``Segments.from_starts``: no attention across one)."""
    if tuple(starts.shape) != (tokens.shape[0], tokens.shape[1] + 1):
        raise ValueError(
            f"packed_documents: starts {tuple(starts.shape)} must be (batch, seq_len + 1) "
            f"for tokens {tuple(tokens.shape)}"
        )
    kept = torch.where(starts[:, 1:], IGNORE_INDEX, targets)
    return tokens, kept, Segments.from_starts(starts[:, :-1])
