"""The gated delta rule (Gated DeltaNet's recurrence), forward and backward, as explicit ops.

Per value head, a state ``S`` (k_dim x v_dim, zero at the start of each sequence) is
decayed, corrected towards the token's value and read by its query::

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T        (the delta rule)
    o_t = scale * S_t^T q_t

- ``gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None) -> out``: q, k (batch, seq,
  k_heads, k_dim); v (batch, seq, v_heads, v_dim), ``v_heads`` a multiple of ``k_heads``
  (value head h reads key head ``h // (v_heads / k_heads)``, HF's grouped values); g
  (batch, seq, v_heads), the log decay (<= 0); beta (batch, seq, v_heads). ``scale``
  defaults to ``k_dim ** -0.5``. out (batch, seq, v_heads, v_dim) in v's dtype. q and k
  are taken as given (the caller L2-normalizes them).
- ``gated_delta_rule_bwd(d_out, q, k, v, g, beta, *, scale=None) -> (dq, dk, dv, dg,
  dbeta)``, each shaped and typed as its input (dq and dk summed over each key head's
  group). It takes the forward's inputs, not its chunk states: every variant re-derives
  the states chunk by chunk from them (fla's backward does the same), so a caller saves
  only what it already holds.

``gated_delta_rule_fwd`` / ``_bwd`` (the ``torch`` variants): pure torch, chunked (64
tokens; the WY form: the chunk's delta rules as one triangular solve, then one state
update per chunk), float32 math (float64 for float64 inputs), any device; its work is
linear in the sequence length. The backward runs the forward once more without gradients
to re-derive each chunk's starting state, then walks the chunks backwards differentiating
one chunk's step at a time (``_chunk``, the same function the forward runs) with
``torch.autograd.grad``.

``*_reference``: the recurrence token by token as written above, and its backward by
hand, a reverse scan over the tokens (from every token's state, kept by a forward pass):
the truth the chunked and ``fla`` variants are held to. Memory: every token's state.

``*_fla``: flash-linear-attention's Triton kernels (``fla``, imported when called, CUDA
only): its chunked forward, and its backward after recomputing the chunk-local decay sums
and the WY matrix its forward would have kept.
"""

from __future__ import annotations

import torch

from dataflow_kernels_torch._support import stats_dtype

CHUNK = 64


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The values heads per key head."""
    if q.shape != k.shape or q.shape[:2] != v.shape[:2] or v.shape[2] % k.shape[2]:
        raise ValueError(
            f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must match and "
            f"v {tuple(v.shape)} have a multiple of their heads"
        )
    return v.shape[2] // k.shape[2]


def _heads_first(t: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, seq, heads, ...) -> (batch, heads * group, seq, ...) in ``dtype``."""
    t = t.to(dtype).transpose(1, 2)
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _heads_first_all(q, k, v, g, beta):
    group, dtype = _check(q, k, v), stats_dtype(v.dtype)
    q, k = _heads_first(q, group, dtype), _heads_first(k, group, dtype)
    return (q, k, *(_heads_first(t, 1, dtype) for t in (v, g, beta))), group


def _to_inputs(grads, inputs, group: int) -> tuple[torch.Tensor, ...]:
    """Heads-first gradients of (q, k, v, g, beta) back in the inputs' layout and dtypes,
    q's and k's summed over each key head's group."""
    out = []
    for index, (grad, like) in enumerate(zip(grads, inputs, strict=True)):
        grad = grad.transpose(1, 2)
        if index < 2 and group > 1:
            grad = grad.unflatten(2, (like.shape[2], group)).sum(3)
        out.append(grad.to(like.dtype).contiguous())
    return tuple(out)


