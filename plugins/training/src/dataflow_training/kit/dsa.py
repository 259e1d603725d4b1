"""DeepSeek Sparse Attention (DSA: DeepSeek V3.2, GLM 5), as an attention part and a block.

MLA (``mla.py``) whose queries each attend to ``K`` earlier tokens only, chosen by a
**lightning indexer** (DeepSeek-V3.2 report, arXiv:2512.02556, section 2.1; transformers'
``DeepseekV32Indexer``). With ``h`` the block's normed input, ``c_q`` MLA's normed query
latent (``q_a_layernorm(q_a_proj(h))``), ``Hi`` indexer heads of width ``Di``::

    qi  = rope(wq_b(c_q))              (batch, seq, Hi, Di)   rope on the first
    ki  = rope(LayerNorm(wk(h)))       (batch, seq, Di)       qk_rope_head_dim dims
    w   = weights_proj(h) / sqrt(Hi)   (float32 weight and math)
    I[s, t] = sum_h w[s, h] * relu(qi[s, h] . ki[t] / sqrt(Di))     t <= s, float32
    index = top-K of I[s, :]           (batch, seq, K) int32

``K`` is ``min(index_topk, seq)``; with ``index_dense`` (the warm-up) it is ``seq``: every
earlier token is selected and the attention is dense. The indexer's rope takes MLA's
tables (YaRN included) and rotates half-split pairs (DeepSeek V3.2) or interleaved pairs
(``index_rope_interleave``: GLM 5). The core attends to the selected tokens only, and
causally (``sparse_attention_fwd``: a selected position past its query, which the top-K
of an early query holds, is not seen).

**The indexer's loss** (the report's eq. 3 and 4): per query, KL(p || softmax(I)) over
the query's selected earlier tokens, where ``p`` is the main attention's distribution
summed over its heads and L1-normalised (``sparse_attention_probs``: the heads' mean);
averaged over the round's queries, times ``index_loss_coef``, averaged over the step's
rounds as the cross-entropy is. The indexer's inputs are detached: its loss trains the
indexer alone, and the language-model loss does not reach it (the top-K has no
gradient), so the main model's gradients are those of the cross-entropy (and the MoE's
balance term). transformers' model computes no such loss (its indexer runs under
``no_grad``): the family's HF tests hold it to a plain-autograd KL written in the test.

**AuxTemp** ``index`` (batch, seq, K) int32, made by forward, read verbatim by recompute
and backward (65,536 tokens at K = 2,048: 512 MiB a layer). **Saved**: MLA's latents
only; backward makes the indexer's q and k again from ``h`` and ``c_q`` (which MLA's
backward makes anyway) to differentiate its loss, so nothing of the indexer is saved.

**Index sharing** (GLM 5's ``indexer_types``): a ``"shared"`` layer has no indexer and
attends to the selection of the nearest earlier ``"full"`` layer, its **leader**
(``SharedIndexAttention``). It reads the leader's ``index`` through ``env.shared``. Its
attention's distribution joins the leader's KL target: each follower's backward adds
its ``p`` into the group's ``target`` object (the last member's backward creates it,
zeroed by the task, the middle ones add to it), and the leader's backward averages it
with its own ``p`` over the group's members and trains its indexer towards that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch

from dataflow_training.kit import mla, rotary
from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder import _positive, flag
from dataflow_training.kit.decoder_math import check_seq_len
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.mla import LatentAttention, softmax_scale
from dataflow_training.kit.moe import _coefficient
from dataflow_training.kit.norms import LayerNorm
from dataflow_training.step.family import Env, FamilyContractError, TensorSpec

Tensors = dict[str, torch.Tensor]

#: the AuxTemp entry of a leader's selection; the shared KL target of its group and the
#: count of the followers that added to it
INDEX, TARGET, MEMBERS = "index", "target", "members"
#: the indexer key norm's epsilon (transformers' ``nn.LayerNorm(head_dim, eps=1e-6)``)
INDEX_NORM_EPS = 1e-6

WQ_B = Linear("self_attn.indexer.wq_b.weight")
WK = Linear("self_attn.indexer.wk.weight")
K_NORM = LayerNorm("self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias", 1e-6)
WEIGHTS = Linear("self_attn.indexer.weights_proj.weight")


@attrs.frozen(slots=False)
class DSAFields:
    """The indexer's config fields (HF's names: ``index_n_heads``, ``index_head_dim``,
    ``index_topk``), for a config class to take before MLA's. ``index_rope_interleave``:
    the indexer's rope pairs interleaved (GLM 5) or half-split (DeepSeek V3.2).
    ``index_loss_coef`` scales the indexer's KL loss; ``index_dense`` selects every
    earlier token (the dense warm-up). Training settings HF's config does not carry."""

    index_n_heads: int = attrs.field(default=64, kw_only=True, validator=_positive)
    index_head_dim: int = attrs.field(default=128, kw_only=True, validator=_positive)
    index_topk: int = attrs.field(default=2048, kw_only=True, validator=_positive)
    index_rope_interleave: bool = attrs.field(default=False, kw_only=True, validator=flag)
    index_loss_coef: float = attrs.field(default=1.0, kw_only=True, validator=_coefficient)
    index_dense: bool = attrs.field(default=False, kw_only=True, validator=flag)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # the next field class's, then the decoder config's
        name = type(self).__name__
        if self.q_lora_rank is None:
            raise ValueError(
                f"{name}.q_lora_rank is None: the indexer reads MLA's query latent, so "
                "sparse attention needs one"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"{name}.index_head_dim ({self.index_head_dim}) must be at least "
                f"{name}.qk_rope_head_dim ({self.qk_rope_head_dim}): the indexer rotates "
                "that many of its dims"
            )

    def selected(self, seq_len: int) -> int:
        """K, the keys each query attends to at ``seq_len`` tokens."""
        return seq_len if self.index_dense else min(self.index_topk, seq_len)


