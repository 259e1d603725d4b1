"""Layer norm and RMS norm as explicit forward/backward pairs over the last dimension: the
forward returns the statistics its backward takes.

``layer_norm_fwd(x, weight, bias, eps) -> (y, mean, rstd)`` and
``layer_norm_bwd(dy, x, mean, rstd, weight, bias) -> (dx, dweight, dbias)``, with
``xhat = (x - mean) * rstd``, ``rstd = 1 / sqrt(var(x) + eps)`` (biased variance)::

    y       = xhat * weight + bias
    dxhat   = dy * weight
    dx      = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dweight = sum over rows of dy * xhat;   dbias = sum over rows of dy

``rms_norm_fwd(x, weight, eps) -> (y, rstd)`` and
``rms_norm_bwd(dy, x, rstd, weight) -> (dx, dweight)``, with
``rstd = 1 / sqrt(mean(x**2) + eps)``, ``xhat = x * rstd``::

    y       = xhat * weight
    dx      = rstd * (dxhat - xhat * mean(dxhat * xhat))
    dweight = sum over rows of dy * xhat

``mean`` and ``rstd`` have shape ``x.shape[:-1]`` in the statistics dtype (float32;
float64 for float64 inputs); dweight and dbias come in weight's dtype, None where weight or
bias is None. Any variant's backward accepts any variant's forward statistics.

Fast variants: ``aten.native_layer_norm`` / ``native_layer_norm_backward`` (CPU and CUDA;
on CPU, 16-bit inputs run the formulas, because the CPU kernels keep 16-bit statistics);
``aten._fused_rms_norm`` for the RMS forward (CPU and CUDA) and
``aten._fused_rms_norm_backward`` where this build has a kernel for the device (CUDA
builds of torch 2.8 on; not CPU), else the formulas. The reference variants are the
formulas in the statistics dtype. Nothing here builds an autograd graph.
"""

from __future__ import annotations

import torch

from dataflow_kernels_torch._support import HALF_DTYPES, has_kernel, stats_dtype

_aten = torch.ops.aten


