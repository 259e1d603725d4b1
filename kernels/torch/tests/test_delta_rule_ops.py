"""The gated delta rule ops against a plain per-token recurrence differentiated by
autograd (float64, written here from the rule's definition): the chunked ``torch``
variant and the ``reference`` (a reverse scan by hand), with grouped values, lengths that
are not whole chunks and several chunks; ``fla``'s variant against the reference on CUDA
(``gpu``)."""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch import delta_rule
from dataflow_kernels_torch.delta_rule import (
    gated_delta_rule_bwd_reference,
    gated_delta_rule_fwd_reference,
)

#: (forward, backward) of each variant held to the recurrence here
VARIANTS = {
    "torch": (delta_rule.gated_delta_rule_fwd, delta_rule.gated_delta_rule_bwd),
    "reference": (gated_delta_rule_fwd_reference, gated_delta_rule_bwd_reference),
}


def recurrence(q, k, v, g, beta, scale):
    """o_t = scale * S_t^T q_t, S_t = a S + beta k (v - (a S)^T k)^T, a = exp(g_t); q, k
    (B, T, Hk, K), v (B, T, Hv, V), one key head for each group of value heads."""
    group = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    batch, seq, heads, k_dim = q.shape
    state = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    outs = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        read = (state * k[:, t, ..., None]).sum(-2)
        delta = (v[:, t] - read) * beta[:, t, ..., None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        outs.append(scale * (state * q[:, t, ..., None]).sum(-2))
    return torch.stack(outs, 1)


def inputs(seq, k_heads=2, v_heads=4, k_dim=8, v_dim=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(rand(2, seq, k_heads, k_dim), dim=-1) for _ in "qk")
    v = rand(2, seq, v_heads, v_dim)
    g = -torch.nn.functional.softplus(rand(2, seq, v_heads))  # log decay <= 0
    beta = torch.sigmoid(rand(2, seq, v_heads))
    return [t.to(dtype) for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seq", [1, 7, 64, 150])
def test_each_variant_is_the_recurrence_forward_and_backward(variant, seq):
    forward, backward = VARIANTS[variant]
    q, k, v, g, beta = inputs(seq)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    truth = recurrence(*leaves, scale=0.3)
    out = forward(q, k, v, g, beta, scale=0.3)
    torch.testing.assert_close(out, truth.detach(), rtol=1e-9, atol=1e-10)
    d_out = torch.randn(
        truth.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    expected = torch.autograd.grad(truth, leaves, d_out)
    got = backward(d_out, q, k, v, g, beta, scale=0.3)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_float32_inputs_keep_their_dtype_and_the_default_scale():
    q, k, v, g, beta = inputs(20, dtype=torch.float32)
    out = delta_rule.gated_delta_rule_fwd(q, k, v, g, beta)
    truth = recurrence(*(t.double() for t in (q, k, v, g, beta)), scale=8**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), truth, rtol=1e-4, atol=1e-5)


def test_mismatched_heads_are_refused():
    q, k, v, g, beta = inputs(5, k_heads=3, v_heads=4)
    with pytest.raises(ValueError, match=r"gated_delta_rule: q .* must match and v"):
        delta_rule.gated_delta_rule_fwd(q, k, v, g, beta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_agrees_with_the_reference_on_cuda(dtype):
    pytest.importorskip("fla")
    from dataflow_kernels_torch.plugin import _fla_runs

    if not _fla_runs():  # the variant is not registered with this Triton
        pytest.skip("fla refuses this Triton on Hopper (its issue #640); no fla variant")
    from dataflow_kernels_torch.delta_rule import (
        gated_delta_rule_bwd_fla,
        gated_delta_rule_fwd_fla,
    )

    q, k, v, g, beta = (
        t.to("cuda") for t in inputs(200, k_heads=2, v_heads=4, k_dim=64, v_dim=64, dtype=dtype)
    )
    g = g.float()
    d_out = torch.randn(v.shape, device="cuda", dtype=dtype)
    tolerance = (
        {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    )
    torch.testing.assert_close(
        gated_delta_rule_fwd_fla(q, k, v, g, beta).float(),
        gated_delta_rule_fwd_reference(q, k, v, g, beta).float(),
        **tolerance,
    )
    fast = gated_delta_rule_bwd_fla(d_out, q, k, v, g, beta)
    slow = gated_delta_rule_bwd_reference(d_out, q, k, v, g, beta)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), fast, slow, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(
            a.float(), b.float(), **tolerance, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_fla_variant_is_left_out_with_a_triton_fla_refuses(monkeypatch):
    """fla 0.6 raises at its first gated backward on Hopper with Triton 3.4.0 .. 3.7.0
    (seen on the device): such a Triton registers no fla variant, others do."""
    from dataflow_kernels_torch import plugin

    assert plugin._release("3.5.1+git1234") == (3, 5, 1)
    assert plugin._release("3.7") == (3, 7)
    found = {"fla", "einops", "triton"}
    monkeypatch.setattr(
        plugin.importlib.util, "find_spec", lambda name: object() if name in found else None
    )
    for version, runs in (("3.3.1", True), ("3.4.0", False), ("3.6.0", False), ("3.7.1", True)):
        monkeypatch.setattr(plugin.importlib.metadata, "version", lambda _name, v=version: v)
        assert plugin._fla_runs() is runs, version
        names = {v.name for v in plugin._delta_rule_variants()}
        assert ("fla" in names) is runs
    found.add("tilelang")  # fla then runs its backward on tilelang
    assert plugin._fla_runs()
