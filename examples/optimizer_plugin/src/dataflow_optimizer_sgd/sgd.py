"""SGD with momentum over the lists of one parameter group's tensors.

``b = momentum * b + (1 - dampening) * g`` (``b = g`` on the first step), the direction
``g + momentum * b`` with Nesterov, else ``b``; weight decay is decoupled (``w *= 1 - lr *
wd``) as dataflow's builtins do. Math in float32 over any storage dtype."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def sgd_update(
    ops: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    *,
    step: int,
    policy: Mapping[str, Any],
    weight_decay: float,
    roles: Sequence[str] = (),
) -> None:
    lr, momentum = float(policy["lr"]), policy["momentum"]
    for p, g, b in zip(params, grads, states["momentum"], strict=True):
        w, g32, b32 = p.float(), g.float(), b.float()
        if step == 1:
            b32.copy_(g32)
        else:
            b32.mul_(momentum).add_(g32, alpha=1 - policy["dampening"])
        direction = g32.add(b32, alpha=momentum) if policy["nesterov"] else b32
        w.mul_(1 - lr * weight_decay).add_(direction, alpha=-lr)
        p.copy_(w)
        b.copy_(b32)