# -- the indexer -----------------------------------------------------------------------


def indexer_params(config: Any) -> tuple[TensorSpec, ...]:
    """The indexer's parameters (HF's names and order); ``weights_proj`` float32."""
    heads, width, n = config.index_n_heads, config.index_head_dim, config.hidden_size
    return (
        TensorSpec(WQ_B.weight, (heads * width, config.q_lora_rank)),
        TensorSpec(WK.weight, (width, n)),
        TensorSpec(K_NORM.weight, (width,), decay=False),
        TensorSpec(K_NORM.bias, (width,), decay=False),
        TensorSpec(WEIGHTS.weight, (heads, n), dtype="float32"),
    )


def _rope(config: Any, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Rotate the first ``qk_rope_head_dim`` dims of x (batch, heads, seq, Di)."""
    r = config.qk_rope_head_dim
    head = mla._interleaved(x[..., :r]) if config.index_rope_interleave else x[..., :r]
    return torch.cat((rotary.apply(head, cos, sin), x[..., r:]), dim=-1)


def _rope_backward(config: Any, d: torch.Tensor, cos, sin) -> torch.Tensor:
    r = config.qk_rope_head_dim
    head = rotary.backward(d[..., :r], cos, sin)
    if config.index_rope_interleave:
        head = mla._interleaved_backward(head)
    return torch.cat((head, d[..., r:]), dim=-1)


def _indexer_inputs(config, params, h, q_latent, tables, ops) -> dict[str, Any]:
    """qi (batch, Hi, seq, Di) and ki (batch, 1, seq, Di) float32 after rope, the head
    weights w (batch, seq, Hi) float32, and what backward needs of the way there."""
    heads, width = config.index_n_heads, config.index_head_dim
    cos, sin = tables
    batch, seq, _ = h.shape
    q = WQ_B.forward(ops, params, q_latent).view(batch, seq, heads, width).transpose(1, 2)
    k_raw = WK.forward(ops, params, h)
    k_normed, k_stats = K_NORM.forward(ops, params, k_raw)
    weights = params[WEIGHTS.weight]
    acc = torch.promote_types(h.dtype, torch.float32)  # float32 scores (float64 stays)
    w = ops["linear"](h.to(weights.dtype), weights).to(acc) * heads**-0.5
    return {
        "q": _rope(config, q, cos, sin).to(acc),
        "k": _rope(config, k_normed.unsqueeze(1), cos, sin).to(acc),
        "w": w,
        "k_raw": k_raw,
        "k_stats": k_stats,
    }


def index_scores(config: Any, qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor):
    """I (batch, seq, seq) float32, -inf past each query."""
    scores = torch.relu(qi @ ki.transpose(-1, -2) * config.index_head_dim**-0.5)
    index = torch.einsum("bsh,bhst->bst", w, scores)
    seq = index.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=index.device).tril()
    return index.masked_fill(~causal, float("-inf"))


def select(config: Any, params: Tensors, h, q_latent, tables, ops) -> torch.Tensor:
    """The indexer's top-K (batch, seq, K) int32 of the normed block input ``h`` and
    MLA's normed query latent (no gradient: the indexer's own loss trains it)."""
    found = _indexer_inputs(config, params, h, q_latent, tables, ops)
    scores = index_scores(config, found["q"], found["k"], found["w"])
    return scores.topk(config.selected(h.shape[1]), dim=-1).indices.to(torch.int32)


def indexer_backward(
    config: Any,
    params: Tensors,
    h: torch.Tensor,
    q_latent: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    indices: torch.Tensor,
    target: torch.Tensor,
    scale: float,
    ops: Any,
) -> Tensors:
    """The indexer's gradients of ``scale`` times the sum over queries of KL(target ||
    softmax(I over the selected earlier tokens)); ``target`` (batch, seq, K) float32 sums
    to 1 over each query's selected earlier tokens. Its inputs are detached: no
    gradient of ``h`` or ``q_latent``."""
    heads, width = config.index_n_heads, config.index_head_dim
    found = _indexer_inputs(config, params, h, q_latent, tables, ops)
    qi, ki, w = found["q"], found["k"][:, 0], found["w"]
    batch, seq, _ = h.shape
    idx = indices.long()
    rows = torch.arange(batch, device=h.device)[:, None, None]
    k_sel = ki[rows, idx]  # (batch, seq, K, Di)
    z = torch.einsum("bhsd,bskd->bhsk", qi, k_sel) * width**-0.5
    relu = torch.relu(z)
    scores = torch.einsum("bsh,bhsk->bsk", w, relu)
    positions = torch.arange(seq, device=h.device)
    valid = idx <= positions[None, :, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    d_scores = (torch.softmax(scores, -1) - target.to(scores.dtype)) * valid * scale
    d_w = torch.einsum("bsk,bhsk->bsh", d_scores, relu)
    d_z = d_scores[:, None] * w.transpose(1, 2)[..., None] * (z > 0)
    d_qi = torch.einsum("bhsk,bskd->bhsd", d_z, k_sel) * width**-0.5
    d_k_sel = torch.einsum("bhsk,bhsd->bskd", d_z, qi) * width**-0.5
    d_ki = d_k_sel.new_zeros(batch, seq, width)
    d_ki.index_put_((rows.expand_as(idx), idx), d_k_sel, accumulate=True)
    cos, sin = tables
    grads: Tensors = {}
    d_q = _rope_backward(config, d_qi.to(cos.dtype), cos, sin)
    d_q = d_q.transpose(1, 2).reshape(batch, seq, heads * width).to(q_latent.dtype)
    grads.update(WQ_B.backward(ops, params, q_latent, d_q)[1])
    d_k = _rope_backward(config, d_ki.unsqueeze(1).to(cos.dtype), cos, sin)[:, 0]
    d_k_raw, g = K_NORM.backward(ops, params, found["k_raw"], found["k_stats"], d_k.to(h.dtype))
    grads.update(g)
    grads.update(WK.backward(ops, params, h, d_k_raw)[1])
    weights = params[WEIGHTS.weight]
    d_w = (d_w * heads**-0.5).to(weights.dtype)
    grads.update(WEIGHTS.backward(ops, {WEIGHTS.weight: weights}, h.to(weights.dtype), d_w)[1])
    return grads


def indexer_flops(config: Any, batch: int, seq_len: int) -> float:
    """One forward of the indexer: its projections and the scores of every earlier token
    (the quadratic part DSA keeps, over ``Hi`` heads of ``Di``)."""
    tokens, n = batch * seq_len, config.hidden_size
    heads, width = config.index_n_heads, config.index_head_dim
    projections = 2 * tokens * (config.q_lora_rank * heads * width + n * width + n * heads)
    return projections + batch * seq_len * seq_len * heads * width  # causal half of 2 S^2


def selected_pairs(config: Any, seq_len: int) -> int:
    """(query, key) pairs the sparse attention keeps in one sequence: ``min(i + 1, K)``."""
    k = config.selected(seq_len)
    return k * (k + 1) // 2 + (seq_len - k) * k


# -- the attention parts -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexedAttention(LatentAttention):
    """MLA whose queries attend to the selection of its own lightning indexer (module
    docstring): MLA's parameters, then the indexer's (``self_attn.indexer.*``); AuxTemp
    ``index``; saved as MLA."""

    ops = (
        *LatentAttention.ops,
        "layer_norm_fwd",
        "layer_norm_bwd",
        "sparse_attention_fwd",
        "sparse_attention_bwd",
        "sparse_attention_probs",
    )

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        return (*super().params(config), *indexer_params(config))

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec(INDEX, (batch, seq_len, config.selected(seq_len)), "int32"),)

    def reference(self, config: Any) -> Any:
        # the reference module imports only torch; loaded with the part's reference
        from dataflow_training.kit.dsa_reference import IndexedAttention as Reference

        return Reference(config)

    def selection(
        self, config: Any, params: Tensors, h, projected: Tensors, aux_temp, env: Env, ops
    ) -> tuple[torch.Tensor, Tensors]:
        """(the indices, the AuxTemp forward writes): the recorded ones where ``aux_temp``
        holds them (recompute, backward), else the indexer's choice."""
        if aux_temp is not None:
            return aux_temp[INDEX], {}
        q_latent, _ = mla.Q_NORM.forward(ops, params, projected["q_a"])
        tables = self._tables(config, projected["kv_a"])
        indices = select(config, params, h, q_latent, tables, ops)
        return indices, {INDEX: indices}

    def core_forward(self, config, ops, q, k, v, indices=None):
        return ops["sparse_attention_fwd"](q, k, v, indices, scale=softmax_scale(config))

    def core_backward(self, config, ops, d_out, q, k, v, out, lse, indices=None):
        return ops["sparse_attention_bwd"](
            d_out, q, k, v, out, lse, indices, scale=softmax_scale(config)
        )

    def attend_selected(
        self, config: Any, params: Tensors, projected: Tensors, indices, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        """MLA's ``attend`` over the selection."""
        built = self._heads(config, params, projected, ops)
        width = self._width(config)
        q, k, v = (mla._pad(built[name], width) for name in ("q", "k", "v"))
        del built
        out, lse = self.core_forward(config, ops, q, k, v, indices)
        del q, k, v
        attn = mla.merge_heads(out[..., : config.v_head_dim])
        return mla.O_PROJ.forward(ops, params, attn), {"attn": attn, "lse": lse}

    def backward_selected(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        indices: torch.Tensor,
        d_out: torch.Tensor,
        grads: dict[str, torch.Tensor],
        env: Env,
    ) -> tuple[torch.Tensor, ...]:
        """MLA's backward over the selection, and the indexer's gradients of its loss
        towards this layer's attention distribution (with its group's)."""
        ops, heads = env.ops, config.num_attention_heads
        d_attn, g = mla.O_PROJ.backward(ops, params, saved["attn"], d_out)
        grads.update(g)
        built = self._heads(config, params, saved, ops)
        width = self._width(config)
        q, k, v = (mla._pad(built[name], width) for name in ("q", "k", "v"))
        out = mla._pad(mla.split_heads(saved["attn"], heads), width)
        d_core = mla._pad(mla.split_heads(d_attn, heads), width)
        scale = softmax_scale(config)
        probs = ops["sparse_attention_probs"](q, k, saved["lse"], indices, scale=scale)
        d_heads = self.core_backward(config, ops, d_core, q, k, v, out, saved["lse"], indices)
        del q, k, v, out, d_attn, d_core
        self.indexer_loss(config, params, h, built, indices, probs, grads, env)
        return self.latents_backward(config, params, saved, built, d_heads, grads, ops)

    def indexer_loss(self, config, params, h, built, indices, probs, grads, env) -> None:
        """The indexer's gradients towards ``probs`` (with the group's target, where this
        layer leads followers)."""
        if TARGET in env.shared:  # a leader of followers: the group's mean
            probs = (probs + env.shared[TARGET]) / (1 + env.shared[MEMBERS])
        tokens = h.shape[0] * h.shape[1]
        scale = config.index_loss_coef / (tokens * env.rounds)
        tables = built["tables"]
        grads.update(
            indexer_backward(
                config, params, h, built["q_latent"], tables, indices, probs, scale, env.ops
            )
        )

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        """MLA's projections and the indexer's work; the attention over the selected
        pairs (``selected_pairs``)."""
        projections, _ = super().flops(config, batch, seq_len)
        heads = config.num_attention_heads
        width = heads * (self._qk(config) + config.v_head_dim) // 2
        pairs = batch * selected_pairs(config, seq_len)
        return projections, 4 * width * pairs + indexer_flops(config, batch, seq_len)


@dataclasses.dataclass(frozen=True)
class SharedIndexAttention(IndexedAttention):
    """MLA over its leader's selection (GLM 5's ``"shared"`` layers): no indexer, no
    AuxTemp of its own; it reads ``env.shared["index"]`` and adds its distribution into
    ``env.shared["target"]``."""

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        return LatentAttention.params(self, config)

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return ()

    def reference(self, config: Any) -> Any:
        # the reference module imports only torch; loaded with the part's reference
        from dataflow_training.kit.dsa_reference import SharedIndexAttention as Reference

        return Reference(config)

    def selection(self, config, params, h, projected, aux_temp, env, ops):
        if INDEX not in env.shared:
            raise FamilyContractError(
                "a shared-index layer's task sees no leader's selection (env.shared has "
                f"{sorted(env.shared) or 'nothing'})"
            )
        return env.shared[INDEX], {}

    def indexer_loss(self, config, params, h, built, indices, probs, grads, env) -> None:
        if TARGET in env.shared:  # absent where the group's leader does not train
            env.shared[TARGET].add_(probs)
            env.shared[MEMBERS].add_(1)

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        projections, attention = super().flops(config, batch, seq_len)
        return projections, attention - indexer_flops(config, batch, seq_len)


# -- the block ---------------------------------------------------------------------------

#: what a sparse-attention block whose experts run apart says when run (``predict``
#: prices it; its routing tasks' math is not written)
_NOT_APART = (
    "runs sparse attention with its experts routed apart (expert shards), which is not "
    "built: price it with `dataflow predict`, or train a size whose experts fit one object"
)


@dataclasses.dataclass(frozen=True)
class IndexedBlock(Block):
    """``Block`` whose attention part is an ``IndexedAttention``: its AuxTemp is the
    attention's selection and the FFN's, and forward, recompute and backward pass the
    selection (recorded, or the leader's) to the attention."""

    attention: IndexedAttention = IndexedAttention()

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return (
            *self.attention.aux_temp(config, batch, seq_len),
            *self.ffn.aux_temp(config, batch, seq_len),
        )

    def shared_target(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        """The KL target of a group this block leads (module docstring): its followers'
        distributions summed over the selection, and how many added to it."""
        k = config.selected(seq_len)
        return (
            TensorSpec(TARGET, (batch, seq_len, k), "float32"),
            TensorSpec(MEMBERS, (1,), "float32"),
        )

    def _half(
        self, config: Any, params: Tensors, x: torch.Tensor, aux_temp, env: Env
    ) -> tuple[Tensors, torch.Tensor, Tensors]:
        """(saved, ``n2(h_mid)``, the attention's AuxTemp) of the attention half."""
        check_seq_len(config, x.shape[1])
        self._segments(env)  # refuses a padded or packed batch: the selection takes none
        ops = env.ops
        norm_1, norm_2 = self._norms(config)
        h1, _ = norm_1.forward(ops, params, x)
        projected = self.attention.project(config, params, h1, ops)
        indices, temp = self.attention.selection(config, params, h1, projected, aux_temp, env, ops)
        del h1
        out, attended = self.attention.attend_selected(config, params, projected, indices, ops)
        h_mid = x + out
        del out
        h2, _ = norm_2.forward(ops, params, h_mid)
        return {**projected, **attended, "h_mid": h_mid}, h2, temp

    def route_forward(self, config, params, x, env):
        raise FamilyContractError(_NOT_APART)

    def route_recompute(self, config, params, x, aux_temp, env):
        raise FamilyContractError(_NOT_APART)

    def route_backward(self, config, params, x, saved, aux_temp, dy, d_experts, env):
        raise FamilyContractError(_NOT_APART)

    def forward(self, config, params, x, env):
        saved, h2, temp = self._half(config, params, x, None, env)
        out, ffn_saved, ffn_temp = self.ffn.forward(config, params, h2, env)
        del h2
        return saved["h_mid"] + out, saved | ffn_saved, temp | ffn_temp

    def recompute(self, config, params, x, aux_temp, env):
        saved, h2, _ = self._half(config, params, x, aux_temp, env)
        return saved | self.ffn.recompute(config, params, h2, aux_temp, env.ops)

    def backward(self, config, params, x, saved, aux_temp, dy, env):
        ops = env.ops
        norm_1, norm_2 = self._norms(config)
        h2, stats_2 = norm_2.forward(ops, params, saved["h_mid"])
        d_h2, grads = self.ffn.backward(config, params, h2, saved, aux_temp, dy, env)
        del h2
        d_h_mid, g = norm_2.backward(ops, params, saved["h_mid"], stats_2, d_h2)
        grads.update(g)
        del d_h2
        d_h_mid += dy
        h1, stats_1 = norm_1.forward(ops, params, x)
        indices, _ = self.attention.selection(config, params, h1, saved, aux_temp, env, ops)
        d_projected = self.attention.backward_selected(
            config, params, h1, saved, indices, d_h_mid, grads, env
        )
        d_h1 = self.attention.project_backward(config, params, h1, d_projected, grads, ops)
        del d_projected, h1
        d_x, g = norm_1.backward(ops, params, x, stats_1, d_h1)
        grads.update(g)
        return d_x.add_(d_h_mid), grads

    def objective(self, config, params, x, aux_temp, env) -> torch.Tensor:
        """The indexer's loss this block's backward differentiates (module docstring), of
        a leader alone (a task that sees no group target), written with ``env.ops``:
        autograd through it gives the indexer's gradients backward returns."""
        if INDEX not in aux_temp:  # a shared-index layer: its leader's loss
            return x.new_zeros(())
        ops = env.ops
        h, _ = self._norms(config)[0].forward(ops, params, x)
        projected = self.attention.project(config, params, h, ops)
        built = self.attention._heads(config, params, projected, ops)
        width = self.attention._width(config)
        q, k, v = (mla._pad(built[name], width) for name in ("q", "k", "v"))
        indices = aux_temp[INDEX]
        with torch.no_grad():
            _, lse = self.attention.core_forward(config, ops, q, k, v, indices)
            target = ops["sparse_attention_probs"](q, k, lse, indices, scale=softmax_scale(config))
        found = _indexer_inputs(
            config, params, h.detach(), built["q_latent"].detach(), built["tables"], ops
        )
        scores = index_scores(config, found["q"], found["k"], found["w"]).gather(-1, indices.long())
        positions = torch.arange(x.shape[1], device=x.device)
        valid = indices.long() <= positions[None, :, None]
        log_q = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), -1)
        target = target.to(log_q.dtype)
        kl = torch.xlogy(target, target) - target * log_q.masked_fill(~valid, 0.0)
        tokens = x.shape[0] * x.shape[1]
        return config.index_loss_coef * kl.sum() / (tokens * env.rounds)
