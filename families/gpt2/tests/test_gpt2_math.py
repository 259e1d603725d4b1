"""Each layer's math against the reference module: forward outputs, every gradient, the
saved activations and their recompute. float64, tolerances from conftest."""

from __future__ import annotations

import pytest
import torch
from dataflow_family_gpt2.model import OPS, GPT2Block, GPT2Embed, GPT2Head, math_of
from dataflow_training.kit import Env, RowGradient


def test_installed_kernels_provide_every_op(installed_ops) -> None:
    assert set(installed_ops) == set(OPS)


# -- embed --------------------------------------------------------------------------------


def test_embed_forward_and_backward_match_the_reference(
    config, reference, layer_params, ops, float64_tol
) -> None:
    tokens = torch.randint(0, config.vocab_size, (3, 11))
    tokens[0, :4] = 7  # a repeated token: its gradient rows must add up
    embed = GPT2Embed()
    hidden = embed.forward(config, layer_params["emb"], tokens, ops)
    with torch.enable_grad():
        expected = reference.emb(tokens)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)

    d_hidden = torch.randn_like(hidden)
    grads = embed.backward(config, tokens, d_hidden, ops)
    auto = torch.autograd.grad(expected, (reference.emb.wte, reference.emb.wpe), d_hidden)
    assert isinstance(grads["wte"], RowGradient)  # the tokens' rows, no (vocab, dim) table
    wte = grads["wte"].dense()  # as stored: padded to vocab_multiple rows, zero past vocab
    assert wte.shape[0] == 64 > config.vocab_size and wte[config.vocab_size :].abs().sum() == 0
    torch.testing.assert_close(wte[: config.vocab_size], auto[0], **float64_tol)
    torch.testing.assert_close(grads["wpe"], auto[1], **float64_tol)
    assert grads["wpe"][11:].abs().sum() == 0  # positions past seq_len get nothing


def test_embed_backward_accumulates_bf16_in_float32(config, ops) -> None:
    tokens = torch.zeros(4, 8, dtype=torch.int64)  # one row takes 32 additions
    d_hidden = torch.full((4, 8, config.n_embd), 1.0 + 2**-7, dtype=torch.bfloat16)
    grads = GPT2Embed().backward(config, tokens, d_hidden, ops)
    wte = grads["wte"].dense()
    assert wte.dtype == grads["wpe"].dtype == torch.float32
    torch.testing.assert_close(wte[0], torch.full((config.n_embd,), 32 * (1 + 2**-7)))
    assert wte[1:].abs().sum() == 0
    torch.testing.assert_close(grads["wpe"][0], torch.full((config.n_embd,), 4 * (1 + 2**-7)))


