"""Padded and packed batches (``Segments``) through the kit's Llama 3 math, held to
transformers' ``LlamaForCausalLM`` run on each sequence apart: the logits of every real
token, the loss over the real targets and every parameter's gradient, in float32.

Tolerances: logits and loss ``atol=rtol=1e-5`` (float32 through two layers; the per-row
kernels sum in other orders), gradients ``atol=1e-5, rtol=1e-4``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dataflow_training import load_family
from dataflow_training.kit import (
    IGNORE_INDEX,
    Env,
    RowGradient,
    Segments,
    expected_state,
    key_map,
    load_ops,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("dataflow_kernels_torch")

FLOAT32 = {"atol": 1e-5, "rtol": 1e-5}
GRADS = {"atol": 1e-5, "rtol": 1e-4}
SEQ = 12


@pytest.fixture(scope="module")
def hf_and_kit(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # HF init leaves norms at 1: perturb everything
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    family = load_family("llama3")
    kit_config, state = family.import_hf(folder)
    return model, family, kit_config, state


def _kit_step(family, config, state, tokens, targets, segments):
    """(logits of every token, mean loss, {state key: gradient}) of the kit's math run by
    hand: embed, blocks, the head's loss and gradient, blocks backwards, embed backward."""
    env = Env(load_ops("cpu"), segments=segments)
    layers = family.layers(config)
    params = {}
    for layer in layers:
        params[layer.name] = {}
        for spec in layer.params:
            value = state[f"{layer.name}.{spec.name}"]
            padded = torch.zeros(spec.shape, dtype=value.dtype)
            padded[tuple(slice(0, n) for n in value.shape)] = value
            params[layer.name][spec.name] = padded
    embed, *blocks, head = layers
    x = family.math("embed").forward(config, params[embed.name], tokens, env)
    inputs, saves = [], []
    for block in blocks:
        math = family.math(block.kind)
        inputs.append(x)
        x, saved, aux_temp = math.forward(config, params[block.name], x, env)
        saves.append((saved, aux_temp))
    head_params = params[head.name]
    normed = F.rms_norm(x, (config.hidden_size,), head_params["norm.weight"], config.rms_norm_eps)
    logits = (normed @ head_params["lm_head.weight"].T)[..., : config.vocab_size]
    loss, dy, head_grads = family.math("head").forward_backward(
        config, head_params, x, targets, env
    )
    grads = {f"{head.name}.{k}": g for k, g in head_grads.items()}
    for block, x_in, (saved, aux_temp) in reversed(list(zip(blocks, inputs, saves, strict=True))):
        dy, block_grads = family.math(block.kind).backward(
            config, params[block.name], x_in, saved, aux_temp, dy, env
        )
        grads |= {f"{block.name}.{k}": g for k, g in block_grads.items()}
    for k, g in family.math("embed").backward(config, tokens, dy, env).items():
        grads[f"{embed.name}.{k}"] = g.dense() if isinstance(g, RowGradient) else g
    trimmed = {k: g[tuple(slice(0, n) for n in state[k].shape)] for k, g in grads.items()}
    return logits, loss, trimmed


def _hf_apart(model, tokens, segments):
    """(logits at every real token, the mean loss over the real targets, the gradient of
    each HF parameter) with each sequence of ``segments`` run alone, at its positions."""
    model.zero_grad()
    targets = segments.targets(tokens)
    logits = torch.zeros(*tokens.shape, model.config.vocab_size)
    total, scored = 0.0, (targets != IGNORE_INDEX).sum()
    for row in range(tokens.shape[0]):
        ids = segments.ids[row]
        for sequence in ids[ids >= 0].unique():
            where = (ids == sequence).nonzero().flatten()
            out = model(
                input_ids=tokens[row, where][None],
                position_ids=segments.positions[row, where][None],
            ).logits[0]
            logits[row, where] = out.detach()
            total = total + F.cross_entropy(
                out, targets[row, where], ignore_index=IGNORE_INDEX, reduction="sum"
            )
    loss = total / scored
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_names(family, config):

    entries = key_map(family.name, config).expand(expected_state(config))
    return {entry.key: entry.hf_names[0] for entry in entries}


