"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2):
with ``c = beta1 * m + (1 - beta1) * g`` the weight moves by ``lr * (sign(c) + wd * w)``
and the one moment becomes ``beta2 * m + (1 - beta2) * g``. Every update entry is +-lr (or
0), so Lion wants a learning rate 3-10x below AdamW's; its one moment is half of AdamW's
state. Math in float32 over any storage dtype, written back rounded; ``lr`` may be a
device tensor (``scalars``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataflow_training.optim.scalars import as_float


def lion_update(
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
    lr, beta1, beta2 = as_float(policy["lr"]), policy["beta1"], policy["beta2"]
    for p, g, m in zip(params, grads, states["exp_avg"], strict=True):
        w, g32, m32 = p.float(), g.float(), m.float()
        direction = (m32 * beta1 + g32 * (1 - beta1)).sign_()
        w.mul_(1 - lr * weight_decay).sub_(direction * lr)
        m32.mul_(beta2).add_(g32, alpha=1 - beta2)
        p.copy_(w)
        m.copy_(m32)
