"""Rotary position embeddings (RoPE), HF's rotate-half convention, with Llama 3 scaling
and partial rotation (only the first ``rotary_dim`` of each head, as Qwen 3.5's full
attention rotates a quarter).

The rotation of a head vector is linear, ``y = x * cos + rotate_half(x) * sin``, so its
backward is the transposed rotation: ``dx = dy * cos + rotate_half_t(dy * sin)`` with
``rotate_half_t(u) = cat(u2, -u1)``. Nothing is saved: the tables depend only on
positions.

Positions are ``0 .. seq - 1`` for every row (``tables``, kept by ``cached_tables``), or
each token's own (``position_tables`` of a ``Segments``' positions: packed sequences,
sequences that continue from an offset), made on the device each time they are asked for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import attrs
import torch


@attrs.frozen
class Llama3Scaling:
    """Llama 3.1's frequency scaling (HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(
    rotary_dim: int,
    base: float,
    scaling: Llama3Scaling | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float64 (rotary_dim // 2,) angular frequencies, scaled as Llama 3 does."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    inv = 1.0 / base ** (steps / rotary_dim)
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return torch.where(middle, blended, scaled)


def tables(
    seq_len: int,
    rotary_dim: int,
    base: float,
    *,
    scaling: Llama3Scaling | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, rotary_dim), computed in float64 on ``device`` then cast.

    Made on the device itself, never copied from the host: a task may make them while
    the step's CUDA graph is captured, where a host-to-device copy cannot be."""
    inv = inverse_frequencies(rotary_dim, base, scaling, device)
    positions = torch.arange(seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def position_tables(
    positions: torch.Tensor,
    rotary_dim: int,
    base: float,
    *,
    scaling: Llama3Scaling | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (batch, 1, seq, rotary_dim), of per-token ``positions`` (batch,
    seq): ``tables``' rows at those positions, computed in float64 on their device (so
    they broadcast over the heads of a (batch, heads, seq, dim) tensor)."""
    inv = inverse_frequencies(rotary_dim, base, scaling, positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


#: ``cached_tables``' tables by (length, rotation, base, scaling, device, dtype); at most
#: ``_KEPT`` of them, the oldest dropped first
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_KEPT = 32


def cached_tables(
    seq_len: int,
    rotary_dim: int,
    base: float,
    scaling: Llama3Scaling | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tables`` made once per (length, rotation, device, dtype) and kept: a block's
    forward, recompute and backward all take the same two tensors, already on the device
    (nothing is copied from the host while a step runs). Callers must not write into them.

    Under torch.compile the lookup is traced and the tables it finds become inputs of the
    compiled graph. The graph of a caller that finds none makes them and fills the cache
    (dynamo replays the dict's write after the graph); the changed cache fails that
    graph's guard, so the caller is compiled once more, taking them as inputs. A
    ``functools.lru_cache`` here would be traced through: every compiled block made its
    tables again, in float64, fused into the kernels that use them (session 19: 65 ms of
    OLMoE's 507 ms of kernels a 16K-token round went to one such q/k-norm backward)."""
    scale = None
    if scaling is not None:
        scale = (
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position,
        )
    key = (seq_len, rotary_dim, base, scale, device.type, device.index, dtype)
    found = _TABLES.get(key)
    if found is None:
        found = tables(seq_len, rotary_dim, base, scaling=scaling, device=device, dtype=dtype)
        if _capturing(device):  # filled only when the graph replays: not kept
            return found
        while len(_TABLES) >= _KEPT:
            del _TABLES[next(iter(_TABLES))]
        _TABLES[key] = found
    return found


def _capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph just now: tables
    made then hold nothing until the graph replays (and nothing ever, should the capture
    fail and the engine dispatch the step instead), so the cache does not keep them.
    Under torch.compile's tracing this is not asked (no graph break)."""
    return (
        device.type == "cuda"
        and not torch.compiler.is_compiling()
        and torch.cuda.is_current_stream_capturing()
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_t(u: torch.Tensor) -> torch.Tensor:
    u1, u2 = u.chunk(2, dim=-1)
    return torch.cat((u2, -u1), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of every head of x (batch, heads, seq, dim)."""
    rot = cos.shape[-1]
    head, rest = x[..., :rot], x[..., rot:]
    out = head * cos + _rotate_half(head) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``apply`` with respect to x."""
    rot = cos.shape[-1]
    head, rest = dy[..., :rot], dy[..., rot:]
    out = head * cos + _rotate_half_t(head * sin)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


# -- the positions part ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary positions, as a part of an attention: the config's ``rope_theta`` and
    ``rope_scaling`` (None or ``Llama3Scaling``) over the first ``fraction`` of each head
    (1: all of ``head_dim``; Qwen 3.5's full attention rotates a quarter). No parameters,
    nothing saved (the tables depend only on positions), no HF keys; its cost is
    elementwise and left to the attention's bytes."""

    fraction: float = 1.0

    def rotary_dim(self, config: Any) -> int:
        dim = int(config.head_dim * self.fraction)
        if dim % 2 or not 0 < dim <= config.head_dim:
            raise ValueError(
                f"{type(config).__name__}: rotating {self.fraction} of head_dim "
                f"{config.head_dim} gives {dim} dims; it must be even and at least 2"
            )
        return dim

    def tables(
        self, config: Any, like: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for ``like``'s sequence length (dim 1), device and dtype; with
        ``positions`` (batch, seq), each token's own (``position_tables``)."""
        if positions is not None:
            return position_tables(
                positions,
                self.rotary_dim(config),
                float(config.rope_theta),
                scaling=config.rope_scaling,
                dtype=like.dtype,
            )
        return cached_tables(
            like.shape[1],
            self.rotary_dim(config),
            float(config.rope_theta),
            config.rope_scaling,
            like.device,
            like.dtype,
        )

    def reference_args(self, config: Any) -> dict[str, Any]:
        """What the reference attention takes of it (``rotary_dim``)."""
        return {"rotary_dim": self.rotary_dim(config)}
