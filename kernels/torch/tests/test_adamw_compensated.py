"""adamw_compensated_multi: the update of ``param + compensation``, rounded back into both.

- Many small updates: 1,000 AdamW steps at lr 1e-4 of weights in [1, 2), where a
  bfloat16 unit in the last place is 2**-7 (each update about 1/40 of half of it), against
  a float64 AdamW from the same bfloat16 start on the same gradients. Plain bfloat16
  (``adamw_multi`` on bfloat16 weights and moments) rounds every update away: its weights
  never move, so its error is the whole movement (asserted, so that the test would fail
  if the case stopped testing anything). Compensated bfloat16 (the same storage plus a
  bfloat16 compensation) ends within 2 % of the movement for ``param + compensation``
  and 5 % for the bfloat16 weight alone (measured: 0.5 % and 3.1 %; a bfloat16 unit is
  about 8 % of the movement). Both variants.
- float32 compensations are a float32 master weight: against a float32 master stepped by
  ``adamw_multi`` (float32 moments, the bfloat16 gradients) and rounded into a bfloat16
  weight after every step, the weights and ``param + compensation`` equal the master's
  bit for bit (the torch variant runs the same fused kernel on the same float32 values;
  the reference variant the same reference formula).
"""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch import adamw_multi as adamw_multi_module
from dataflow_kernels_torch.adamw import adamw_reference
from dataflow_kernels_torch.adamw_multi import adamw_multi

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
SMALL = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
HYPER = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
VARIANTS = ["torch", "reference", pytest.param("triton", marks=pytest.mark.gpu)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OP = "adamw_compensated_multi"


def zeros(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device=device)


def registered(manager, name: str, device: str) -> None:
    """Skip where variant ``name`` does not run: triton only on CUDA where it is installed
    (its CPU interpreter rounds 16-bit stores by truncation, not to nearest)."""
    if name == "triton" and (
        device != "cuda" or f"{OP}/triton" not in {v.key for v in manager.kernels()}
    ):
        pytest.skip("the triton variant runs on CUDA where triton is installed")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", VARIANTS)
def test_compensated_bf16_tracks_float64_where_plain_bf16_stalls(
    manager, kernel, randn, name, device
):
    registered(manager, name, device)
    n, steps = 2048, 1000
    start = (1 + randn(n, device=device).abs().clamp(max=0.99)).to(BF16)
    drift = randn(n, device=device, scale=0.1) + 0.05
    truth = [start.to(F64), zeros(n, F64, device), zeros(n, F64, device)]
    plain = [start.clone(), zeros(n, BF16, device), zeros(n, BF16, device)]
    compensated = [start.clone(), *(zeros(n, BF16, device) for _ in range(3))]
    update = kernel(OP, name)
    for step in range(1, steps + 1):
        grad = (drift + randn(n, device=device, scale=0.05)).to(BF16)
        adamw_multi(*([t] for t in truth[:1]), [grad.to(F64)], *([t] for t in truth[1:]),
                    step=step, **SMALL)  # fmt: skip
        adamw_multi([plain[0]], [grad], [plain[1]], [plain[2]], step=step, **SMALL)
        update(*([t] for t in compensated[:1]), [grad], *([t] for t in compensated[1:]),
               step=step, **SMALL)  # fmt: skip
    moved = (truth[0] - start.to(F64)).abs().mean()
    assert moved > 0.05  # about 0.1: the updates add up to many bfloat16 units

    def error(weight: torch.Tensor) -> float:
        return float((weight.to(F64) - truth[0]).abs().mean() / moved)

    assert error(plain[0]) > 0.99, "plain bfloat16 should stall (the case tests nothing)"
    assert error(compensated[0].to(F64) + compensated[3].to(F64)) < 0.02
    assert error(compensated[0]) < 0.05


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["torch", "reference"])
def test_float32_compensation_is_a_float32_master_bit_for_bit(kernel, randn, name, device):
    shapes = [(7, 13), (3000,), (1,)]
    weights = [randn(*s, device=device).to(BF16) for s in shapes]
    masters = [w.to(F32) for w in weights]
    ref_states = [[zeros(w.numel(), F32, device).view(w.shape) for w in weights] for _ in "mv"]
    params = [w.clone() for w in weights]
    states = [[zeros(w.numel(), F32, device).view(w.shape) for w in weights] for _ in "mvc"]
    update = kernel(OP, name)
    for step in range(1, 6):
        grads = [randn(*s, device=device).to(BF16) for s in shapes]
        if name == "torch":
            adamw_multi(masters, [g.to(F32) for g in grads], *ref_states, step=step, **HYPER)
        else:
            for master, grad, m, v in zip(masters, grads, *ref_states, strict=True):
                adamw_reference(master, grad, m, v, step=step, **HYPER)
        update(params, grads, *states, step=step, **HYPER)
        for master, param, compensation in zip(masters, params, states[2], strict=True):
            assert torch.equal(param, master.to(BF16))
            assert torch.equal(param.to(F32) + compensation, master)
    for ours, theirs in zip(states[:2], ref_states, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


def test_a_missing_compensation_is_refused_by_name(kernel, randn):
    p = [randn(4).to(BF16), randn(3).to(BF16)]
    g = [t.clone() for t in p]
    m, v = ([torch.zeros_like(t) for t in p] for _ in range(2))
    with pytest.raises(ValueError, match=r"compensations has 1 tensors, params 2"):
        kernel(OP, "torch")(p, g, m, v, [torch.zeros_like(p[0])], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"compensations\[1\] is \(4,\)"):
        kernel(OP, "torch")(p, g, m, v, [torch.zeros(4), torch.zeros(4)], step=1, **HYPER)


@pytest.mark.parametrize("device", DEVICES)
def test_pieces_give_the_bits_of_one_piece(kernel, randn, device, monkeypatch):
    """The torch variant cuts its lists into pieces of ``CHUNK_ELEMENTS`` (its working
    copies bounded): cut at 1,000 elements, across tensors and inside the 3,000-element
    one, with a non-contiguous tensor whole, the result is the uncut one's bit for bit."""
    shapes = [(7, 13), (3000,), (1,), (40, 30)]

    def lists():
        params = [randn(*s, device=device).to(BF16) for s in shapes]
        params[-1] = params[-1].t()  # non-contiguous: updated whole
        grads = [randn(*p.shape, device=device).to(BF16) for p in params]
        states = [[randn(*p.shape, device=device, scale=0.1).to(BF16) for p in params]]
        states.append([(randn(*p.shape, device=device) ** 2).to(BF16) for p in params])
        states.append([randn(*p.shape, device=device, scale=1e-3).to(BF16) for p in params])
        return params, grads, *states

    randn.generator.manual_seed(1)
    whole = lists()
    randn.generator.manual_seed(1)
    cut = lists()
    update = kernel(OP, "torch")
    for step in (1, 2):
        update(*whole, step=step, **HYPER)
        with monkeypatch.context() as patch:
            patch.setattr(adamw_multi_module, "CHUNK_ELEMENTS", 1000)
            update(*cut, step=step, **HYPER)
    for a_list, b_list in zip(whole, cut, strict=True):
        for a, b in zip(a_list, b_list, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("state", [BF16, F32])
def test_the_triton_pass_agrees_with_the_torch_variant(manager, kernel, randn, state):
    """On CUDA the one-pass Triton kernel and the torch variant (the same formula over
    float32 copies) agree over 5 steps, bf16 params with bf16 (``--precision bf16``) or
    float32 (``mixed``) moments and compensation: the master ``param + compensation``
    within float32 rounding of the formula (rtol 1e-5) with float32 state, within one bf16
    unit of the moments' rounding (rtol 1e-3) with bf16; the device-scalar path (a
    replayed CUDA graph's step and lr) on step 3."""
    registered(manager, "triton", "cuda")
    shapes = [(3000,), (7, 13), (1,)]
    params = [randn(*s, device="cuda").to(BF16) for s in shapes]
    lists = [params, *([torch.zeros_like(p, dtype=state) for p in params] for _ in "mvc")]
    theirs = [[t.clone() for t in lst] for lst in lists]
    for step in range(1, 6):
        grads = [randn(*s, device="cuda").to(BF16) for s in shapes]
        given = torch.tensor(float(step), device="cuda") if step == 3 else step
        kernel(OP, "triton")(lists[0], grads, *lists[1:], step=given, **HYPER)
        kernel(OP, "torch")(theirs[0], grads, *theirs[1:], step=step, **HYPER)
    rtol = 1e-5 if state == F32 else 1e-3
    for ours_p, ours_c, p, c in zip(lists[0], lists[3], theirs[0], theirs[3], strict=True):
        torch.testing.assert_close(
            ours_p.double() + ours_c.double(), p.double() + c.double(), rtol=rtol, atol=1e-6
        )
