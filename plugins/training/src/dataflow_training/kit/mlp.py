"""The SwiGLU feed-forward (Llama, Qwen): ``down(silu(gate(x)) * up(x))``, no biases.

Forward saves the two projections' outputs (``gate``, ``up``); backward rebuilds the
product elementwise (``swiglu_fwd``) and differentiates through ``swiglu_bwd``, so no
projection runs again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dataflow_training.kit.linear import Linear

Tensors = Mapping[str, torch.Tensor]


#: a stdlib frozen dataclass, not attrs: block math builds these inside torch.compile's
#: trace, and dynamo cannot trace attrs' frozen __init__ (a graph break in every block)
@dataclasses.dataclass(frozen=True)
class SwiGLU:
    gate: Linear
    up: Linear
    down: Linear

    def forward(
        self, ops: Any, params: Tensors, x: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (output, saved ``{"gate": ..., "up": ...}``)."""
        gate, up = self.gate.forward(ops, params, x), self.up.forward(ops, params, x)
        return self.down.forward(ops, params, ops["swiglu_fwd"](gate, up)), {"gate": gate, "up": up}

    def backward(
        self,
        ops: Any,
        params: Tensors,
        x: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        dy: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (dx, gradients of the three projections)."""
        d_act, grads = self.down.backward(ops, params, ops["swiglu_fwd"](gate, up), dy)
        d_gate, d_up = ops["swiglu_bwd"](d_act, gate, up)
        del d_act
        dx, g = self.gate.backward(ops, params, x, d_gate)
        grads.update(g)
        dx_up, g = self.up.backward(ops, params, x, d_up)
        grads.update(g)
        return dx + dx_up, grads
