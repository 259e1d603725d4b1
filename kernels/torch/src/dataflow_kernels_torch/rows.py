"""Row writes over a window of which only some rows count (MoE expert shards).

A shard of a layer's experts works over a window of every expert row of the layer, its
own first (``kit.moe.ShardWindow``), so that its shapes do not depend on the routing and a
CUDA graph can replay it. Only the rows ``valid`` marks are the shard's; the others hold
whatever their buffers held (anything, NaN included) and must cost as little as can be:

- ``rows_add_masked(rows, into, valid, weights, count, *, slices=1) -> out``: ``out``
  (count, hidden) float32 (float64 for float64 rows), zero but for ``out[into[i]] +=
  rows[i] * weights[i]`` over every ``i`` with ``valid[i]`` (``weights`` (R,) or None:
  no factor). rows (R, hidden); into (R,) int64, read only where valid; valid (R,) bool.
  ``slices`` cuts the float32 copy of the rows a variant makes into that many pieces (the
  torch variant's workspace; others may ignore it).
- ``rows_put_masked(values, index, valid, target) -> None``: ``target[index[i]] =
  values[i]`` (in target's dtype) for every ``i`` with ``valid[i]``; the other rows of
  ``target`` keep theirs. values (R, ...) and target (N, ...) with the same trailing
  shape; index (R,) int64 in range and without repeats, the invalid rows' entries too
  (the torch variant rewrites those rows with what they held; a window's rows are a
  permutation of the layer's).

- ``rows_gather_masked(source, index, valid) -> out``: ``out`` (R, width) in source's
  dtype, ``out[i] = source[index[i]]`` for every ``i`` with ``valid[i]``; the other rows
  of ``out`` hold anything (the torch variant gathers them too, the Triton variant leaves
  them as the new buffer held them). source (N, width); index (R,) int64 in range, the
  invalid rows' entries too. An MoE shard's window gathers its rows' inputs this way
  (``moe_in[tokens]``, ``dy[tokens]``, ``gate_up[rows]``: every window row, four times
  the shard's at four shards), and every consumer of the gathered rows reads the valid
  ones alone (the grouped GEMMs stop at the shard's offsets, the masked adds and puts).

- ``swiglu_rows_bwd(gate_up, d_act, weights, valid) -> (act, d_gate_up, d_weights)``:
  the SwiGLU part of an expert shard's backward over its window rows. gate_up (R, 2i)
  (each row's gate then up projections), d_act (R, i) (the gradient of the experts'
  down projection's input, before the rows' routing weights), weights (R,), valid (R,)
  bool. -> ``act`` (R, i) ``silu(gate) * up * weight`` (what the down projection's
  weight gradient takes), ``d_gate_up`` (R, 2i) the gradients of gate and up given
  ``d_act * weight``, both in gate_up's dtype; ``d_weights`` (R,) float32 (float64 for
  float64 rows) the routing weights' gradients ``sum(silu(gate) * up * d_act)``. Rows not
  valid hold anything.

Variants:

- ``reference``: the valid rows picked out on the host (a device-to-host read), summed by
  ``index_add_`` in float64 on the CPU and returned on the rows' device: deterministic, any
  device; the truth the others are tested against (its gather: zeros where not valid).
- ``torch``: every row, in ``slices`` pieces: the rows cast to float32, scaled, and
  ``index_add_``-ed into their tokens, the rows not valid into one row past the tokens
  that is dropped (no host read: capturable); ``rows_put_masked`` rewrites every window
  row, the invalid ones with what ``target`` held; ``rows_gather_masked`` gathers every
  row (``index_select``); ``swiglu_rows_bwd`` runs the elementwise ops the shard's
  backward ran before it (every row: the SwiGLU, the weights' products, a concatenation).
  On CUDA the adds are atomics (the order of a token's sum varies: not deterministic
  there).
- ``triton`` (``triton_kernels.py``, CUDA): one pass over the rows where only valid rows
  load, multiply and add (atomics into float32) or store: the loads and atomics of a row
  not valid are masked off (no memory traffic), though its tile's program still runs. At
  qwen3_5_moe_cut's batch 2 the torch variant's cast, scale and ``index_add_`` over the
  whole window (every invalid row adding into the one dropped row, a hot spot for the
  atomics) took about 1.8 ms of a shard's 3.1 ms forward task on the H200 (session 42,
  ``results/tasks_qwen3_5_moe_cut_b2_h200_session42.json``); with this variant a forward
  shard took 0.95 ms on the H100 and a backward shard 2.58 ms (session 43's profile
  archive), where session 41's, before the window (each shard's exact rows, their count
  read on the host, no graph), took 1.17 and 2.00 ms: the backward's gathers and
  elementwise ops over every window row cost more than the window ops save.
"""