def _check_against_hf(hf_and_kit, tokens, segments):
    model, family, config, state = hf_and_kit
    targets = segments.targets(tokens)
    logits, loss, grads = _kit_step(family, config, state, tokens, targets, segments)
    hf_logits, hf_loss, hf_grads = _hf_apart(model, tokens, segments)
    real = ~segments.padded
    torch.testing.assert_close(logits[real], hf_logits[real], **FLOAT32)
    torch.testing.assert_close(loss, hf_loss, **FLOAT32)
    names = _hf_names(family, config)
    assert set(grads) == set(names)
    for key, hf_name in names.items():
        torch.testing.assert_close(
            grads[key], hf_grads[hf_name], **GRADS, msg=lambda m, k=key: f"{k}: {m}"
        )


def _tokens(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_a_padded_batch_with_offsets_equals_each_sequence_apart(hf_and_kit):
    """Right padding, left padding, and a completion continuing from position 5."""
    mask = torch.ones(3, SEQ, dtype=torch.int64)
    mask[0, 8:] = 0  # right-padded
    mask[1, :3] = 0  # left-padded
    segments = Segments.from_attention_mask(mask, offsets=[0, 0, 5])
    assert segments.positions[2, 0] == 5 and segments.positions[1, 3] == 0
    _check_against_hf(hf_and_kit, _tokens(1, 3), segments)


def test_a_packed_batch_equals_each_document_apart(hf_and_kit):
    """Three documents in row 0, two in row 1 and its padding; one document continues
    from an offset."""
    cu_seqlens = [0, 5, 9, 12, 19, 22]
    segments = Segments.from_cu_seqlens(cu_seqlens, batch=2, seq_len=SEQ, offsets=[0, 0, 0, 3, 0])
    assert segments.ids[0].tolist() == [0] * 5 + [1] * 4 + [2] * 3
    assert segments.ids[1].tolist() == [3] * 7 + [4] * 3 + [-1] * 2
    assert segments.positions[1, :7].tolist() == list(range(3, 10))
    _check_against_hf(hf_and_kit, _tokens(2), segments)


def test_hf_packed_position_ids_give_the_same_batch_as_cu_seqlens(hf_and_kit):
    """HF's packed rows (position_ids restarting at 0, the padding masked out) are the
    cu_seqlens batch; its gradients agree with transformers too."""
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    mask[1, 10:] = 0
    position_ids = torch.tensor(
        [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0]]
    )
    from_hf = Segments.from_attention_mask(mask, position_ids=position_ids)
    packed = Segments.from_cu_seqlens([0, 5, 9, 12, 19, 22], batch=2, seq_len=SEQ)
    assert torch.equal(from_hf.positions, packed.positions)
    assert torch.equal(from_hf.padded, packed.padded)
    for row in range(2):  # the same sequences, whatever their ids
        same = from_hf.ids[row][:, None] == from_hf.ids[row][None, :]
        assert torch.equal(same, packed.ids[row][:, None] == packed.ids[row][None, :])
    _check_against_hf(hf_and_kit, _tokens(3), from_hf)


def test_without_segments_the_math_is_unchanged(hf_and_kit):
    """One sequence per row from position 0 (``Segments.dense``) gives the bits of no
    segments at all up to the kernels' summation order."""
    _, family, config, state = hf_and_kit
    tokens = _tokens(4)
    targets = Segments.dense(2, SEQ).targets(tokens)
    plain = _kit_step(family, config, state, tokens, targets, None)
    dense = _kit_step(family, config, state, tokens, targets, Segments.dense(2, SEQ))
    torch.testing.assert_close(dense[0], plain[0], **FLOAT32)
    torch.testing.assert_close(dense[1], plain[1], **FLOAT32)
    for key in plain[2]:
        torch.testing.assert_close(dense[2][key], plain[2][key], **GRADS)
