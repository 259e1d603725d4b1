"""The shared family kit against independent truths: HF's rotary embedding (transformers'
``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb``), and plain autograd of the written-
out formulas for grouped-query attention, SwiGLU, RMSNorm (with and without the ``1 + w``
offset) and the chunked LM head. float64 on CPU: relative errors within 1e-10, except
where noted."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.kit import rotary
from dataflow_training.kit.attention import attention_backward, attention_forward
from dataflow_training.kit.head import IGNORE_INDEX, lm_head_loss
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.mlp import SwiGLU
from dataflow_training.kit.norms import LayerNorm, RMSNorm
from dataflow_training.step.family import Env
from dataflow_training.step.ops import load_ops

pytest.importorskip("dataflow_kernels_torch")


@pytest.fixture(scope="module")
def ops():
    return load_ops("cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("scaled", [True, False])
def test_rotary_tables_equal_transformers_llama(scaled: bool) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaled:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope
    )
    seq = 9000  # past the original context, where the scaling matters
    hf = LlamaRotaryEmbedding(config=config)
    cos, sin = hf(torch.zeros(1, seq, 64), torch.arange(seq)[None])
    scaling = rotary.Llama3Scaling() if scaled else None
    assert rel(rotary.inverse_frequencies(64, 500000.0, scaling), hf.inv_freq) < 1e-6
    ours_cos, ours_sin = rotary.tables(seq, 64, 500000.0, scaling=scaling)
    # HF forms the angles in float32 (position 9000 rounds by about 5e-4); ours in float64
    assert (ours_cos - cos[0]).abs().max() < 2e-3 and (ours_sin - sin[0]).abs().max() < 2e-3
    other_cos, _ = rotary.tables(
        seq, 64, 500000.0, scaling=None if scaled else rotary.Llama3Scaling()
    )
    assert (other_cos - cos[0]).abs().max() > 0.1  # the comparison can tell the two apart


def test_rotary_apply_equals_transformers_and_backward_is_its_transpose() -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = rotary.tables(11, 16, 10000.0, dtype=torch.float64)
    q, k = leaf(2, 3, 11, 16), leaf(2, 3, 11, 16)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert rel(rotary.apply(q, cos, sin), hf_q) < 1e-12
    assert rel(rotary.apply(k, cos, sin), hf_k) < 1e-12
    dy = torch.randn_like(hf_q)
    (want,) = torch.autograd.grad(hf_q, q, dy)
    assert rel(rotary.backward(dy, cos, sin), want) < 1e-12


def test_partial_rotary_rotates_only_the_first_dims() -> None:
    cos, sin = rotary.tables(7, 8, 10000.0, dtype=torch.float64)  # 8 of 32 dims
    x = leaf(1, 2, 7, 32)
    y = rotary.apply(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    assert rel(rotary.backward(dy, cos, sin), want) < 1e-12


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_grouped_query_attention_matches_autograd(ops, kv_heads: int) -> None:
    q, k, v = leaf(2, 4, 9, 8), leaf(2, kv_heads, 9, 8), leaf(2, kv_heads, 9, 8)
    group = 4 // kv_heads
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -math.inf)
    want = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out, lse = attention_forward(ops, q.detach(), k.detach(), v.detach(), causal=True)
    assert rel(out, want) < 1e-10
    assert rel(lse, torch.logsumexp(scores, -1)) < 1e-10
    d_out = torch.randn_like(want)
    grads = attention_backward(ops, d_out, q.detach(), k.detach(), v.detach(), out, lse)
    for got, expected in zip(grads, torch.autograd.grad(want, (q, k, v), d_out), strict=True):
        assert got.shape == expected.shape and rel(got, expected) < 1e-10


def test_grouped_query_attention_refuses_heads_that_do_not_divide(ops) -> None:
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"3 query heads are not a multiple of 2 key heads"):
        attention_forward(ops, q, k, k)


def test_swiglu_matches_autograd(ops) -> None:
    mlp = SwiGLU(Linear("gate"), Linear("up"), Linear("down"))
    params = {"gate": leaf(12, 6), "up": leaf(12, 6), "down": leaf(6, 12)}
    x = leaf(2, 5, 6)
    want = F.linear(F.silu(F.linear(x, params["gate"])) * F.linear(x, params["up"]), params["down"])
    plain = {k: v.detach() for k, v in params.items()}
    y, saved = mlp.forward(ops, plain, x.detach())
    assert rel(y, want) < 1e-12
    dy = torch.randn_like(want)
    dx, grads = mlp.backward(ops, plain, x.detach(), saved["gate"], saved["up"], dy)
    auto = torch.autograd.grad(want, (x, *params.values()), dy)
    assert rel(dx, auto[0]) < 1e-10
    for name, expected in zip(params, auto[1:], strict=True):
        assert rel(grads[name], expected) < 1e-10, name


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_with_and_without_offset_matches_autograd(ops, offset: float) -> None:
    norm = RMSNorm("w", 1e-6, offset=offset)
    x, w = leaf(3, 7, 16), leaf(16, scale=0.1)
    want = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (w + offset)
    y, stats = norm.forward(ops, {"w": w.detach()}, x.detach())
    assert rel(y, want) < 1e-12
    dy = torch.randn_like(want)
    dx, grads = norm.backward(ops, {"w": w.detach()}, x.detach(), stats, dy)
    auto = torch.autograd.grad(want, (x, w), dy)
    assert rel(dx, auto[0]) < 1e-10 and rel(grads["w"], auto[1]) < 1e-10


def test_lm_head_loss_matches_autograd_with_ignored_targets_and_grad_scale(ops) -> None:
    norm = LayerNorm("ln.weight", "ln.bias", 1e-5)
    params = {"ln.weight": leaf(8, scale=0.5), "ln.bias": leaf(8), "proj": leaf(23, 8)}
    x = leaf(2, 6, 8)
    targets = torch.randint(0, 23, (2, 6))
    targets[0, 1] = targets[1, 4] = IGNORE_INDEX
    hidden = F.layer_norm(x, (8,), params["ln.weight"], params["ln.bias"], 1e-5)
    want = F.cross_entropy((hidden @ params["proj"].T).reshape(-1, 23), targets.reshape(-1))
    plain = {k: v.detach() for k, v in params.items()}
    env = Env(ops, chunk_tokens=5, grad_scale=0.5)
    loss, dx, grads = lm_head_loss(env, plain, x.detach(), targets, norm=norm, projection="proj")
    assert abs(loss.item() - want.item()) < 1e-6 * want.item()  # the loss sum is float32
    auto = torch.autograd.grad(want, (x, *params.values()))
    assert rel(dx, 0.5 * auto[0]) < 1e-6
    for name, expected in zip(params, auto[1:], strict=True):
        assert rel(grads[name], 0.5 * expected) < 1e-6, name