from __future__ import annotations

import torch

from dataflow_kernels_torch import elementwise


def check_add(rows: torch.Tensor, into: torch.Tensor, valid: torch.Tensor, weights) -> None:
    """``rows_add_masked``'s shapes and ``valid``'s dtype, or ValueError naming the operand."""
    if rows.dim() != 2:
        raise ValueError(f"rows_add_masked: rows must be (R, hidden), got {tuple(rows.shape)}")
    for name, t in (("into", into), ("valid", valid), ("weights", weights)):
        if t is not None and tuple(t.shape) != (rows.shape[0],):
            raise ValueError(
                f"rows_add_masked: {name} must be ({rows.shape[0]},), got {tuple(t.shape)}"
            )
    if valid.dtype != torch.bool:
        raise ValueError(f"rows_add_masked: valid must be bool, got {valid.dtype}")


def _accumulator(rows: torch.Tensor) -> torch.dtype:
    return torch.float64 if rows.dtype == torch.float64 else torch.float32


def rows_add_masked_reference(
    rows: torch.Tensor,
    into: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor | None,
    count: int,
    *,
    slices: int = 1,
) -> torch.Tensor:
    """The valid rows alone, summed in float64 on the CPU (see the module docstring)."""
    check_add(rows, into, valid, weights)
    keep = valid.cpu()
    picked = rows.detach().cpu()[keep].double()
    if weights is not None:
        picked = picked * weights.detach().cpu()[keep].double()[:, None]
    out = torch.zeros(count, rows.shape[1], dtype=torch.float64)
    out.index_add_(0, into.cpu()[keep], picked)
    return out.to(device=rows.device, dtype=_accumulator(rows))


