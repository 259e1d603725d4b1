"""Norms over the last dimension, forward returning their statistics, backward taking them.

``LayerNorm`` (GPT-2) and ``RMSNorm`` (Llama, Qwen; ``offset=1`` for norms that scale by
``1 + w``, as Qwen 3.5's do). Forward returns ``(y, stats)``; backward takes the stats,
so no forward runs again. Statistics are float32 (``dataflow_training.ops``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

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
