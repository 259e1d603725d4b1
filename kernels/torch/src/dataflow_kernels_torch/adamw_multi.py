"""AdamW over lists of tensors: one step, in place, for a whole layer's flat buffers.

``adamw_multi(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
weight_decay) -> None`` applies the ``adamw`` formula (``adamw.py``) to every
``params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]``, in float32 (float64 when the param is
float64) whatever the storage dtypes: params and grads float16, bfloat16, float32 or
float64; states float32 or bfloat16, and they may differ from the params (bfloat16 params
and grads with float32 states is the common case).

- ``adamw_multi`` (fast): the tensors are grouped by (device, the four dtypes); a group
  where all four share one dtype and every tensor is contiguous is one
  ``torch._fused_adamw_`` call (one multi-tensor launch on CUDA for the group). Any other
  group runs the same fused kernel over float32 (float64) working copies of the tensors
  not already in that dtype and contiguous, then copies params and states back: correct
  for any mix, at the cost of those copies (on CUDA the Triton variant,
  ``adamw_triton.py``, does a mixed group in one pass instead).
- ``adamw_multi_reference``: ``adamw_reference`` (plain tensor ops) tensor by tensor.

``adamw_compensated_multi(params, grads, exp_avgs, exp_avg_sqs, compensations, *, ...)``
updates the weights ``params[i] + compensations[i]`` instead of ``params[i]``: each
``master = param + compensation`` is summed in float32, stepped by ``adamw_multi`` (the
formula above, fused), then rounded to nearest into ``param``, and what the rounding lost,
``master - param`` (exact in float32: the two are within a unit of ``param`` of each
other), goes into ``compensation`` in its own dtype. With bfloat16 compensations that is
Kahan-style compensated summation: an update far below a unit in the last place of a
bfloat16 weight accumulates in the compensation until it moves the weight, where a plain
bfloat16 update rounds it away. With float32 compensations ``param + compensation`` *is*
a float32 master weight, bit for bit (the low half of it, kept beside the bfloat16 high
half): the same update as a float32 master copy rounded into a bfloat16 weight, with a
zero start meaning "the master equals the weight". ``adamw_compensated_multi_reference``
does the same with ``adamw_reference`` per tensor.

Neither synchronizes with the device: the step count reaches the fused kernel as a float32
tensor filled on the device, one fill for all tensors.

``step`` and ``lr`` may also be 0-d float32 tensors on the parameters' device (what the
engine hands a step it replays from a CUDA graph, so each replay reads the current
values): the fused kernel reads them there; the reference reads them back to the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dataflow_kernels_torch._support import has_kernel
from dataflow_kernels_torch.adamw import adamw_reference

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


#: A step count or learning rate: a number, or a 0-d tensor on the device.
Scalar = int | float | torch.Tensor


def host(value: Scalar) -> float:
    """A scalar's value on the host (reads a tensor back: for the reference paths)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def adamw_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over the lists, fused where the dtypes allow (module doc)."""
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        key = (p.device, p.dtype, grads[i].dtype, exp_avgs[i].dtype, exp_avg_sqs[i].dtype)
        groups.setdefault(key, []).append(i)
    for (device, *_), indices in groups.items():
        tensors = [[lst[i] for i in indices] for lst in (params, grads, exp_avgs, exp_avg_sqs)]
        if not has_kernel("aten::_fused_adamw_", device.type):
            hyper = dict(hyper, lr=host(lr))
            for p, g, m, v in zip(*tensors, strict=True):
                adamw_reference(p, g, m, v, step=int(host(step)), **hyper)
        else:
            fused_group(*tensors, step=step, **hyper)


