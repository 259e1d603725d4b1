"""GPT-2's math as plain torch functions on named tensors: embed, block, head.

Every op with a kernel (attention, layer norm, GELU, linear, chunked cross-entropy) is
called through ``ops`` (``dataflow_training.ops``), so a kernel package can swap it. The
remaining torch calls are indexing, reshapes, sums and ``torch.autograd.grad``.

Block activations saved for backward (the contents of ``A_<layer>``), per token:

- ``qkv``   (3 * n_embd): the attention input, ``c_attn(ln_1(x))``;
- ``h_mid`` (n_embd): the residual stream between the sublayers, ``x + attn(x)``;
- ``fc``    (4 * n_embd): the MLP's pre-activation, ``c_fc(ln_2(h_mid))``.

That is ``8 * n_embd`` values per token, ``8 * batch * seq_len * n_embd * itemsize``
bytes per block (autograd keeps about 17 * n_embd: x, h1, qkv, the attention output and
its merged copy, h_mid, h2, fc and gelu(fc)). With them, backward
runs no projection forward again: each ``linear``'s gradients are themselves ``linear``
calls (``dx = dy @ W``, ``dW = dy.T @ x``), and only the cheap elementwise parts (the two
layer norms from ``x`` and ``h_mid``, GELU from ``fc``) and the attention (from ``qkv``,
as every memory-efficient attention backward does) are rebuilt as small local autograd
graphs and differentiated with ``torch.autograd.grad``.

No dropout anywhere (see ``config.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from dataflow_training.family import TensorSpec
from dataflow_training.ops import Ops

from dataflow_family_gpt2.config import GPT2Config

Tensors = dict[str, torch.Tensor]

#: Targets equal to this are not scored (the ``chunked_cross_entropy`` convention).
IGNORE_INDEX = -100


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums over tokens run in float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _check_seq_len(config: GPT2Config, seq_len: int) -> None:
    if seq_len > config.n_positions:
        raise ValueError(
            f"sequence length {seq_len} exceeds GPT2Config.n_positions ({config.n_positions})"
        )


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh autograd leaf sharing ``tensor``'s storage, to rebuild a local graph on."""
    return tensor.detach().requires_grad_()


