"""The gpt2 family object: what ``FamilySpec("gpt2").load()`` returns to the training plugin.

It satisfies ``dataflow_training.step.family.Family`` (protocol v2): presets and configs, the
chain's layers (the head tied to the embedding's ``wte``), the math of each layer kind and
the ops it calls, the reference model, and HF checkpoint import/export.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dataflow_training.kit import LayerSpec

from dataflow_family_gpt2 import checkpoint
from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import layer_specs
from dataflow_family_gpt2.model import OPS, GPT2Block, GPT2Embed, GPT2Head, math_of
from dataflow_family_gpt2.presets import PRESETS
from dataflow_family_gpt2.presets import preset as preset_config
from dataflow_family_gpt2.reference import GPT2Reference


class GPT2Family:
    """GPT-2: learned positions, pre-norm blocks, tanh GELU, tied output projection."""

    name = "gpt2"
    presets: Mapping[str, GPT2Config] = PRESETS
    ops = OPS

    def config(self, preset: str, **overrides: Any) -> GPT2Config:
        return preset_config(preset).with_overrides(**overrides)

    def layers(self, config: GPT2Config) -> list[LayerSpec]:
        return layer_specs(config)

    def hidden_shape(self, config: GPT2Config, batch: int, seq_len: int) -> tuple[int, ...]:
        return (batch, seq_len, config.n_embd)

    def math(self, kind: str) -> GPT2Embed | GPT2Block | GPT2Head:
        return math_of(kind)

    def reference_model(self, config: GPT2Config) -> GPT2Reference:
        return GPT2Reference(config)

    def config_from_hf(self, hf: Mapping[str, Any], source: str) -> GPT2Config:
        """The config of an HF ``config.json`` (its contents; ``source`` names the file)."""
        return checkpoint.config_from_hf(hf, source)

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
        return checkpoint.import_hf(path, dtype=dtype)

    def key_map(self, config: GPT2Config) -> Any:
        """The state key <-> HF tensor name table (``export --peft`` names adapters by it)."""
        return checkpoint.key_map(config)

    def export_hf(
        self,
        config: GPT2Config,
        state: Mapping[str, torch.Tensor],
        path: str | Path,
        *,
        max_shard_bytes: int | None = None,
    ) -> None:
        checkpoint.export_hf(config, state, path, max_shard_bytes=max_shard_bytes)