def rows_add_masked(
    rows: torch.Tensor,
    into: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor | None,
    count: int,
    *,
    slices: int = 1,
) -> torch.Tensor:
    """Every row, in ``slices`` pieces, the invalid ones into a dropped row past ``count``
    (see the module docstring)."""
    check_add(rows, into, valid, weights)
    acc = _accumulator(rows)
    target = torch.where(valid, into, count)
    out = torch.zeros(count + 1, rows.shape[1], dtype=acc, device=rows.device)
    step = -(-rows.shape[0] // max(slices, 1)) if rows.shape[0] else 1
    for first in range(0, rows.shape[0], step):
        part = rows[first : first + step].to(acc, copy=True)  # never scale the caller's rows
        if weights is not None:
            part.mul_(weights[first : first + step, None])
        out.index_add_(0, target[first : first + step], part)
    return out[:count]


def check_put(values, index, valid, target) -> None:
    """``rows_put_masked``'s shapes and ``valid``'s dtype, or ValueError naming them."""
    if values.shape[1:] != target.shape[1:] or tuple(index.shape) != (values.shape[0],):
        raise ValueError(
            f"rows_put_masked: values {tuple(values.shape)}, index {tuple(index.shape)} and "
            f"target {tuple(target.shape)} do not agree (values (R, ...), index (R,), "
            "target (N, ...))"
        )
    if tuple(valid.shape) != (values.shape[0],) or valid.dtype != torch.bool:
        raise ValueError(f"rows_put_masked: valid must be ({values.shape[0]},) bool")


def rows_put_masked_reference(
    values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> None:
    """The valid rows picked out (a host read) and written."""
    check_put(values, index, valid, target)
    keep = valid.nonzero().squeeze(1)
    target[index[keep]] = values[keep].to(target.dtype)


def rows_put_masked(
    values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> None:
    """Every window row rewritten, the invalid ones with what ``target`` held (no host
    read)."""
    check_put(values, index, valid, target)
    mask = valid.view(-1, *([1] * (values.dim() - 1)))
    kept = target[index]
    target.index_copy_(0, index, torch.where(mask, values.to(target.dtype), kept))


def check_gather(source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
    """``rows_gather_masked``'s shapes and dtypes, or ValueError naming the operand."""
    if source.dim() != 2:
        raise ValueError(
            f"rows_gather_masked: source must be (N, width), got {tuple(source.shape)}"
        )
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(
            f"rows_gather_masked: index must be (R,) int64, got {tuple(index.shape)} {index.dtype}"
        )
    if tuple(valid.shape) != tuple(index.shape) or valid.dtype != torch.bool:
        raise ValueError(f"rows_gather_masked: valid must be ({index.shape[0]},) bool")


def rows_gather_masked_reference(
    source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The valid rows picked out on the host and gathered; zeros where not valid."""
    check_gather(source, index, valid)
    keep = valid.cpu()
    out = torch.zeros(index.shape[0], source.shape[1], dtype=source.dtype)
    out[keep] = source.detach().cpu()[index.cpu()[keep]]
    return out.to(source.device)


def rows_gather_masked(
    source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Every row gathered (``index_select``; no host read)."""
    check_gather(source, index, valid)
    return source.index_select(0, index)


def check_swiglu_rows(
    gate_up: torch.Tensor, d_act: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> None:
    """``swiglu_rows_bwd``'s shapes and ``valid``'s dtype, or ValueError naming them."""
    rows = gate_up.shape[0] if gate_up.dim() == 2 else -1
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(
            f"swiglu_rows_bwd: gate_up must be (R, 2 * inner), got {tuple(gate_up.shape)}"
        )
    if tuple(d_act.shape) != (rows, gate_up.shape[1] // 2):
        raise ValueError(
            f"swiglu_rows_bwd: d_act must be ({rows}, {gate_up.shape[1] // 2}), got "
            f"{tuple(d_act.shape)}"
        )
    if tuple(weights.shape) != (rows,):
        raise ValueError(f"swiglu_rows_bwd: weights must be ({rows},), got {tuple(weights.shape)}")
    if tuple(valid.shape) != (rows,) or valid.dtype != torch.bool:
        raise ValueError(f"swiglu_rows_bwd: valid must be ({rows},) bool")


def swiglu_rows_bwd_reference(
    gate_up: torch.Tensor, d_act: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The formulas in float64 on the CPU over the valid rows, rounded once; zeros where
    not valid."""
    check_swiglu_rows(gate_up, d_act, weights, valid)
    keep = valid.cpu()
    gate, up = gate_up.detach().cpu()[keep].double().chunk(2, dim=-1)
    d = d_act.detach().cpu()[keep].double()
    w = weights.detach().cpu()[keep].double()[:, None]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = torch.zeros(gate_up.shape[0], d_act.shape[1], dtype=torch.float64)
    d_gate_up = torch.zeros(gate_up.shape, dtype=torch.float64)
    d_weights = torch.zeros(gate_up.shape[0], dtype=torch.float64)
    act[keep] = silu * up * w
    d_weights[keep] = (silu * up * d).sum(-1)
    d_gate_up[keep] = torch.cat((d * w * up * sig * (1 + gate * (1 - sig)), d * w * silu), -1)
    device, dtype = gate_up.device, gate_up.dtype
    return (
        act.to(device, dtype),
        d_gate_up.to(device, dtype),
        d_weights.to(device, _accumulator(gate_up)),
    )


def swiglu_rows_bwd(
    gate_up: torch.Tensor, d_act: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row: the SwiGLU and its derivatives by the torch elementwise ops, each
    product rounded to the rows' dtype as the shard's backward did before this op."""
    check_swiglu_rows(gate_up, d_act, weights, valid)
    gate, up = gate_up.chunk(2, dim=-1)
    act = elementwise.swiglu_fwd(gate, up)
    d_weights = (act * d_act).sum(-1).to(_accumulator(gate_up))
    weight = weights.to(act.dtype).unsqueeze(-1)
    act.mul_(weight)
    d_gate, d_up = elementwise.swiglu_bwd(d_act * weight, gate, up)
    return act, torch.cat((d_gate, d_up), dim=-1), d_weights
