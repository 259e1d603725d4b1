"""The batches ``step`` takes, by kind: the extension point for other kinds of batch.

A ``step`` request carries ``"batch": {"kind": KIND, ...}``; ``BATCH_KINDS[KIND]`` reads
the rest into one ``(tokens, targets)`` per accumulation round, each int64 (batch,
seq_len), checked against the step before the run's state is touched. One kind now:

- ``tokens`` (the default): ``{"path": FILE}``, a safetensors file holding ``input_ids``
  of shape (batch, seq_len + 1) (inputs are its first seq_len columns, targets its last)
  or ``inputs`` and ``targets`` of shape (batch, seq_len); with a leading rounds axis,
  (rounds, batch, ...), for a step of several accumulation rounds. Targets equal to -100
  are ignored by the loss (``kit.IGNORE_INDEX``).

Another batch of this step (token ids some other way) adds a kind here: a reader of its
own fields that returns the rounds. An update of another shape (an RL policy update on
rollouts) is a trainer kind a plugin registers instead (``service.kinds``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dataflow_training.service.protocol import ProtocolError, field, no_other_fields
from dataflow_training.step.config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]
#: a batch kind: (the request's ``batch`` object, the step) -> one batch per round
BatchReader = Callable[[Mapping[str, Any], TrainConfig], list[Batch]]

WHERE = "args.batch"


def token_batch(spec: Mapping[str, Any], train: TrainConfig) -> list[Batch]:
    """The ``tokens`` kind (module docstring)."""
    no_other_fields(spec, ("kind", "path"), "a tokens batch", where=WHERE)
    path = Path(field(spec, "path", str, where=WHERE))
    if not path.is_file():
        raise ProtocolError(f"{WHERE}.path: {path} is not a file")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ProtocolError(f"{WHERE}.path: {path} is not a safetensors file ({exc})") from None
    names = sorted(tensors)
    if names == ["input_ids"]:
        ids = _rounds(tensors["input_ids"], "input_ids", train, train.seq_len + 1)
        return [(round_[:, :-1].contiguous(), round_[:, 1:].contiguous()) for round_ in ids]
    if names == ["inputs", "targets"]:
        inputs = _rounds(tensors["inputs"], "inputs", train, train.seq_len)
        targets = _rounds(tensors["targets"], "targets", train, train.seq_len)
        return list(zip(inputs, targets, strict=True))
    raise ProtocolError(
        f"{WHERE}.path: {path} holds {', '.join(names) or 'no tensor'}; a tokens batch is "
        "input_ids alone, or inputs and targets"
    )


def _rounds(t: torch.Tensor, name: str, train: TrainConfig, columns: int) -> list[torch.Tensor]:
    """``t`` as one (batch, columns) int64 tensor per round."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ProtocolError(f"{WHERE}.path: {name} is {t.dtype}; token ids are integers")
    given = tuple(t.shape)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    shape = (train.rounds, train.batch, columns)
    if tuple(t.shape) != shape:
        want = f"{shape[1:]} or {shape}" if train.rounds == 1 else f"{shape}"
        raise ProtocolError(
            f"{WHERE}.path: {name} has shape {given}; this step takes {want} "
            "(rounds, batch, seq_len" + (" + 1)" if name == "input_ids" else ")")
        )
    return list(t.to(torch.int64).unbind(0))


#: every batch kind ``step`` reads, by name
BATCH_KINDS: dict[str, BatchReader] = {"tokens": token_batch}


def read_batch(spec: Any, train: TrainConfig) -> list[Batch]:
    """The rounds of a request's ``batch`` object, read by its kind."""
    if not isinstance(spec, dict):
        raise ProtocolError(f"{WHERE}: missing (a JSON object: kind and the kind's fields)")
    kind = field(spec, "kind", str, "tokens", where=WHERE)
    if kind not in BATCH_KINDS:
        raise ProtocolError(f"{WHERE}.kind: {kind!r} is not one of {', '.join(BATCH_KINDS)}")
    return BATCH_KINDS[kind](spec, train)


def write_token_batch(
    path: str | Path,
    input_ids: torch.Tensor | None = None,
    *,
    inputs: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
) -> Path:
    """Write a ``tokens`` batch file (module docstring) for a ``step`` request: either
    ``input_ids`` or ``inputs`` and ``targets``."""
    if (input_ids is None) == (inputs is None and targets is None):
        raise ValueError("write_token_batch takes input_ids, or inputs and targets")
    if input_ids is None and (inputs is None or targets is None):
        raise ValueError("write_token_batch: inputs and targets go together")
    tensors = (
        {"input_ids": input_ids}
        if input_ids is not None
        else {"inputs": inputs, "targets": targets}
    )
    path = Path(path)
    save_file({k: v.to(torch.int64).contiguous() for k, v in tensors.items()}, str(path))
    return path