def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y like x, mean, rstd); see the module doc."""
    if not _aten_layer_norm_applies(x):
        return layer_norm_fwd_reference(x, weight, bias, eps)
    _check(x, weight, "layer_norm")
    with torch.no_grad():
        y, mean, rstd = _aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    stats = stats_dtype(x.dtype)
    return y, mean.reshape(x.shape[:-1]).to(stats), rstd.reshape(x.shape[:-1]).to(stats)


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """-> (dx like x, dweight, dbias); see the module doc."""
    if not _aten_layer_norm_applies(x):
        return layer_norm_bwd_reference(dy, x, mean, rstd, weight, bias)
    _check_stats(dy, x, (mean, rstd), "layer_norm_bwd")
    stats_shape = (*x.shape[:-1], 1)
    stats = stats_dtype(x.dtype)
    with torch.no_grad():
        dx, dweight, dbias = _aten.native_layer_norm_backward(
            dy,
            x,
            [x.shape[-1]],
            mean.to(stats).reshape(stats_shape),
            rstd.to(stats).reshape(stats_shape),
            weight,
            bias,
            [True, weight is not None, bias is not None],
        )
    return dx, dweight, dbias


def layer_norm_fwd_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer-norm forward formulas in the statistics dtype."""
    _check(x, weight, "layer_norm")
    compute = stats_dtype(x.dtype)
    with torch.no_grad():
        xc = x.to(compute)
        mean = xc.mean(dim=-1)
        centered = xc - mean.unsqueeze(-1)
        rstd = torch.rsqrt(centered.square().mean(dim=-1) + eps)
        y = _affine(centered * rstd.unsqueeze(-1), weight, bias)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The layer-norm backward formulas in the statistics dtype."""
    _check_stats(dy, x, (mean, rstd), "layer_norm_bwd")
    compute = stats_dtype(x.dtype)
    with torch.no_grad():
        rstd_c = rstd.to(compute).unsqueeze(-1)
        xhat = (x.to(compute) - mean.to(compute).unsqueeze(-1)) * rstd_c
        dy_c = dy.to(compute)
        dxhat = dy_c if weight is None else dy_c * weight.to(compute)
        dx = rstd_c * (
            dxhat
            - dxhat.mean(dim=-1, keepdim=True)
            - xhat * (dxhat * xhat).mean(dim=-1, keepdim=True)
        )
        rows = tuple(range(x.dim() - 1))
        dweight = None if weight is None else (dy_c * xhat).sum(dim=rows).to(weight.dtype)
        dbias = None if bias is None else dy_c.sum(dim=rows).to(bias.dtype)
    return dx.to(x.dtype), dweight, dbias


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y like x, rstd); see the module doc."""
    _check(x, weight, "rms_norm")
    with torch.no_grad():
        y, rstd = _aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return y, rstd.reshape(x.shape[:-1]).to(stats_dtype(x.dtype))


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (dx like x, dweight); see the module doc."""
    if not has_kernel("aten::_fused_rms_norm_backward", x.device.type):
        return rms_norm_bwd_reference(dy, x, rstd, weight)
    _check_stats(dy, x, (rstd,), "rms_norm_bwd")
    with torch.no_grad():
        dx, dweight = _aten._fused_rms_norm_backward(
            dy,
            x,
            [x.shape[-1]],
            rstd.to(stats_dtype(x.dtype)).reshape(*x.shape[:-1], 1),
            weight,
            [True, weight is not None],
        )
    return dx, dweight


def rms_norm_fwd_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMS-norm forward formulas in the statistics dtype."""
    _check(x, weight, "rms_norm")
    with torch.no_grad():
        xc = x.to(stats_dtype(x.dtype))
        rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
        y = _affine(xc * rstd.unsqueeze(-1), weight, None)
    return y.to(x.dtype), rstd


def rms_norm_bwd_reference(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RMS-norm backward formulas in the statistics dtype."""
    _check_stats(dy, x, (rstd,), "rms_norm_bwd")
    compute = stats_dtype(x.dtype)
    with torch.no_grad():
        rstd_c = rstd.to(compute).unsqueeze(-1)
        xhat = x.to(compute) * rstd_c
        dy_c = dy.to(compute)
        dxhat = dy_c if weight is None else dy_c * weight.to(compute)
        dx = rstd_c * (dxhat - xhat * (dxhat * xhat).mean(dim=-1, keepdim=True))
        rows = tuple(range(x.dim() - 1))
        dweight = None if weight is None else (dy_c * xhat).sum(dim=rows).to(weight.dtype)
    return dx.to(x.dtype), dweight


def _aten_layer_norm_applies(x: torch.Tensor) -> bool:
    return not (x.device.type == "cpu" and x.dtype in HALF_DTYPES)


def _affine(
    xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if weight is not None:
        xhat = xhat * weight.to(xhat.dtype)
    if bias is not None:
        xhat = xhat + bias.to(xhat.dtype)
    return xhat


def _check(x: torch.Tensor, weight: torch.Tensor | None, op: str) -> None:
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"{op} expects a float x with a last dimension, got {x.dtype} {x.shape}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"{op} expects weight ({x.shape[-1]},) for x {tuple(x.shape)}, got "
            f"{tuple(weight.shape)}"
        )


def _check_stats(
    dy: torch.Tensor, x: torch.Tensor, stats: tuple[torch.Tensor, ...], op: str
) -> None:
    if dy.shape != x.shape:
        raise ValueError(f"{op} expects dy shaped like x {tuple(x.shape)}, got {tuple(dy.shape)}")
    for stat in stats:
        if stat.shape != x.shape[:-1]:
            raise ValueError(
                f"{op} expects statistics of shape x.shape[:-1] = {tuple(x.shape[:-1])}, got "
                f"{tuple(stat.shape)}"
            )