def adamw_multi_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over the lists with ``adamw_reference``, tensor by tensor."""
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    step, lr = int(host(step)), host(lr)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        adamw_reference(
            p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay,
        )  # fmt: skip


def fused_group(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: Scalar,
    **hyper: Scalar,
) -> None:
    """``torch._fused_adamw_`` over one group of one device: directly when every tensor is
    contiguous in the compute dtype, else over working copies that are, copied back."""
    compute = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    uniform = {t.dtype for lst in (params, grads, exp_avgs, exp_avg_sqs) for t in lst}
    if len(uniform) == 1:  # one dtype throughout: the kernel takes it as it is
        compute = params[0].dtype
    work = [[_working(t, compute) for t in lst] for lst in (params, grads, exp_avgs, exp_avg_sqs)]
    if isinstance(step, torch.Tensor):  # read on the device by the kernel, never copied
        state_steps = [step.to(torch.float32)] * len(params)
    else:
        filled = torch.full(
            (len(params),), float(step), dtype=torch.float32, device=params[0].device
        )
        state_steps = list(filled.unbind())
    with torch.no_grad():
        torch._fused_adamw_(
            *work,
            [],
            state_steps,
            lr=hyper["lr"],
            beta1=hyper["beta1"],
            beta2=hyper["beta2"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            amsgrad=False,
            maximize=False,
        )
        for stored_list, work_list in (
            (params, work[0]),
            (exp_avgs, work[2]),
            (exp_avg_sqs, work[3]),
        ):
            for stored, computed in zip(stored_list, work_list, strict=True):
                if computed is not stored:
                    stored.copy_(computed)


def _working(t: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """t itself when it is contiguous in ``compute``, else a contiguous copy in it."""
    if t.dtype == compute and t.is_contiguous():
        return t
    return t.to(compute, memory_format=torch.contiguous_format, copy=True)


def check_lists(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: Scalar,
) -> None:
    """Lengths, shapes, dtypes, devices and the step, named on failure (a step given as a
    device tensor is not read back to check it)."""
    if isinstance(step, torch.Tensor):
        if step.dim() != 0 or not step.is_floating_point():
            raise ValueError(f"step as a tensor must be a 0-d float tensor, got {step!r}")
    elif isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the first update is step 1), got {step!r}")
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    for name, lst in lists.items():
        if len(lst) != len(params):
            raise ValueError(
                f"adamw_multi: {name} has {len(lst)} tensors, params {len(params)}: they must match"
            )
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise ValueError(f"adamw_multi: params[{i}] must be floating point, got {p.dtype}")
        for name, lst in lists.items():
            t = lst[i]
            if t.shape != p.shape or t.device != p.device:
                raise ValueError(
                    f"adamw_multi: {name}[{i}] is {tuple(t.shape)} on {t.device}, params[{i}] "
                    f"{tuple(p.shape)} on {p.device}: they must match"
                )
            if not t.is_floating_point() or (name != "grads" and t.dtype not in _STATE_DTYPES):
                raise ValueError(f"adamw_multi: {name}[{i}] has unsupported dtype {t.dtype}")


#: Elements ``adamw_compensated_multi`` updates at once: its float32 working copies
#: (the masters, and ``adamw_multi``'s of bfloat16 grads and moments) take 16 bytes an
#: element, 256 MiB at most, beside the step however large a parameter group is (a
#: Llama 3 8B embedding is 525M elements: 8.4 GB of copies in one piece).
CHUNK_ELEMENTS = 1 << 24


def adamw_compensated_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    compensations: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of the weights ``params + compensations`` (module doc), fused where
    the dtypes allow: the float32 sums go through ``adamw_multi`` as lists of at most
    ``CHUNK_ELEMENTS`` elements in all (contiguous tensors are cut into flat pieces), so
    the float32 working copies never take more than that many elements' worth."""
    check_compensations(params, compensations)
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    lists = (params, grads, exp_avgs, exp_avg_sqs, compensations)
    with torch.no_grad():
        for p, g, m, v, c in _pieces(lists, CHUNK_ELEMENTS):
            masters = [_sum32(param, comp) for param, comp in zip(p, c, strict=True)]
            adamw_multi(
                masters, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay,
            )  # fmt: skip
            _round_into(masters, p, c)


def _pieces(
    lists: Sequence[Sequence[torch.Tensor]], limit: int
) -> Iterator[list[list[torch.Tensor]]]:
    """The parallel ``lists`` as batches of parallel lists of at most ``limit`` elements
    each (a non-contiguous tensor whole, in a batch of its own when larger): a contiguous
    tensor larger than ``limit`` is cut into flat slices, views of it."""
    batch: list[list[torch.Tensor]] = [[] for _ in lists]
    count = 0
    for tensors in zip(*lists, strict=True):
        n = tensors[0].numel()
        if all(t.is_contiguous() for t in tensors):
            flats = [t.view(-1) for t in tensors]
            slices = [[f[a : a + limit] for f in flats] for a in range(0, n, limit)]
        else:
            slices = [list(tensors)]
        for piece in slices:
            size = piece[0].numel()
            if count and count + size > limit:
                yield batch
                batch, count = [[] for _ in lists], 0
            for out, t in zip(batch, piece, strict=True):
                out.append(t)
            count += size
    if count:
        yield batch


def adamw_compensated_multi_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    compensations: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """``adamw_compensated_multi`` with ``adamw_reference`` (plain tensor ops), tensor by
    tensor."""
    check_compensations(params, compensations)
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    step, lr = int(host(step)), host(lr)
    with torch.no_grad():
        for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, compensations, strict=True):
            master = _sum32(p, c)
            adamw_reference(
                master, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay,
            )  # fmt: skip
            _round_into([master], [p], [c])


def _sum32(param: torch.Tensor, compensation: torch.Tensor) -> torch.Tensor:
    """``param + compensation`` as a new contiguous float32 tensor (float64 for float64)."""
    compute = torch.float64 if param.dtype == torch.float64 else torch.float32
    master = param.to(compute, memory_format=torch.contiguous_format, copy=True)
    return master.add_(compensation)


def _round_into(
    masters: list[torch.Tensor],
    params: Sequence[torch.Tensor],
    compensations: Sequence[torch.Tensor],
) -> None:
    """Each param the master rounded to nearest in its dtype, each compensation what that
    rounding lost (``master - param``, exact in float32) rounded into its own dtype."""
    for master, param, compensation in zip(masters, params, compensations, strict=True):
        param.copy_(master)
        compensation.copy_(master.sub_(param))


def check_compensations(
    params: Sequence[torch.Tensor], compensations: Sequence[torch.Tensor]
) -> None:
    """One compensation per param, of its shape and device, in a state dtype."""
    if len(compensations) != len(params):
        raise ValueError(
            f"adamw_compensated_multi: compensations has {len(compensations)} tensors, params "
            f"{len(params)}: they must match"
        )
    for i, (p, c) in enumerate(zip(params, compensations, strict=True)):
        if c.shape != p.shape or c.device != p.device or c.dtype not in _STATE_DTYPES:
            raise ValueError(
                f"adamw_compensated_multi: compensations[{i}] is {tuple(c.shape)} {c.dtype} on "
                f"{c.device}, params[{i}] {tuple(p.shape)} on {p.device}: same shape and "
                "device, a float32 or bfloat16 dtype"
            )
