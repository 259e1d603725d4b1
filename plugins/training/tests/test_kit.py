"""The shared family kit against independent truths: HF's rotary embedding (transformers'
``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb``), and plain autograd of the written-
out formulas for grouped-query attention, SwiGLU, RMSNorm (with and without the ``1 + w``
offset) and the chunked LM head. float64 on CPU: relative errors within 1e-10, except
where noted."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.kit import rotary
from dataflow_training.kit.attention import attention_backward, attention_forward
from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder_math import DecoderEmbed, LearnedPositions
from dataflow_training.kit.fused_attention import FusedQKVAttention
from dataflow_training.kit.head import IGNORE_INDEX, lm_head_loss
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.mlp import GELUFFN, SwiGLU
from dataflow_training.kit.norms import LayerNorm, Norm, RMSNorm
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


@pytest.mark.parametrize(("chunk_tokens", "dtype"), [(5, torch.float32), (12, torch.bfloat16)])
def test_a_16_bit_projection_summed_over_chunks_comes_back_in_float32(
    ops, chunk_tokens, dtype
) -> None:
    """bfloat16 weights: over several chunks the projection's gradient is the kernel's
    float32 sum (the head task rounds it once, into its 16-bit gradient object), from one
    chunk it is the 16-bit matmul's; either within bfloat16's error of float64 autograd."""
    norm = RMSNorm("norm.weight", 1e-6)
    params = {"norm.weight": leaf(8, scale=0.5), "proj": leaf(23, 8)}
    x = leaf(2, 6, 8)
    targets = torch.randint(0, 23, (2, 6))
    plain = {k: v.detach().to(torch.bfloat16) for k, v in params.items()}
    env = Env(ops, chunk_tokens=chunk_tokens)
    x16 = x.detach().to(torch.bfloat16)
    _, _, grads = lm_head_loss(env, plain, x16, targets, norm=norm, projection="proj")
    assert grads["proj"].dtype == dtype
    wide = {k: v.detach().double().requires_grad_() for k, v in plain.items()}
    hidden = F.rms_norm(x16.double(), (8,), wide["norm.weight"], 1e-6)
    loss = F.cross_entropy((hidden @ wide["proj"].T).reshape(-1, 23), targets.reshape(-1))
    want = torch.autograd.grad(loss, wide["proj"])[0]
    assert rel(grads["proj"].double(), want) < 2e-2


# -- GPT-2's parts, composed without the gpt2 family -------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The config fields GPT-2's parts read, under HF's names."""

    vocab_size: int = 19
    vocab_multiple: int = 64  # the token table stored as 64 rows
    hidden_size: int = 16
    num_attention_heads: int = 4
    intermediate_size: int = 40
    max_position_embeddings: int = 12
    layer_norm_epsilon: float = 1e-5


GPT2_LIKE = Block(
    FusedQKVAttention(), GELUFFN(), Norm("layer", eps="layer_norm_epsilon"), ("ln_1", "ln_2")
)


def test_a_block_of_gpt2_parts_matches_autograd_through_its_reference(ops) -> None:
    config = Sizes()
    torch.manual_seed(0)
    reference = GPT2_LIKE.reference(config).double()
    with torch.no_grad():  # no bias 0, no norm 1
        for param in reference.parameters():
            param.add_(0.1 * torch.randn_like(param))
    layer = GPT2_LIKE.layer(config, "0", "block")
    state = reference.state_dict()
    assert [p.name for p in layer.params] == list(state)
    assert all(tuple(state[p.name].shape) == p.shape for p in layer.params)
    assert {p.name for p in layer.params if not p.decay} == {
        name for name in state if name.endswith("bias") or name.startswith("ln_")
    }
    params = {name: tensor.detach().clone() for name, tensor in state.items()}
    x = leaf(2, 7, config.hidden_size)
    want = reference(x)
    y, saved, aux_temp = GPT2_LIKE.forward(config, params, x.detach(), Env(ops))
    assert rel(y, want) < 1e-12 and aux_temp == {}
    specs = GPT2_LIKE.saved(config, 2, 7)
    assert {s.name: s.shape for s in specs} == {name: t.shape for name, t in saved.items()}
    dy = torch.randn_like(want)
    dx, grads = GPT2_LIKE.backward(config, params, x.detach(), saved, {}, dy, Env(ops))
    auto = torch.autograd.grad(want, (x, *reference.parameters()), dy)
    assert rel(dx, auto[0]) < 1e-10
    for name, expected in zip(state, auto[1:], strict=True):
        assert rel(grads[name], expected) < 1e-9, name
    n = config.hidden_size  # the key bias: the exact zero
    assert torch.count_nonzero(grads["attn.c_attn.bias"][n : 2 * n]) == 0


def test_gpt2_parts_store_conv1d_weights_transposed_in_hf_checkpoints() -> None:
    rules = {rule.key: rule for rule in GPT2_LIKE.hf_rules(Sizes(), "transformer.h.{layer}")}
    transposed = {key for key, rule in rules.items() if rule.convert.name == "transpose"}
    assert transposed == {
        "{layer}.attn.c_attn.weight",
        "{layer}.attn.c_proj.weight",
        "{layer}.mlp.c_fc.weight",
        "{layer}.mlp.c_proj.weight",
    }
    assert rules["{layer}.ln_2.bias"].hf == ("transformer.h.{layer}.ln_2.bias",)


def test_learned_positions_are_added_and_get_a_table_of_gradients(ops) -> None:
    config = Sizes()
    embed = DecoderEmbed("wte", LearnedPositions("wpe"))
    assert [(p.name, p.shape, p.state_shape) for p in embed.params(config)] == [
        ("wte", (64, 16), (19, 16)),  # stored padded to vocab_multiple, the state's 19 rows
        ("wpe", (12, 16), (12, 16)),
    ]
    params = {"wte": leaf(19, 16), "wpe": leaf(12, 16)}
    tokens = torch.tensor([[3, 3, 0, 7, 18], [1, 3, 2, 2, 5]])
    want = params["wte"][tokens] + params["wpe"][:5]
    plain = {k: v.detach() for k, v in params.items()}
    hidden = embed.forward(config, plain, tokens, Env(ops))
    assert torch.equal(hidden, want.detach())
    d_hidden = torch.randn_like(want)
    grads = embed.backward(config, tokens, d_hidden, Env(ops))
    auto = torch.autograd.grad(want, tuple(params.values()), d_hidden)
    wte = grads["wte"].dense()  # the stored table's gradient: nothing in the padded rows
    assert wte.shape == (64, 16) and wte[19:].count_nonzero() == 0
    assert rel(wte[:19], auto[0]) < 1e-12 and rel(grads["wpe"], auto[1]) < 1e-12
    too_long = torch.zeros(1, 13, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"sequence length 13 exceeds Sizes.max_position_embed"):
        embed.forward(config, plain, too_long, Env(ops))
    more = (
        embed.cost(config, 2, 5, 8).backward.bytes
        - DecoderEmbed().cost(config, 2, 5, 8).backward.bytes
    )
    assert more == 2 * 5 * 16 * 8 + 3 * 12 * 16 * 4  # d_hidden read again, the float32 table