def _chunk(q, k, v, g, beta, state):
    """One chunk of every (batch, head): q, k (B, H, C, K) (q already scaled), v (B, H, C,
    V), g, beta (B, H, C), state (B, H, K, V) at the chunk's start -> (out, next state)."""
    size = q.shape[-2]
    # the log decays from the chunk's start to each token, and between each pair, summed
    # and differenced in float64: over a chunk of strong decays the sums reach -1e3, where
    # float32 differences lose the few units that decide exp()
    wide = g.to(torch.float64).cumsum(-1)
    incl = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    pair = (wide[..., :, None] - wide[..., None, :]).masked_fill(~incl, -torch.inf)
    pair, decay = pair.exp().to(q.dtype), wide.to(q.dtype)
    tail = (wide[..., -1:] - wide).exp().to(q.dtype)  # from each token to the chunk's end
    k_beta = k * beta[..., None]
    # the chunk's delta rules at once: (I + L) X = rhs, L the strictly lower beta k k^T
    system = ((k_beta @ k.mT) * pair).tril(-1) + torch.eye(size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False)
    v_new = u - w @ state
    out = (q * decay.exp()[..., None]) @ state + ((q @ k.mT) * pair) @ v_new
    carried = state * decay[..., -1:].exp()[..., None] + (k * tail[..., None]).mT @ v_new
    return out, carried


def _prepared(q, k, v, g, beta, scale):
    """Heads first in the math dtype, padded to whole chunks, q scaled."""
    (q, k, v, g, beta), _ = _heads_first_all(q, k, v, g, beta)
    pad = -q.shape[2] % CHUNK
    if pad:  # zero beta and zero decay: padded tokens change nothing before them
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    return q * _scale(q, scale), k, v, g, beta


def _states(q, k, v, g, beta):
    """(out, each chunk's starting state) of prepared inputs."""
    batch, heads, seq, k_dim = k.shape
    state = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    outs, starts = [], []
    for start in range(0, seq, CHUNK):
        part = slice(start, start + CHUNK)
        starts.append(state)
        out, state = _chunk(*(t[:, :, part] for t in (q, k, v, g, beta)), state)
        outs.append(out)
    return torch.cat(outs, dim=2), starts


def gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None):
    seq = q.shape[1]
    with torch.no_grad():
        out, _ = _states(*_prepared(q, k, v, g, beta, scale))
    return out[:, :, :seq].transpose(1, 2).to(v.dtype).contiguous()


def gated_delta_rule_bwd(d_out, q, k, v, g, beta, *, scale=None):
    seq, group = q.shape[1], _check(q, k, v)
    prepared = _prepared(q, k, v, g, beta, scale)
    with torch.no_grad():
        _, starts = _states(*prepared)
    d_o = _heads_first(d_out, 1, prepared[0].dtype)
    d_o = torch.nn.functional.pad(d_o, (0, 0, 0, prepared[0].shape[2] - seq))
    grads: list[list[torch.Tensor]] = [[] for _ in range(5)]
    d_state = torch.zeros_like(starts[0])
    for index in reversed(range(len(starts))):
        part = slice(index * CHUNK, (index + 1) * CHUNK)
        with torch.enable_grad():
            leaves = [t[:, :, part].detach().requires_grad_() for t in prepared]
            state = starts[index].detach().requires_grad_()
            out, carried = _chunk(*leaves, state)
            *found, d_state = torch.autograd.grad(
                (out, carried), (*leaves, state), (d_o[:, :, part], d_state)
            )
        for into, grad in zip(grads, found, strict=True):
            into.insert(0, grad)
    dq, dk, dv, dg, dbeta = (torch.cat(parts, dim=2)[:, :, :seq] for parts in grads)
    dq = dq * _scale(q, scale)

    return _to_inputs((dq, dk, dv, dg, dbeta), (q, k, v, g, beta), group)


# -- the reference: the recurrence, token by token -----------------------------------------


