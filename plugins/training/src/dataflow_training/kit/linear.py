"""Linear layers: forward through the ``linear`` op, backward as two more ``linear`` calls.

``y = x @ W.T + b`` with W (out, in). Backward needs only the layer's input:
``dx = dy @ W``, ``dW = dy.T @ x``, ``db = sum(dy)`` (summed in float32 at least).
Where the parameters hold LoRA adapters of the projection (``kit.lora``), it adds them;
where the weight is a LoRA base stored quantized or in another dtype
(``kit.lora_base``), it multiplies by it dequantized, and makes no ``dW``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dataflow_training.kit.lora import adapter_backward, adapter_forward
from dataflow_training.kit.lora_base import base_weight, stored_apart

Tensors = Mapping[str, torch.Tensor]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums over tokens run in float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def linear_backward(
    ops: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, *, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (dx, d_weight, d_bias or None) of ``y = linear(x, weight, bias)``."""
    x_rows = x.reshape(-1, x.shape[-1])
    dy_rows = dy.reshape(-1, dy.shape[-1])
    dx = ops["linear"](dy, weight.t())
    d_weight = ops["linear"](dy_rows.t(), x_rows.t())
    d_bias = None
    if bias:
        d_bias = dy_rows.sum(0, dtype=accumulation_dtype(dy.dtype)).to(weight.dtype)
    return dx, d_weight, d_bias


#: a stdlib frozen dataclass, not attrs: block math builds these inside torch.compile's
#: trace, and dynamo cannot trace attrs' frozen __init__ (a graph break in every block)
@dataclasses.dataclass(frozen=True)
class Linear:
    """A projection whose parameters are named ``weight`` (and ``bias``, or None)."""

    weight: str
    bias: str | None = None

    @property
    def adapters(self) -> tuple[str, str]:
        """The names of LoRA's A and B of this projection (``step.lora``)."""
        module = self.weight.removesuffix(".weight")
        return f"{module}.lora_A.weight", f"{module}.lora_B.weight"

    def forward(self, ops: Any, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        weight = base_weight(ops, params, self.weight, x.dtype)
        y = ops["linear"](x, weight, params[self.bias] if self.bias else None)
        a, b = self.adapters
        if a in params:  # a LoRA target: + scale * (dropout(x) A^T) B^T (kit.lora)
            y = y + adapter_forward(ops, x, params[a], params[b], self.weight)
        return y

    def backward(
        self, ops: Any, params: Tensors, x: torch.Tensor, dy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (dx, gradients by parameter name). A LoRA target's are its adapters', and
        no ``dW`` (its base is frozen); a base stored apart has none either."""
        a, b = self.adapters
        if a in params or stored_apart(params, self.weight, dy.dtype):
            dx = ops["linear"](dy, base_weight(ops, params, self.weight, dy.dtype).t())
            if a not in params:
                return dx, {}
            d_x, d_a, d_b = adapter_backward(ops, x, params[a], params[b], dy, self.weight)
            return dx.add_(d_x), {a: d_a, b: d_b}
        dx, d_weight, d_bias = linear_backward(
            ops, x, params[self.weight], dy, bias=self.bias is not None
        )
        grads = {self.weight: d_weight}
        if self.bias is not None:
            grads[self.bias] = d_bias
        return dx, grads


def projections_backward(
    ops: Any,
    params: Tensors,
    x: torch.Tensor,
    projections: tuple[Linear, ...],
    d_outs: tuple[torch.Tensor, ...],
    grads: dict[str, torch.Tensor],
) -> torch.Tensor:
    """``dx`` of several projections of one input ``x`` (an attention's q, k and v), given
    their outputs' gradients in the same order; their weights' gradients go into ``grads``."""
    d_x = None
    for proj, d_out in zip(projections, d_outs, strict=True):
        d_in, g = proj.backward(ops, params, x, d_out)
        grads.update(g)
        d_x = d_in if d_x is None else d_x.add_(d_in)
    return d_x
