"""``DecoderFamily``: a whole ``Family`` (protocol v2) for a decoder of the kit's parts
(``decoder.py``), so that a family built on it writes only its presets and its
``config.json`` mapping.

A subclass sets ``name`` and ``presets`` (name -> config); where they differ from the
kit's defaults, ``config_class`` (whose ``architecture`` names the parts: Llama's by
default), ``hf_names`` (preset -> the HF hub model whose weights it takes),
``hf_class``, ``hf_model_type`` and ``hf_defaults`` of its ``config.json``, and
``reference`` (the plain-autograd model class: ``DecoderReference``). Its ``config.json``
settings of its own are ``check_hf(hf, source)`` (refuse what it does not implement),
``hf_fields(hf, source)`` (read its own fields) and ``config_to_hf(config, dtype)``
(``super()``'s, with its own fields added). Everything else (layers, math, ops, the
reference, the HF key table, import and export, the preset table) follows from the
config's architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from dataflow_training.kit import decoder_hf
from dataflow_training.kit.decoder import (
    EMBED,
    EMBED_WEIGHT,
    DecoderConfig,
    layer_specs,
    parameter_count,
)
from dataflow_training.kit.decoder_hf import HF_DEFAULTS, export_decoder, import_decoder
from dataflow_training.kit.decoder_math import OPS as CHAIN_OPS
from dataflow_training.kit.decoder_math import DecoderEmbed, DecoderHead
from dataflow_training.kit.decoder_reference import DecoderReference
from dataflow_training.kit.hf import CheckpointError
from dataflow_training.step.family import LayerSpec


class UnknownPresetError(KeyError):
    """A preset name that is not one of the family's presets."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class DecoderFamily:
    """Embed, ``num_hidden_layers`` blocks of the config's architecture, head (tied or not)."""

    name: ClassVar[str] = ""
    presets: ClassVar[Mapping[str, DecoderConfig]] = {}
    hf_names: ClassVar[Mapping[str, str]] = {}
    reference: ClassVar[type[DecoderReference]] = DecoderReference
    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    #: the ``architectures`` and ``model_type`` of the family's ``config.json``, and
    #: transformers' defaults for it
    hf_class: ClassVar[str] = ""
    hf_model_type: ClassVar[str] = ""
    hf_defaults: ClassVar[Mapping[str, Any]] = HF_DEFAULTS

    @property
    def ops(self) -> tuple[str, ...]:
        """Every op the blocks, the embedding and the head call."""
        return tuple(dict.fromkeys((*self.config_class.architecture.ops, *CHAIN_OPS)))

    def preset(self, name: str) -> DecoderConfig:
        """The config of preset ``name``; an unknown name is an error listing the known ones."""
        try:
            return self.presets[name]
        except KeyError:
            raise UnknownPresetError(
                f"unknown {self.name} preset {name!r}; known presets: {', '.join(self.presets)}"
            ) from None

    def config(self, preset: str, **overrides: Any) -> DecoderConfig:
        return self.preset(preset).with_overrides(**overrides)

    def layers(self, config: DecoderConfig) -> list[LayerSpec]:
        return layer_specs(config)

    def hidden_shape(self, config: DecoderConfig, batch: int, seq_len: int) -> tuple[int, ...]:
        return (batch, seq_len, config.hidden_size)

    def math(self, kind: str) -> Any:
        """The embedding's, the head's, or a block kind's (the ``Block`` itself)."""
        kinds = {
            "embed": DecoderEmbed(),
            **self.config_class.architecture.blocks,
            "head": DecoderHead(),
        }
        if kind not in kinds:
            raise KeyError(f"{self.name} has no layer kind {kind!r}; its kinds: {', '.join(kinds)}")
        return kinds[kind]

    def reference_model(self, config: DecoderConfig) -> DecoderReference:
        return self.reference(config)

    # -- HF checkpoints ----------------------------------------------------------------
    def check_hf(self, hf: Mapping[str, Any], source: str) -> None:
        """Refuse the family's own ``config.json`` settings it does not implement (raise a
        ``CheckpointError`` naming the field and ``source``); the shared ones are checked by
        ``decoder_hf.fields_from_hf``."""

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The config's fields from ``config.json``: the decoder's shared ones (a family
        with fields of its own adds them)."""
        return decoder_hf.fields_from_hf(
            hf, source, model_type=self.hf_model_type, defaults=self.hf_defaults
        )

    def config_from_hf(self, hf: Mapping[str, Any], source: str) -> DecoderConfig:
        """The config of an HF ``config.json`` (its contents; ``source`` names the file)."""
        self.check_hf(hf, source)
        fields = self.hf_fields(hf, source)
        try:
            return self.config_class(**fields)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{source}: {error}") from error

    def config_to_hf(self, config: DecoderConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of ``config``: the class, the model type and the decoder's
        shared fields (a family adds its own to ``super()``'s)."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.hf_model_type,
            **decoder_hf.fields_to_hf(config, dtype),
        }

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
        """(config, state keyed as ``reference_model(config).state_dict()``) of an HF
        checkpoint folder (one ``model.safetensors`` or shards with their index)."""
        return import_decoder(path, self.name, self.config_from_hf, dtype=dtype)

    def key_map(self, config: DecoderConfig) -> Any:
        """The state key <-> HF tensor name table (``export --peft`` names adapters by it)."""
        return decoder_hf.key_map(self.name, config)

    def export_hf(
        self,
        config: DecoderConfig,
        state: Mapping[str, torch.Tensor],
        path: str | Path,
        *,
        max_shard_bytes: int | None = None,
    ) -> None:
        """Write ``state`` as an HF checkpoint folder ``transformers`` loads (sharded past
        ``max_shard_bytes``)."""
        embedding = state.get(f"{EMBED}.{EMBED_WEIGHT}")  # absent: write_state names it
        dtype = embedding.dtype if embedding is not None else torch.float32
        hf_config = self.config_to_hf(config, dtype)
        export_decoder(config, state, path, self.name, hf_config, max_shard_bytes=max_shard_bytes)

    # -- docs --------------------------------------------------------------------------
    def preset_table(self) -> str:
        """The presets as a Markdown table, every number computed from the configs."""
        lines = [
            "| preset | layers | hidden | heads (kv) | head_dim | MLP | vocab | context "
            "| tied | parameters | HF weights |",
            "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|---|",
        ]
        for name, c in self.presets.items():
            hf = f"`{self.hf_names[name]}`" if name in self.hf_names else "-"
            lines.append(
                f"| `{name}` | {c.num_hidden_layers} | {c.hidden_size:,} "
                f"| {c.num_attention_heads} ({c.num_key_value_heads}) | {c.head_dim} "
                f"| {c.intermediate_size:,} | {c.vocab_size:,} | {c.max_position_embeddings:,} "
                f"| {'yes' if c.tie_word_embeddings else 'no'} | {parameter_count(c):,} | {hf} |"
            )
        return "\n".join(lines) + "\n"
