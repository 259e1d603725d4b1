"""A whole training step composed from the family's math (embed -> blocks -> fused head ->
blocks backward -> embed backward) equals autograd through the reference model: the loss
and the gradient of every parameter. float64 math, float32 cross-entropy: CROSS_ENTROPY."""

from __future__ import annotations

import pytest
import torch
from dataflow_family_gpt2.family import GPT2Family
from dataflow_training.kit import Env


def family_step(family, config, layer_params, tokens, targets, ops, *, recompute: bool):
    """Loss and gradients by layer, the way the training plugin chains the tasks: ``wte``
    stored padded to the config's ``vocab_multiple`` (zero rows past the vocabulary), its
    gradient checked zero there and returned with the real rows."""
    layers = family.layers(config)
    embed, blocks, head = layers[0], layers[1:-1], layers[-1]
    real = layer_params[embed.name]["wte"]
    stored = real.new_zeros(embed.params[0].shape)
    stored[: real.shape[0]] = real
    layer_params = {**layer_params, embed.name: {**layer_params[embed.name], "wte": stored}}
    hidden = family.math("embed").forward(config, layer_params[embed.name], tokens, ops)
    inputs, saved = [], []
    for layer in blocks:
        inputs.append(hidden)
        hidden, kept, _ = family.math(layer.kind).forward(
            config, layer_params[layer.name], hidden, ops
        )
        saved.append(None if recompute else kept)
    head_params = {**layer_params[head.name], "wte": layer_params[embed.name]["wte"]}
    loss, d_hidden, head_grads = family.math("head").forward_backward(
        config, head_params, hidden, targets, Env(ops.ops, chunk_tokens=7)
    )
    tied_wte = head_grads.pop("wte")
    grads = {head.name: head_grads}
    for layer, x, kept in reversed(list(zip(blocks, inputs, saved, strict=True))):
        math = family.math(layer.kind)
        params = layer_params[layer.name]
        if kept is None:
            kept = math.recompute(config, params, x, {}, ops)
        d_hidden, grads[layer.name] = math.backward(config, params, x, kept, {}, d_hidden, ops)
    grads[embed.name] = family.math("embed").backward(config, tokens, d_hidden, ops)
    assert head.tied == {"wte": "emb.wte"}
    wte = grads[embed.name]["wte"].dense() + tied_wte
    assert wte.shape == stored.shape and wte[real.shape[0] :].count_nonzero() == 0
    grads[embed.name]["wte"] = wte[: real.shape[0]]
    return loss, grads


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_a_whole_step_equals_the_reference(
    config, reference, layer_params, batch_tokens, ops, recompute, ce_tol
) -> None:
    tokens, targets = batch_tokens
    family = GPT2Family()
    loss, grads = family_step(
        family, config, layer_params, tokens, targets, ops, recompute=recompute
    )

    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **ce_tol)
    checked = 0
    for name, param in reference.named_parameters():
        layer, _, param_name = name.partition(".")
        torch.testing.assert_close(
            grads[layer][param_name], param.grad, **ce_tol, msg=lambda m, n=name: f"{n}: {m}"
        )
        checked += 1
    assert checked == sum(len(layer.params) for layer in family.layers(config))
