"""Qwen 3.5's hybrid stack, shared by its dense and its MoE families: three Gated DeltaNet
layers to one gated full-attention layer, zero-centred RMSNorms, and the HF layout of the
published checkpoints.

The parts: ``GATED_ATTENTION`` (grouped-query attention with a sigmoid output gate,
per-head q/k RMSNorm, RoPE on a quarter of each head) and ``ZERO_CENTRED`` norms (stored
``w``, scaling by ``1 + w``: ``Qwen3_5RMSNorm``); the Gated DeltaNet part is
``linear_attention.GatedDeltaNet``. A family's config class composes them into its
blocks (the dense SwiGLU, or routed experts with a shared one) on ``HybridConfig``,
whose ``layer_types`` default to HF's pattern (layer ``i`` full attention iff ``(i + 1) %
4 == 0``) and follow ``num_hidden_layers`` when that is overridden alone.

``HybridFamily`` is a decoder family's ``config.json`` and checkpoint handling for such a
stack (put before ``DecoderFamily`` or ``MoEFamily`` in the bases): the Gated DeltaNet
sizes, the layer types and the quarter rotation, both ways; and the text model of a
published checkpoint. Published folders are vision-language models
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): their
``config.json`` nests the text model's fields under ``text_config`` and their tensors are
named ``model.language_model.*`` (read as ``model.*``). Their vision tower
(``model.visual.*``) and multi-token-prediction layers (``mtp.*``) are not trained here:
import drops them and says so in one line; export writes the text model alone (the
family's ``hf_class``), without them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from dataflow_training.kit.attention import OutputGate, QKNorm, SelfAttention
from dataflow_training.kit.decoder import expected_state, layer_types_field
from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.hf import (
    CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointError,
    checkpoint_folder,
    read_config,
    read_state,
)
from dataflow_training.kit.linear_attention import LinearAttentionConfig
from dataflow_training.kit.norms import Norm
from dataflow_training.kit.rotary import Rope

LOG = logging.getLogger(__name__)

#: every ``full_attention_interval``-th layer is full attention (HF's default, 4)
FULL_ATTENTION_INTERVAL = 4
#: the share of each full-attention head that is rotated
PARTIAL_ROTARY = 0.25
#: RMSNorm stored as ``w``, scaling by ``1 + w`` (``Qwen3_5RMSNorm``)
ZERO_CENTRED = Norm(offset=1.0)
#: the full-attention layers' attention
GATED_ATTENTION = SelfAttention(
    qk_norm=QKNorm("head", ZERO_CENTRED), positions=Rope(PARTIAL_ROTARY), gate=OutputGate()
)
#: Gated DeltaNet's ``config.json`` fields and HF's defaults for them
LINEAR_FIELDS: Mapping[str, int] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
#: tensors of a published checkpoint that are not the text model (import drops them)
DROPPED: Mapping[str, str] = {"mtp": r"mtp\..*", "vision": r"model\.visual\..*"}


def hybrid_layer_types(layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> tuple[str, ...]:
    """HF's layer types of ``layers`` layers: full attention every ``interval``-th."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


def _default_layer_types(config: Any) -> tuple[str, ...]:
    return hybrid_layer_types(config.num_hidden_layers)


@attrs.frozen
class HybridConfig(LinearAttentionConfig):
    """``LinearAttentionConfig`` whose ``layer_types`` default to HF's hybrid pattern. A
    family's config class names its ``architecture`` (a ``linear_attention`` and a
    ``full_attention`` block kind)."""

    layer_types: tuple[str, ...] | None = layer_types_field(
        attrs.Factory(_default_layer_types, takes_self=True)
    )

    def with_overrides(self, **overrides: Any) -> Any:
        """As ``DecoderConfig.with_overrides``; a new layer count alone brings HF's pattern
        of layer types for it."""
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            layers = overrides["num_hidden_layers"]
            if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
                overrides["layer_types"] = hybrid_layer_types(layers)
        return super().with_overrides(**overrides)


class HybridFamily(DecoderFamily):
    """A family of a ``HybridConfig``: its ``config.json`` fields and the text model of
    published checkpoints (see the module docstring). Put it first among the bases::

        class Qwen3_5MoeFamily(HybridFamily, MoEFamily): ...
    """

    def config_from_hf(self, hf: Mapping[str, Any], source: str) -> Any:
        """The text model's config; a published (vision-language) ``config.json`` nests it
        under ``text_config``."""
        text = hf.get("text_config")
        if isinstance(text, Mapping):
            tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            hf = {**text, "tie_word_embeddings": tied}
        return super().config_from_hf(hf, source)

    def hf_fields(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().hf_fields(hf, source)
        rope = hf.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY))
        if factor != PARTIAL_ROTARY:
            raise CheckpointError(
                f"{source}: partial_rotary_factor = {factor!r}: Qwen 3.5 rotates a quarter "
                f"of each head ({PARTIAL_ROTARY})"
            )
        layers = fields["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None and isinstance(layers, int):
            types = hybrid_layer_types(
                layers, hf.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
            )
        known = set(self.config_class.architecture.layer_types)
        if not isinstance(types, list | tuple) or not set(types) <= known:
            raise CheckpointError(
                f"{source}: layer_types = {types!r}: expected a list of {', '.join(sorted(known))}"
            )
        linear = {name: hf.get(name, default) for name, default in LINEAR_FIELDS.items()}
        return fields | linear | {"layer_types": tuple(types)}

    def config_to_hf(self, config: Any, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().config_to_hf(config, dtype)
        rope = {**fields["rope_parameters"], "partial_rotary_factor": PARTIAL_ROTARY}
        return fields | {
            "rope_parameters": rope,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "layer_types": list(config.layer_types),
            **{name: getattr(config, name) for name in LINEAR_FIELDS},
        }

    def import_hf(
        self, path: str | Path, *, dtype: torch.dtype | None = None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """As ``DecoderFamily.import_hf``, and a published checkpoint's text model: its
        ``model.language_model.*`` tensors read as ``model.*``, its ``mtp.*`` and
        ``model.visual.*`` tensors dropped with one line saying how many."""
        config = self.config_from_hf(read_config(path), str(checkpoint_folder(path) / CONFIG))
        keys = self.key_map(config)
        keys = attrs.evolve(
            keys,
            skip=(*keys.skip, *DROPPED.values()),
            aliases=(*keys.aliases, (r"model\.language_model\.(.*)", r"model.\1")),
        )
        state = read_state(path, keys, expected_state(config), dtype=dtype)
        dropped = dropped_tensors(path)
        if dropped:
            LOG.warning(
                "%s: dropped %s (not trained by the %s family; export leaves them out)",
                path,
                ", ".join(f"{count} {what} tensors" for what, count in dropped.items()),
                self.name,
            )
        return config, state


def dropped_tensors(path: str | Path) -> dict[str, int]:
    """How many tensors of each dropped kind (``DROPPED``) the checkpoint holds."""
    folder = checkpoint_folder(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        single = Path(path) if Path(path).is_file() else folder / SAFETENSORS
        with safe_open(single, framework="pt") as handle:
            names = list(handle.keys())
    counts = {what: sum(bool(re.fullmatch(p, n)) for n in names) for what, p in DROPPED.items()}
    return {what: count for what, count in counts.items() if count}
