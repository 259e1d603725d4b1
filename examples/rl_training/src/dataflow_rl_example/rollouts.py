"""Rollouts on disk: what an inference engine hands the policy update.

A rollout folder holds ``rollouts.json`` (the index) and one or more safetensors files.
The index::

    {
      "format": "dataflow-rl.rollouts/v1",
      "rows": 8, "tokens": 24, "hidden_size": 64, "num_layers": 2,
      "hidden_layers": [0, 1],
      "files": {"tokens": "rollouts.safetensors", "hidden.0": "rollouts.safetensors", ...}
    }

``files`` maps every tensor to the file that holds it (one file, or shards). The
tensors, with ``B`` rows of ``T`` tokens, right-padded:

- ``tokens`` int64 (B, T): prompt, then completion, then padding;
- ``prompt_mask``, ``completion_mask`` bool (B, T): which tokens are the prompt and which
  the policy generated (the scored ones); padding is neither, and only ever at a row's end;
- ``behaviour_logprobs`` float32 (B, T): at a completion position ``t``, the log-prob the
  sampling policy gave ``tokens[t]`` after ``tokens[:t]``; 0 elsewhere;
- ``ref_logprobs`` float32 (B, T), optional: the same under the frozen reference model
  (needed for the KL term);
- ``rewards`` float32 (B,), and ``groups`` int64 (B,): rows with the same group id answer
  the same prompt (advantages are normalized within a group);
- ``hidden.<l>`` float32 (B, T - 1, H) for each ``l`` of ``hidden_layers``: the input of
  block ``l`` (the residual stream before it; ``hidden.0`` is the token embeddings) at
  positions ``0 .. T - 2``, exactly what the engine computed while sampling.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

FORMAT = "dataflow-rl.rollouts/v1"
INDEX = "rollouts.json"
DATA = "rollouts.safetensors"
ROW_TENSORS = ("tokens", "prompt_mask", "completion_mask", "behaviour_logprobs")


class RolloutError(ValueError):
    """Rollouts that are malformed; the message names the file and the field."""


@attrs.frozen(eq=False)
class Rollouts:
    """One batch of rollouts (tensors as described in the module docstring)."""

    tokens: Any
    prompt_mask: Any
    completion_mask: Any
    behaviour_logprobs: Any
    rewards: Any
    groups: Any
    hidden: Mapping[int, Any] = attrs.field(factory=dict)
    ref_logprobs: Any = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.hidden))

    def without_hidden(self) -> Rollouts:
        """The same rollouts with no hidden states (the update recomputes from tokens)."""
        return attrs.evolve(self, hidden={})

    def check(self, source: str = "rollouts") -> None:
        """Raise ``RolloutError`` naming the first field that breaks the format."""
        import torch

        if self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            raise RolloutError(f"{source}: 'tokens' must be int64 (rows, tokens)")
        rows, length = self.tokens.shape
        for name in ROW_TENSORS[1:] + (("ref_logprobs",) if self.ref_logprobs is not None else ()):
            if tuple(getattr(self, name).shape) != (rows, length):
                raise RolloutError(f"{source}: {name!r} must have the shape of 'tokens'")
        for name in ("rewards", "groups"):
            if tuple(getattr(self, name).shape) != (rows,):
                raise RolloutError(f"{source}: {name!r} must have one value per row ({rows})")
        prompt, completion = self.prompt_mask.bool(), self.completion_mask.bool()
        if (prompt & completion).any():
            raise RolloutError(f"{source}: a token is in both 'prompt_mask' and 'completion_mask'")
        used = (prompt | completion).int()
        if (used[:, 1:] > used[:, :-1]).any():
            raise RolloutError(f"{source}: rows must be right-padded (padding only at the end)")
        if not prompt[:, 0].all():
            raise RolloutError(f"{source}: every row starts with at least one prompt token")
        for layer, hidden in self.hidden.items():
            if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (rows, length - 1):
                raise RolloutError(
                    f"{source}: 'hidden.{layer}' must be (rows, tokens - 1, hidden) = "
                    f"({rows}, {length - 1}, H), got {tuple(hidden.shape)}"
                )


def write_rollouts(rollouts: Rollouts, folder: str | Path) -> Path:
    """Write ``rollouts`` as ``folder/rollouts.json`` + ``folder/rollouts.safetensors``."""
    from safetensors.torch import save_file

    rollouts.check()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(rollouts, name) for name in (*ROW_TENSORS, "rewards", "groups")}
    tensors["prompt_mask"] = tensors["prompt_mask"].bool()
    tensors["completion_mask"] = tensors["completion_mask"].bool()
    if rollouts.ref_logprobs is not None:
        tensors["ref_logprobs"] = rollouts.ref_logprobs
    tensors |= {f"hidden.{layer}": hidden for layer, hidden in rollouts.hidden.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / DATA)
    hidden_size = next(iter(rollouts.hidden.values())).shape[-1] if rollouts.hidden else None
    index = {
        "format": FORMAT,
        "rows": rollouts.rows,
        "tokens": rollouts.length,
        "hidden_size": hidden_size,
        "hidden_layers": list(rollouts.hidden_layers),
        "files": dict.fromkeys(sorted(tensors), DATA),
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return folder


def read_rollouts(folder: str | Path) -> Rollouts:
    """The rollouts of ``folder`` (its ``rollouts.json`` and the files it names)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    index_path = folder / INDEX
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise RolloutError(f"{index_path}: no rollout index (write_rollouts writes one)") from None
    except json.JSONDecodeError as error:
        raise RolloutError(f"{index_path}: not JSON ({error})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise RolloutError(f"{index_path}: 'format' must be {FORMAT!r}")
    files = index.get("files")
    if not isinstance(files, dict):
        raise RolloutError(f"{index_path}: 'files' must map each tensor to its file")
    tensors: dict[str, Any] = {}
    for file in sorted(set(files.values())):
        try:
            loaded = load_file(folder / file)
        except (FileNotFoundError, SafetensorError, OSError) as error:
            raise RolloutError(f"{folder / file}: cannot read ({error})") from None
        tensors |= {name: t for name, t in loaded.items() if files.get(name) == file}
    missing = sorted({*ROW_TENSORS, "rewards", "groups"} - set(tensors))
    missing += [
        f"hidden.{n}" for n in index.get("hidden_layers", []) if f"hidden.{n}" not in tensors
    ]
    if missing:
        raise RolloutError(f"{index_path}: missing tensor(s) {', '.join(missing)}")
    rollouts = Rollouts(
        **{name: tensors[name] for name in (*ROW_TENSORS, "rewards", "groups")},
        hidden={int(n): tensors[f"hidden.{n}"] for n in index.get("hidden_layers", [])},
        ref_logprobs=tensors.get("ref_logprobs"),
    )
    rollouts.check(str(index_path))
    return rollouts
