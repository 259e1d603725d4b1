"""GPT-2's math on the shared kit: embed, block, head.

Every op with a kernel (linear, the norms, attention, GELU, the chunked cross-entropy) is
called through ``env.ops``; the kit (``dataflow_training.kit``) supplies the linear and
norm forward/backward pairs, head splitting and the fused head.

What a block saves for backward (the contents of ``A_<layer>``), per token:

- ``qkv``   (3 * n_embd): the attention input, ``c_attn(ln_1(x))``;
- ``attn``  (n_embd): the attention output before ``c_proj`` (its backward needs it);
- ``lse``   (n_head, float32): the attention's logsumexp;
- ``h_mid`` (n_embd): the residual stream between the sublayers, ``x + attn(x)``;
- ``fc``    (4 * n_embd): the MLP's pre-activation, ``c_fc(ln_2(h_mid))``.

That is ``9 * n_embd`` activation values plus ``n_head`` floats per token: 13,872 bytes
per token for GPT-2 124M in bf16, where autograd keeps about ``16 * n_embd`` values (x,
ln_1(x), qkv, the attention output, h_mid, ln_2(h_mid), fc and gelu(fc)). With them,
backward runs no projection and no attention forward again: it recomputes only
elementwise work (the two layer norms from ``x`` and ``h_mid``, GELU from ``fc``) and
calls the fused backward kernels (``attention_bwd`` with the saved logsumexp,
``layer_norm_bwd``, ``gelu_bwd``); every projection's gradients are ``linear`` calls.

The block offers one partial save, ``mlp``: forward keeps ``qkv``, ``attn``, ``lse`` and
``h_mid`` (5 * n_embd values and the logsumexp a token: the attention's, costly to
derive) and ``rederive`` makes ``fc`` again from ``h_mid`` (``ln_2`` and ``c_fc``: about a
third of the forward's matmul FLOPs and no attention), freeing 4 of the 9 * n_embd.

No dropout anywhere (see ``config.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from dataflow_training.kit import (
    Env,
    LayerCost,
    LayerNorm,
    Linear,
    PartialSave,
    RowGradient,
    TensorSpec,
    Work,
    accumulation_dtype,
    attention_backward,
    attention_forward,
    lm_head_loss,
    merge_heads,
    split_heads,
)

from dataflow_family_gpt2.config import GPT2Config

Tensors = dict[str, torch.Tensor]

#: every op the math calls through ``env.ops``
OPS = (
    "linear",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "attention_fwd",
    "attention_bwd",
    "gelu",
    "gelu_bwd",
    "chunked_cross_entropy",
)

C_ATTN = Linear("attn.c_attn.weight", "attn.c_attn.bias")
C_PROJ = Linear("attn.c_proj.weight", "attn.c_proj.bias")
C_FC = Linear("mlp.c_fc.weight", "mlp.c_fc.bias")
MLP_PROJ = Linear("mlp.c_proj.weight", "mlp.c_proj.bias")


def _norms(config: GPT2Config) -> tuple[LayerNorm, LayerNorm]:
    eps = config.layer_norm_epsilon
    return LayerNorm("ln_1.weight", "ln_1.bias", eps), LayerNorm("ln_2.weight", "ln_2.bias", eps)


def _check_seq_len(config: GPT2Config, seq_len: int) -> None:
    if seq_len > config.n_positions:
        raise ValueError(
            f"sequence length {seq_len} exceeds GPT2Config.n_positions ({config.n_positions})"
        )


class GPT2Embed:
    """``wte[tokens] + wpe[position]``; ``wte``'s gradient the rows of the round's tokens
    (``RowGradient``), ``wpe``'s a table of the positions."""

    def forward(self, config: GPT2Config, params: Tensors, tokens: torch.Tensor, env: Env):
        _check_seq_len(config, tokens.shape[1])
        return params["wte"][tokens] + params["wpe"][: tokens.shape[1]]

    def backward(
        self, config: GPT2Config, tokens: torch.Tensor, d_hidden: torch.Tensor, env: Env
    ) -> Tensors:
        """Needs no weights. Sums run in float32 at least and come back in that dtype
        (the caller rounds them into its gradient buffers).

        ``wte``'s gradient is the rows of the tokens, not a (vocab, n_embd) float32
        table: zeroing, filling, casting and adding the table took about 200 us of a
        round's backward on the H200 whatever its tokens (gpt2_124m profiles of session
        17: 241 us at 4,096 tokens, 280 us at 8,192), a step of 64 or 128 small rounds
        paying it each round."""
        seq_len = tokens.shape[1]
        _check_seq_len(config, seq_len)
        acc = accumulation_dtype(d_hidden.dtype)
        n = config.n_embd
        d_wte = RowGradient.summed(tokens, d_hidden.reshape(-1, n), (config.vocab_size, n), acc)
        d_wpe = torch.zeros(config.n_positions, n, dtype=acc, device=d_hidden.device)
        d_wpe[:seq_len] = d_hidden.to(acc).sum(0)
        return {"wte": d_wte, "wpe": d_wpe}

    def cost(self, config: GPT2Config, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.n_embd
        rows = tokens * n * 4  # float32 row sums
        positions = config.n_positions * n * 4  # wpe's float32 table
        # d_hidden read twice (rows, positions) and the gradient's rows read and written;
        # the rows summed, gathered and added in float32; the positions' table
        return LayerCost(
            forward=Work(0, 3 * tokens * n * act_bytes),
            backward=Work(0, 4 * tokens * n * act_bytes + 4 * rows + 3 * positions),
        )


class GPT2Block:
    """Pre-norm block: ``h = x + attn(ln_1(x))``, ``y = h + mlp(ln_2(h))``."""

    def saved(self, config: GPT2Config, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        n = config.n_embd
        return (
            TensorSpec("qkv", (batch, seq_len, 3 * n)),
            TensorSpec("attn", (batch, seq_len, n)),
            TensorSpec("lse", (batch, config.n_head, seq_len), dtype="float32"),
            TensorSpec("h_mid", (batch, seq_len, n)),
            TensorSpec("fc", (batch, seq_len, config.n_inner)),
        )

    def aux_temp(self, config: GPT2Config, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return ()

    def forward(
        self, config: GPT2Config, params: Tensors, x: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        saved = self.recompute(config, params, x, {}, env)
        act = env.ops["gelu"](saved["fc"])
        return saved["h_mid"] + MLP_PROJ.forward(env.ops, params, act), saved, {}

    def recompute(
        self, config: GPT2Config, params: Tensors, x: torch.Tensor, aux_temp: Tensors, env: Env
    ) -> Tensors:
        _check_seq_len(config, x.shape[1])
        ops, ln_1 = env.ops, _norms(config)[0]
        h1, _ = ln_1.forward(ops, params, x)
        qkv = C_ATTN.forward(ops, params, h1)
        del h1
        q, k, v = (split_heads(part, config.n_head) for part in qkv.split(config.n_embd, -1))
        out, lse = attention_forward(ops, q, k, v, causal=True)
        attn = merge_heads(out)
        h_mid = x + C_PROJ.forward(ops, params, attn)
        fc = self.rederive(config, params, x, {"h_mid": h_mid}, aux_temp, env, "mlp")["fc"]
        return {"qkv": qkv, "attn": attn, "lse": lse, "h_mid": h_mid, "fc": fc}

    def partial_saves(self, config: GPT2Config) -> tuple[PartialSave, ...]:
        return (PartialSave("mlp", ("qkv", "attn", "lse", "h_mid")),)

    def rederive(
        self,
        config: GPT2Config,
        params: Tensors,
        x: torch.Tensor,
        kept: Tensors,
        aux_temp: Tensors,
        env: Env,
        partial: str,
    ) -> Tensors:
        """``mlp``: the MLP's pre-activation ``fc = c_fc(ln_2(h_mid))`` from the kept
        ``h_mid`` (``recompute`` ends with this very call)."""
        if partial != "mlp":
            raise KeyError(f"gpt2 block has no partial save {partial!r}; it has: mlp")
        h2, _ = _norms(config)[1].forward(env.ops, params, kept["h_mid"])
        return {"fc": C_FC.forward(env.ops, params, h2)}

    def backward(
        self,
        config: GPT2Config,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        ops, (ln_1, ln_2) = env.ops, _norms(config)
        h_mid, fc = saved["h_mid"], saved["fc"]
        # MLP: y = h_mid + c_proj(gelu(c_fc(ln_2(h_mid))))
        d_act, grads = MLP_PROJ.backward(ops, params, ops["gelu"](fc), dy)
        d_fc = ops["gelu_bwd"](d_act, fc)
        del d_act
        h2, stats_2 = ln_2.forward(ops, params, h_mid)
        d_h2, g = C_FC.backward(ops, params, h2, d_fc)
        grads.update(g)
        del d_fc, h2
        d_h_mid, g = ln_2.backward(ops, params, h_mid, stats_2, d_h2)
        grads.update(g)
        d_h_mid += dy  # the residual
        # attention: h_mid = x + c_proj(attention(c_attn(ln_1(x))))
        d_attn, g = C_PROJ.backward(ops, params, saved["attn"], d_h_mid)
        grads.update(g)
        heads = config.n_head
        q, k, v = (split_heads(part, heads) for part in saved["qkv"].split(config.n_embd, -1))
        dq, dk, dv = attention_backward(
            ops,
            split_heads(d_attn, heads),
            q,
            k,
            v,
            split_heads(saved["attn"], heads),
            saved["lse"],
            causal=True,
        )
        del d_attn
        d_qkv = torch.cat((merge_heads(dq), merge_heads(dk), merge_heads(dv)), dim=-1)
        del dq, dk, dv
        h1, stats_1 = ln_1.forward(ops, params, x)
        d_h1, g = C_ATTN.backward(ops, params, h1, d_qkv)
        grads.update(g)
        del d_qkv, h1
        # The key bias adds q_i . b_k to every score of query row i, which the row's softmax
        # cancels: its gradient is exactly zero. Computed, it is rounding noise that Adam
        # (which divides by the gradient's own size) would turn into learning-rate-sized
        # steps, so it is returned as the exact zero.
        grads["attn.c_attn.bias"][config.n_embd : 2 * config.n_embd] = 0
        d_x, g = ln_1.backward(ops, params, x, stats_1, d_h1)
        grads.update(g)
        return d_x + d_h_mid, grads

    def cost(self, config: GPT2Config, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.n_embd
        matmul = 2 * tokens * (3 * n * n + n * n + 2 * n * config.n_inner)
        attention = 2 * tokens * seq_len * n  # causal: half of q.k and p.v
        activations = tokens * act_bytes * (2 * n + 9 * n + 8 * n)
        # mlp: ln_2 reads h_mid and writes its output, c_fc reads that and writes fc
        mlp_in = Work(
            2 * tokens * n * config.n_inner, tokens * act_bytes * (3 * n + config.n_inner)
        )
        # recompute: forward up to the saved fc (no GELU, no MLP c_proj, no output): x
        # read and the 9 * n_embd saved values written
        return LayerCost(
            forward=Work(matmul + attention, activations),
            backward=Work(2 * matmul + 2.5 * attention, 2 * activations),
            recompute=Work(
                matmul - 2 * tokens * n * config.n_inner + attention, tokens * act_bytes * 10 * n
            ),
            partial={"mlp": mlp_in},
        )


class GPT2Head:
    """Final layer norm, logits against the tied ``wte`` chunk by chunk, mean loss."""

    def forward_backward(
        self, config: GPT2Config, params: Tensors, x: torch.Tensor, targets: Any, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
        norm = LayerNorm("ln_f.weight", "ln_f.bias", config.layer_norm_epsilon)
        return lm_head_loss(env, params, x, targets, norm=norm, projection="wte")

    def cost(self, config: GPT2Config, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.n_embd
        logits = 2 * tokens * config.vocab_size * n
        work = Work(3 * logits, tokens * act_bytes * 4 * n + tokens * config.vocab_size * 8)
        return LayerCost(forward=work, backward=Work())


def math_of(kind: str) -> Any:
    """The math object of a layer kind (``embed``, ``block``, ``head``)."""
    kinds = {"embed": GPT2Embed, "block": GPT2Block, "head": GPT2Head}
    if kind not in kinds:
        raise KeyError(f"gpt2 has no layer kind {kind!r}; its kinds: {', '.join(kinds)}")
    return kinds[kind]()
