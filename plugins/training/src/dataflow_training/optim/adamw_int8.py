"""AdamW with block-wise 8-bit moments (``--optimizer-states int8``): each moment is kept
as one-byte codes plus a float32 scale per block (``blockwise8``), 2.03 bytes a parameter
for both instead of 8 (float32) or 4 (bfloat16).

The update dequantizes both moments of every tensor to float32 working copies, runs the
plain AdamW update over them (the ``adamw_multi`` op, the same fused kernel as
``--optimizer-states fp32``), and quantizes the new moments back into the packed state in
place. So the weights move exactly as float32 AdamW would from the moments as stored; what
int8 changes is only what the moments keep between steps. ``lr`` and ``step`` may be
device tensors (``scalars``): nothing is read back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataflow_training.optim.blockwise8 import dequantize, quantize_

#: the state fields, in the order ``optim.builtins.ADAMW_INT8`` declares them
FIELDS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def adamw_int8_update(
    ops: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    *,
    step: Any,
    policy: Mapping[str, Any],
    weight_decay: float,
    roles: Sequence[str] = (),
) -> None:
    m_codes, v_codes = states["exp_avg"], states["exp_avg_sq"]
    m_scales, v_scales = states["exp_avg_scale"], states["exp_avg_sq_scale"]
    exp_avgs = [dequantize(c, s) for c, s in zip(m_codes, m_scales, strict=True)]
    exp_avg_sqs = [dequantize(c, s) for c, s in zip(v_codes, v_scales, strict=True)]
    ops["adamw_multi"](
        list(params),
        list(grads),
        exp_avgs,
        exp_avg_sqs,
        step=step,
        lr=policy["lr"],
        beta1=policy["beta1"],
        beta2=policy["beta2"],
        eps=policy["eps"],
        weight_decay=weight_decay,
    )
    for moments, codes, scales in (
        (exp_avgs, m_codes, m_scales),
        (exp_avg_sqs, v_codes, v_scales),
    ):
        for value, code, scale in zip(moments, codes, scales, strict=True):
            quantize_(value, code, scale)
