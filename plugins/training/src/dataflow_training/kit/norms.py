"""Norms over the last dimension, forward returning their statistics, backward taking them.

``LayerNorm`` (GPT-2) and ``RMSNorm`` (Llama, Qwen; ``offset=1`` for norms that scale by
``1 + w``, as Qwen 3.5's do). Forward returns ``(y, stats)``; backward takes the stats,
so no forward runs again. Statistics are float32 (``dataflow_training.step.ops``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dataflow_training.kit import decoder_reference
from dataflow_training.step.family import TensorSpec

Tensors = Mapping[str, torch.Tensor]


#: a stdlib frozen dataclass, not attrs: block math builds these inside torch.compile's
#: trace, and dynamo cannot trace attrs' frozen __init__ (a graph break in every block)
@dataclasses.dataclass(frozen=True)
class LayerNorm:
    weight: str
    bias: str | None
    eps: float

    def forward(self, ops: Any, params: Tensors, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        bias = params[self.bias] if self.bias else None
        y, mean, rstd = ops["layer_norm_fwd"](x, params[self.weight], bias, self.eps)
        return y, (mean, rstd)

    def backward(
        self, ops: Any, params: Tensors, x: torch.Tensor, stats: tuple, dy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        bias = params[self.bias] if self.bias else None
        dx, d_weight, d_bias = ops["layer_norm_bwd"](dy, x, *stats, params[self.weight], bias)
        grads = {self.weight: d_weight}
        if self.bias:
            grads[self.bias] = d_bias
        return dx, grads


#: a stdlib frozen dataclass, not attrs: block math builds these inside torch.compile's
#: trace, and dynamo cannot trace attrs' frozen __init__ (a graph break in every block)
@dataclasses.dataclass(frozen=True)
class RMSNorm:
    weight: str
    eps: float
    #: scale by ``offset + weight`` (1 for Qwen 3.5's norms, 0 for Llama's)
    offset: float = 0.0

    def _scale(self, params: Tensors) -> torch.Tensor:
        weight = params[self.weight]
        return weight + self.offset if self.offset else weight

    def forward(self, ops: Any, params: Tensors, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        y, rstd = ops["rms_norm_fwd"](x, self._scale(params), self.eps)
        return y, (rstd,)

    def backward(
        self, ops: Any, params: Tensors, x: torch.Tensor, stats: tuple, dy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dx, d_weight = ops["rms_norm_bwd"](dy, x, *stats, self._scale(params))
        return dx, {self.weight: d_weight}


# -- the norm part -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Norm:
    """A block's norm kind, as a part: what a norm named ``name`` (``input_layernorm``) of
    a given width is, for the math (``op``), the layer's parameters (``params``), the
    reference (``reference``) and the ops it calls. ``kind`` is ``"rms"`` (weight only) or
    ``"layer"`` (weight and bias); ``eps`` names the config field holding epsilon;
    ``offset`` scales by ``offset + w`` (RMSNorm only). HF keys: the parameters as named."""

    kind: str = "rms"
    eps: str = "rms_norm_eps"
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"Norm.kind must be 'rms' or 'layer', got {self.kind!r}")
        if self.kind == "layer" and self.offset:
            raise ValueError("Norm.offset applies to RMSNorm only")

    @property
    def ops(self) -> tuple[str, ...]:
        return ("rms_norm_fwd", "rms_norm_bwd") if self.kind == "rms" else LAYER_NORM_OPS

    def op(self, config: Any, name: str) -> RMSNorm | LayerNorm:
        """The forward/backward pair of the norm ``name``."""
        eps = getattr(config, self.eps)
        if self.kind == "rms":
            return RMSNorm(f"{name}.weight", eps, self.offset)
        return LayerNorm(f"{name}.weight", f"{name}.bias", eps)

    def params(self, name: str, width: int) -> tuple[Any, ...]:
        """Its parameters (no weight decay), in HF's order."""

        names = ("weight",) if self.kind == "rms" else ("weight", "bias")
        return tuple(TensorSpec(f"{name}.{p}", (width,), decay=False) for p in names)

    def reference(self, config: Any, width: int) -> Any:
        """The plain-torch module: ``decoder_reference.RMSNorm`` (scaled by ``offset + w``)
        or torch's ``nn.LayerNorm``."""

        eps = getattr(config, self.eps)
        if self.kind == "layer":
            return nn.LayerNorm(width, eps)
        return decoder_reference.RMSNorm(width, eps, self.offset)


LAYER_NORM_OPS = ("layer_norm_fwd", "layer_norm_bwd")