def _linear_backward(
    ops: Ops, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``y = linear(x, weight, bias)`` from its input alone, as ``linear``
    calls: ``dx = dy @ weight``, ``d_weight = dy.T @ x``, ``d_bias = dy`` summed."""
    x_rows = x.reshape(-1, x.shape[-1])
    dy_rows = dy.reshape(-1, dy.shape[-1])
    dx = ops["linear"](dy, weight.t())
    d_weight = ops["linear"](dy_rows.t(), x_rows.t())
    d_bias = dy_rows.sum(0, dtype=_accumulation_dtype(dy.dtype)).to(weight.dtype)
    return dx, d_weight, d_bias


class GPT2Embed:
    """``wte[tokens] + wpe[position]``; the gradients by scatter-add over the tokens."""

    def forward(
        self, config: GPT2Config, params: Tensors, tokens: torch.Tensor, ops: Ops
    ) -> torch.Tensor:
        _check_seq_len(config, tokens.shape[1])
        return params["wte"][tokens] + params["wpe"][: tokens.shape[1]]

    def backward(
        self, config: GPT2Config, tokens: torch.Tensor, d_hidden: torch.Tensor, ops: Ops
    ) -> Tensors:
        """Needs no weights. Sums run in float32 at least, and the gradients come back in
        that dtype (the caller casts them into its gradient buffers)."""
        seq_len = tokens.shape[1]
        _check_seq_len(config, seq_len)
        acc = _accumulation_dtype(d_hidden.dtype)
        device = d_hidden.device
        d_rows = d_hidden.reshape(-1, config.n_embd).to(acc)
        d_wte = torch.zeros(config.vocab_size, config.n_embd, dtype=acc, device=device)
        d_wte.index_add_(0, tokens.reshape(-1), d_rows)
        d_wpe = torch.zeros(config.n_positions, config.n_embd, dtype=acc, device=device)
        d_wpe[:seq_len] = d_rows.view(d_hidden.shape).sum(0)
        return {"wte": d_wte, "wpe": d_wpe}


class GPT2Block:
    """Pre-norm block: ``h = x + attn(ln_1(x))``, ``y = h + mlp(ln_2(h))``."""

    def saved_specs(self, config: GPT2Config, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        n = config.n_embd
        return (
            TensorSpec("qkv", (batch, seq_len, 3 * n)),
            TensorSpec("h_mid", (batch, seq_len, n)),
            TensorSpec("fc", (batch, seq_len, config.n_inner)),
        )

    def forward(
        self, config: GPT2Config, params: Tensors, x: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, Tensors]:
        saved = self.recompute(config, params, x, ops)
        mlp_out = ops["linear"](
            ops["gelu"](saved["fc"]), params["mlp.c_proj.weight"], params["mlp.c_proj.bias"]
        )
        return saved["h_mid"] + mlp_out, saved

    def recompute(self, config: GPT2Config, params: Tensors, x: torch.Tensor, ops: Ops) -> Tensors:
        _check_seq_len(config, x.shape[1])
        eps = config.layer_norm_epsilon
        h1 = ops["layer_norm"](x, params["ln_1.weight"], params["ln_1.bias"], eps)
        qkv = ops["linear"](h1, params["attn.c_attn.weight"], params["attn.c_attn.bias"])
        attn = _attention(config, qkv, ops)
        h_mid = x + ops["linear"](attn, params["attn.c_proj.weight"], params["attn.c_proj.bias"])
        h2 = ops["layer_norm"](h_mid, params["ln_2.weight"], params["ln_2.bias"], eps)
        fc = ops["linear"](h2, params["mlp.c_fc.weight"], params["mlp.c_fc.bias"])
        return {"qkv": qkv, "h_mid": h_mid, "fc": fc}

    def backward(
        self,
        config: GPT2Config,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        dy: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor, Tensors]:
        params = {name: tensor.detach() for name, tensor in params.items()}
        # One helper per sublayer: its temporaries are freed before the next one starts.
        with torch.enable_grad():
            d_h_mid, grads = _mlp_backward(config, params, saved["h_mid"], saved["fc"], dy, ops)
            d_h_mid += dy  # the residual
            d_x, attn_grads = _attention_backward(config, params, x, saved["qkv"], d_h_mid, ops)
        grads.update(attn_grads)
        return d_x + d_h_mid, {name: grads[name] for name in params}


def _mlp_backward(
    config: GPT2Config,
    params: Tensors,
    h_mid: torch.Tensor,
    fc: torch.Tensor,
    dy: torch.Tensor,
    ops: Ops,
) -> tuple[torch.Tensor, Tensors]:
    """``mlp(ln_2(h_mid)) = c_proj(gelu(fc))``, ``fc = c_fc(ln_2(h_mid))``: -> (d h_mid
    through the MLP branch, the MLP's and ln_2's gradients)."""
    grads: Tensors = {}
    fc = _leaf(fc)
    act = ops["gelu"](fc)
    d_act, grads["mlp.c_proj.weight"], grads["mlp.c_proj.bias"] = _linear_backward(
        ops, act.detach(), params["mlp.c_proj.weight"], dy
    )
    (d_fc,) = torch.autograd.grad(act, fc, d_act)
    del act, d_act
    h_mid, ln_w, ln_b = _leaf(h_mid), _leaf(params["ln_2.weight"]), _leaf(params["ln_2.bias"])
    h2 = ops["layer_norm"](h_mid, ln_w, ln_b, config.layer_norm_epsilon)
    d_h2, grads["mlp.c_fc.weight"], grads["mlp.c_fc.bias"] = _linear_backward(
        ops, h2.detach(), params["mlp.c_fc.weight"], d_fc
    )
    del d_fc
    d_h_mid, grads["ln_2.weight"], grads["ln_2.bias"] = torch.autograd.grad(
        h2, (h_mid, ln_w, ln_b), d_h2
    )
    return d_h_mid, grads


def _attention_backward(
    config: GPT2Config,
    params: Tensors,
    x: torch.Tensor,
    qkv: torch.Tensor,
    d_h_mid: torch.Tensor,
    ops: Ops,
) -> tuple[torch.Tensor, Tensors]:
    """``attn(ln_1(x)) = c_proj(attention(qkv))``, ``qkv = c_attn(ln_1(x))``: -> (d x
    through the attention branch, the attention's and ln_1's gradients)."""
    grads: Tensors = {}
    qkv = _leaf(qkv)
    attn = _attention(config, qkv, ops)
    d_attn, grads["attn.c_proj.weight"], grads["attn.c_proj.bias"] = _linear_backward(
        ops, attn.detach(), params["attn.c_proj.weight"], d_h_mid
    )
    (d_qkv,) = torch.autograd.grad(attn, qkv, d_attn)
    del attn, d_attn
    x, ln_w, ln_b = _leaf(x), _leaf(params["ln_1.weight"]), _leaf(params["ln_1.bias"])
    h1 = ops["layer_norm"](x, ln_w, ln_b, config.layer_norm_epsilon)
    d_h1, grads["attn.c_attn.weight"], grads["attn.c_attn.bias"] = _linear_backward(
        ops, h1.detach(), params["attn.c_attn.weight"], d_qkv
    )
    del d_qkv
    # The key bias adds q_i . b_k to every score of query row i, which the row's softmax
    # cancels: its gradient is exactly zero. Computed, it is rounding noise that Adam
    # (which divides by the gradient's own size) would turn into learning-rate-sized
    # steps, so it is returned as the exact zero.
    grads["attn.c_attn.bias"][config.n_embd : 2 * config.n_embd] = 0
    d_x, grads["ln_1.weight"], grads["ln_1.bias"] = torch.autograd.grad(h1, (x, ln_w, ln_b), d_h1)
    return d_x, grads


def _attention(config: GPT2Config, qkv: torch.Tensor, ops: Ops) -> torch.Tensor:
    """Causal multi-head self-attention of ``qkv`` (batch, seq, 3 * n_embd) -> (batch, seq,
    n_embd), before the output projection."""
    batch, seq_len, _ = qkv.shape
    heads = [
        part.view(batch, seq_len, config.n_head, config.head_dim).transpose(1, 2)
        for part in qkv.split(config.n_embd, dim=-1)
    ]
    out = ops["attention"](*heads, causal=True)
    return out.transpose(1, 2).reshape(batch, seq_len, config.n_embd)


class GPT2Head:
    """Final layer norm, logits against the tied ``wte`` chunk by chunk, mean loss."""

    def forward_backward(
        self,
        config: GPT2Config,
        params: Tensors,
        embed_params: Tensors,
        x: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors, Tensors]:
        """The loss is the mean over scored tokens (targets other than -100; 0 when none
        is scored), and every gradient is of that mean."""
        wte = embed_params["wte"]
        with torch.enable_grad():
            x_leaf, ln_w, ln_b = (
                _leaf(x),
                _leaf(params["ln_f.weight"]),
                _leaf(params["ln_f.bias"]),
            )
            hidden = ops["layer_norm"](x_leaf, ln_w, ln_b, config.layer_norm_epsilon)
            flat_targets = targets.reshape(-1)
            loss_sum, d_hidden, d_wte = ops["chunked_cross_entropy"](
                hidden.detach().reshape(-1, config.n_embd), wte, flat_targets, chunk_tokens
            )
            scored = (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
            d_hidden = (d_hidden / scored).to(hidden.dtype).view_as(hidden)
            d_x, d_ln_w, d_ln_b = torch.autograd.grad(hidden, (x_leaf, ln_w, ln_b), d_hidden)
        loss = (loss_sum / scored).to(torch.float32)
        head_grads = {"ln_f.weight": d_ln_w, "ln_f.bias": d_ln_b}
        return loss, d_x, head_grads, {"wte": (d_wte / scored).to(wte.dtype)}


def math_of(kind: str) -> Any:
    """The math object of a layer kind (``embed``, ``block``, ``head``)."""
    kinds = {"embed": GPT2Embed, "block": GPT2Block, "head": GPT2Head}
    if kind not in kinds:
        raise KeyError(f"gpt2 has no layer kind {kind!r}; its kinds: {', '.join(kinds)}")
    return kinds[kind]()