def _token_states(q, k, v, g, beta):
    """Every token's state (batch, heads, seq + 1, k_dim, v_dim), the first all zeros,
    of heads-first math-dtype inputs (q unscaled)."""
    batch, heads, seq, k_dim = k.shape
    states = [q.new_zeros(batch, heads, k_dim, v.shape[-1])]
    for t in range(seq):
        kept = states[-1] * g[:, :, t, None, None].exp()
        error = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", kept, k[:, :, t])
        update = torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * error)
        states.append(kept + update)
    return torch.stack(states, 2)


def gated_delta_rule_fwd_reference(q, k, v, g, beta, *, scale=None):
    (q, k, v, g, beta), _ = _heads_first_all(q, k, v, g, beta)
    states = _token_states(q, k, v, g, beta)[:, :, 1:]
    out = _scale(q, scale) * torch.einsum("bhtkv,bhtk->bhtv", states, q)
    return out.transpose(1, 2).to(v.dtype).contiguous()


def gated_delta_rule_bwd_reference(d_out, q, k, v, g, beta, *, scale=None):
    inputs = (q, k, v, g, beta)
    (q, k, v, g, beta), group = _heads_first_all(*inputs)
    scale = _scale(q, scale)
    d_o = _heads_first(d_out, 1, q.dtype)
    states = _token_states(q, k, v, g, beta)
    grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
    dq, dk, dv, dg, d_beta = grads
    d_state = torch.zeros_like(states[:, :, 0])  # of S_t, from the tokens after t
    for t in reversed(range(q.shape[2])):
        # o_t = scale S_t^T q_t
        d_state = d_state + scale * torch.einsum("bhk,bhv->bhkv", q[:, :, t], d_o[:, :, t])
        dq[:, :, t] = scale * torch.einsum("bhkv,bhv->bhk", states[:, :, t + 1], d_o[:, :, t])
        # S_t = P + k u^T, u = beta (v - P^T k), P = exp(g_t) S_{t-1}
        decay = g[:, :, t, None, None].exp()
        kept = decay * states[:, :, t]
        error = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", kept, k[:, :, t])
        u = beta[:, :, t, None] * error
        d_u = torch.einsum("bhkv,bhk->bhv", d_state, k[:, :, t])
        d_read = -beta[:, :, t, None] * d_u  # of P^T k
        d_beta[:, :, t] = (d_u * error).sum(-1)
        dv[:, :, t] = beta[:, :, t, None] * d_u
        dk[:, :, t] = torch.einsum("bhkv,bhv->bhk", d_state, u) + torch.einsum(
            "bhkv,bhv->bhk", kept, d_read
        )
        d_kept = d_state + torch.einsum("bhk,bhv->bhkv", k[:, :, t], d_read)
        dg[:, :, t] = (d_kept * kept).sum((-1, -2))
        d_state = decay * d_kept

    return _to_inputs(grads, inputs, group)


# -- fla (CUDA) --------------------------------------------------------------------------


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


def gated_delta_rule_fwd_fla(q, k, v, g, beta, *, scale=None):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    _check(q, k, v)
    q, k, v, beta = _contiguous(q, k, v, beta)
    _, out, _, _, _, _ = chunk_gated_delta_rule_fwd(
        q, k, v, g.float().contiguous(), beta, _scale(q, scale), None, False, chunk_size=CHUNK
    )
    return out.to(v.dtype)


def gated_delta_rule_bwd_fla(d_out, q, k, v, g, beta, *, scale=None):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    _check(q, k, v)
    d_out, q, k, v, beta = _contiguous(d_out, q, k, v, beta)
    # what fla's forward keeps: the chunk-local decay sums (log2) and the WY matrix
    decay = chunk_local_cumsum(g.float().contiguous(), chunk_size=CHUNK, scale=RCP_LN2)
    _, _, wy = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=decay, beta=beta, chunk_size=CHUNK)
    dq, dk, dv, dbeta, dg, *_ = chunk_gated_delta_rule_bwd(
        q=q, k=k, v=v, g=decay, beta=beta, A=wy, scale=_scale(q, scale),
        initial_state=None, do=d_out, dht=None, chunk_size=CHUNK,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)