def test_a_sequence_longer_than_n_positions_is_refused(config, layer_params, ops) -> None:
    tokens = torch.zeros(1, config.n_positions + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds GPT2Config.n_positions"):
        GPT2Embed().forward(config, layer_params["emb"], tokens, ops)


# -- block --------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", ["0", "1"])
def test_block_forward_and_backward_match_autograd_on_the_reference(
    config, reference, layer_params, ops, layer, float64_tol
) -> None:
    block_ref = reference.get_submodule(layer)
    x = torch.randn(3, 11, config.n_embd, dtype=torch.float64)
    block = GPT2Block()
    y, saved, _ = block.forward(config, layer_params[layer], x, ops)

    x_leaf = x.clone().requires_grad_()
    y_ref = block_ref(x_leaf)
    torch.testing.assert_close(y, y_ref, **float64_tol)

    dy = torch.randn_like(y)
    dx, grads = block.backward(config, layer_params[layer], x, saved, {}, dy, ops)
    names = list(layer_params[layer])
    auto = torch.autograd.grad(y_ref, [x_leaf, *(block_ref.get_parameter(n) for n in names)], dy)
    torch.testing.assert_close(dx, auto[0], **float64_tol)
    assert sorted(grads) == sorted(names)
    for name, expected in zip(names, auto[1:], strict=True):
        torch.testing.assert_close(
            grads[name], expected, **float64_tol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_key_bias_gradient_is_exactly_zero(config, layer_params, ops) -> None:
    """Softmax cancels a bias on the keys; backward returns the exact zero, not noise."""
    block, params = GPT2Block(), layer_params["0"]
    x = torch.randn(2, 7, config.n_embd, dtype=torch.float32)
    params32 = {name: tensor.float() for name, tensor in params.items()}
    _, saved, _ = block.forward(config, params32, x, ops)
    _, grads = block.backward(config, params32, x, saved, {}, torch.randn_like(x), ops)
    n = config.n_embd
    assert torch.count_nonzero(grads["attn.c_attn.bias"][n : 2 * n]) == 0
    assert torch.count_nonzero(grads["attn.c_attn.bias"][:n]) == n  # queries and values: not


def test_the_training_plugin_task_checks_pass(config, installed_ops) -> None:
    """``dataflow verify``'s task level: recompute, hand backward vs autograd through the
    family's own forward, head chunking; float32 at its fp32 tolerance."""
    from dataflow_family_gpt2.family import GPT2Family
    from dataflow_training import TOLERANCES, task_checks

    checks = task_checks(
        GPT2Family(), config, "cpu", torch.float32, TOLERANCES["fp32"]["task"], seed=0
    )
    assert checks and all(check.ok for check in checks), [c for c in checks if not c.ok]


def test_block_saves_what_it_declares_and_recompute_equals_it(config, layer_params, ops) -> None:
    block = GPT2Block()
    x = torch.randn(2, 9, config.n_embd, dtype=torch.float64)
    _, saved, aux_temp = block.forward(config, layer_params["0"], x, ops)
    assert aux_temp == {} and block.aux_temp(config, 2, 9) == ()
    specs = block.saved(config, batch=2, seq_len=9)
    assert [spec.name for spec in specs] == list(saved)
    for spec in specs:
        assert tuple(saved[spec.name].shape) == spec.shape, spec.name
        wanted = torch.float64 if spec.dtype in ("policy", "float32") else None
        assert saved[spec.name].dtype == wanted, spec.name  # float64 math keeps float64 stats
    again = block.recompute(config, layer_params["0"], x, {}, ops)
    assert list(again) == list(saved)
    for name in saved:
        assert torch.equal(again[name], saved[name]), name


def test_saved_activations_are_nine_hidden_widths_and_the_lse_per_token(config) -> None:
    specs = {spec.name: spec for spec in GPT2Block().saved(config, batch=4, seq_len=16)}
    widths = sum(spec.shape[-1] for name, spec in specs.items() if name != "lse")
    assert widths == 9 * config.n_embd
    assert specs["lse"].shape == (4, config.n_head, 16) and specs["lse"].dtype == "float32"
    assert all(spec.shape[:2] == (4, 16) for name, spec in specs.items() if name != "lse")


def test_block_backward_from_recomputed_activations_is_identical(config, layer_params, ops) -> None:
    block, params = GPT2Block(), layer_params["1"]
    x = torch.randn(2, 9, config.n_embd, dtype=torch.float64)
    dy = torch.randn_like(x)
    _, saved, _ = block.forward(config, params, x, ops)
    dx, grads = block.backward(config, params, x, saved, {}, dy, ops)
    dx2, grads2 = block.backward(
        config, params, x, block.recompute(config, params, x, {}, ops), {}, dy, ops
    )
    assert torch.equal(dx, dx2)
    assert all(torch.equal(grads[name], grads2[name]) for name in grads)


def test_block_backward_leaves_no_graph_and_does_not_touch_its_inputs(
    config, layer_params, ops
) -> None:
    block, params = GPT2Block(), layer_params["0"]
    x = torch.randn(2, 5, config.n_embd, dtype=torch.float64)
    _, saved, _ = block.forward(config, params, x, ops)
    before = {name: tensor.clone() for name, tensor in {**params, **saved, "x": x}.items()}
    dx, grads = block.backward(config, params, x, saved, {}, torch.randn_like(x), ops)
    assert not dx.requires_grad and not any(g.requires_grad for g in grads.values())
    after = {**params, **saved, "x": x}
    assert all(torch.equal(before[name], after[name]) for name in before)


# -- head ---------------------------------------------------------------------------------


def _reference_head(reference, x, targets):
    """Loss and gradients of the reference's head (final norm, tied logits, loss) on x."""
    x_leaf = x.clone().requires_grad_()
    logits = reference.head.ln_f(x_leaf) @ reference.emb.wte.t()
    flat = targets.flatten()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), flat, ignore_index=-100, reduction="sum"
    ) / (flat != -100).sum().clamp(min=1)
    wanted = (x_leaf, reference.head.ln_f.weight, reference.head.ln_f.bias, reference.emb.wte)
    return loss, torch.autograd.grad(loss, wanted)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 33, 1000])
def test_head_loss_and_gradients_match_the_reference(
    config, reference, layer_params, batch_tokens, ops, chunk_tokens, ce_tol
) -> None:
    _, targets = batch_tokens
    x = torch.randn(*targets.shape, config.n_embd, dtype=torch.float64)
    params = {**layer_params["head"], "wte": layer_params["emb"]["wte"]}
    loss, dx, grads = GPT2Head().forward_backward(
        config, params, x, targets, Env(ops.ops, chunk_tokens=chunk_tokens)
    )
    ref_loss, (ref_dx, ref_dw, ref_db, ref_dwte) = _reference_head(reference, x, targets)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, **ce_tol)
    torch.testing.assert_close(dx, ref_dx, **ce_tol)
    assert sorted(grads) == ["ln_f.bias", "ln_f.weight", "wte"]
    torch.testing.assert_close(grads["ln_f.weight"], ref_dw, **ce_tol)
    torch.testing.assert_close(grads["ln_f.bias"], ref_db, **ce_tol)
    torch.testing.assert_close(grads["wte"], ref_dwte, **ce_tol)


def test_head_with_every_target_ignored_gives_zero_loss_and_gradients(
    config, layer_params, ops
) -> None:
    x = torch.randn(2, 3, config.n_embd, dtype=torch.float64)
    targets = torch.full((2, 3), -100)
    params = {**layer_params["head"], "wte": layer_params["emb"]["wte"]}
    loss, dx, grads = GPT2Head().forward_backward(
        config, params, x, targets, Env(ops.ops, chunk_tokens=4)
    )
    assert loss.item() == 0.0 and dx.abs().sum() == 0
    assert all(grad.abs().sum() == 0 for grad in grads.values())


def test_math_of_an_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"no layer kind 'moe'; its kinds: embed, block, head"):
        math_of("moe")
