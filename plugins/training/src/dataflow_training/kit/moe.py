"""A mixture-of-experts decoder on the kit: what OLMoE and Qwen 3 MoE share.

``RoutedExperts`` is an FFN part (``parts.py``): a block (``block.Block``) of the decoder's
attention and these routed SwiGLU experts instead of the dense FFN is::

    h = x + attention(n1(x));  u = n2(h);  p = softmax(u @ gate.T)          (float32)
    ids, top = topk(p, k);  w = top (OLMoE) or top / sum(top) (``norm_topk_prob``)
    y = h + sum_j w_j * down[ids_j] @ (silu(gate[ids_j] @ u) * up[ids_j] @ u)

Parameters: the attention, its norms and the router ``mlp.gate.weight`` (E, hidden) are the
layer's main group ``W_<layer>``; the experts, ``mlp.experts.gate_up_proj`` (E, 2 * inter,
hidden: gate rows then up rows) and ``mlp.experts.down_proj`` (E, hidden, inter), are their
own group ``W_<layer>.experts``, so a planner streams them apart.

**AuxTemp** (forward decides the routing once; recompute and backward read it verbatim):
``ids`` (tokens, k) int32 and ``weights`` (tokens, k), ``order`` (tokens * k) int32 (the
token slots sorted by expert, stable) and ``offsets`` (E + 1) int32 (where each expert's
rows start). Each expert's rows run through ``grouped_mm`` (one matmul per expert, or
``torch._grouped_mm``), gradients of the stacked weights through ``grouped_mm_wgrad``.

**Aux** ``counts`` (E,) float32, one object for the whole model (``Aux_moe``, the MoE
layers' ``aux_scope="model"`` and ``aux_key="moe"``, whatever their block kinds): the expert loads summed over the ``L`` MoE layers and the
step's rounds, zeroed by the step's first forward and added to by every layer's forward in
every round. The step's objective is the mean over rounds of the cross-entropy, plus two
router terms:

- load balance ``router_aux_loss_coef * E * sum_e f_e * P_e``, pooled over the layers as
  transformers pools them: ``f_e`` expert e's routed slots over every layer and round of
  the step per layer-token (``counts_e / (L * step tokens)``; it sums to k; no gradient)
  and ``P_e`` its router probability summed over every layer and the last round's tokens,
  per layer-token. Its gradient with respect to a token's probabilities is
  ``router_aux_loss_coef * E * f_e / (L * round tokens)``, the same for every layer: it
  needs the step's final counts, which exist only once every round's forwards have run,
  so it is applied by the last round's backward of every layer (earlier rounds' backwards
  have already run by then, which is why ``P_e`` is the last round's). For one round this
  is exactly ``router_aux_loss_coef * load_balancing_loss_func`` of transformers, for any
  number of layers (the HF tests check it with two); over several rounds transformers has
  no step-wide term (a loop over micro-batches adds each one's own), and this is the
  step-wide term whose counts span the rounds;
- router z-loss ``router_z_loss_coef / L * mean over tokens of logsumexp(logits)^2`` per
  round (ST-MoE; OLMoE trained with 0.001; transformers has none, so HF parity runs
  with 0).

Both terms belong to the training step: a block task that does not see its Aux (an
empty ``env.aux``, as ``dataflow verify``'s task level calls it) differentiates the
block's output alone.

Saved for backward (``A_<layer>``): the attention half's tensors and ``gate_up`` (tokens *
k, 2 * inter), the experts' two projections in expert order. The block's partial save
``mlp`` keeps the attention half's and re-derives ``gate_up`` (``n2`` and one grouped
matmul, with forward's routing). Backward recomputes the router logits (one (tokens,
hidden) x (hidden, E) matmul) and the experts' outputs (one grouped matmul) rather than
saving them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import attrs
import torch

from dataflow_training.kit import moe_reference
from dataflow_training.kit.attention import QKNorm, SelfAttention
from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder import (
    Decoder,
    DecoderConfig,
    _positive,
    expected_state,
    flag,
    parameter_count,
)
from dataflow_training.kit.hf import KeyRule
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.mlp import SwiGLU
from dataflow_training.kit.parts import FfnCost, as_is
from dataflow_training.step.family import Env, LayerCost, ParamGroup, TensorSpec, Work

Tensors = dict[str, torch.Tensor]

ROUTER = Linear("mlp.gate.weight")
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
EXPERTS_GROUP = "experts"

#: The most bytes of bfloat16 weights one expert shard holds when the config leaves
#: ``expert_shards`` to the sizes (0): a shard's optimizer task holds its weights, its
#: gradient and AdamW's two float32 moments at once, 6 bytes for each byte of bfloat16
#: weights, so 12 GiB at this size, which a 16 GiB budget still holds beside what a step
#: keeps resident; every builtin MoE preset whose experts take less a layer keeps them in
#: one object (OLMoE 1B-7B 0.8 GB, Qwen 3 MoE 30B-A3B 1.2 GB, Qwen 3.5 MoE 35B-A3B
#: 1.6 GB), DeepSeek V3's 22.5 GB a layer become 16 shards of 1.4 GB and Kimi K2's
#: 33.8 GB 16 of 2.1 GB.
EXPERT_SHARD_BYTES = 2 << 30


def expert_shards(config: Any, inner: int) -> int:
    """How many shards a layer's ``num_experts`` routed experts (width ``inner``) are
    stored and run in: ``config.expert_shards`` where it is set (>= 1, a divisor of the
    expert count), else the fewest whose bfloat16 weights are at most
    ``EXPERT_SHARD_BYTES`` a shard (a divisor of the expert count; one expert a shard
    where even one is larger)."""
    e = config.num_experts
    given = config.expert_shards
    if given:
        if e % given:
            name = type(config).__name__
            raise ValueError(f"{name}.expert_shards ({given}) must divide {name}.num_experts ({e})")
        return given
    per_expert = 2 * 3 * config.hidden_size * inner  # bfloat16 gate, up and down
    return next(
        (s for s in range(1, e + 1) if e % s == 0 and e // s * per_expert <= EXPERT_SHARD_BYTES),
        e,
    )


def _shard_count(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be an integer >= 1 (or 0: "
            f"from the experts' sizes), got {value!r}"
        )


def _coefficient(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a number >= 0, got {value!r}"
        )


# -- routing ---------------------------------------------------------------------------


def route(config: MoEConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router probabilities (tokens, E) in float32 at least, the top-k (values, ids))."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return probs, probs.topk(config.num_experts_per_tok, dim=-1)


def dispatch(
    config: MoEConfig, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``order``: token slots sorted by expert, stable; ``offsets`` (E + 1), both int32;
    each expert's load (E,) int64). Counted by a scatter, not ``bincount``, so that a GPU
    step does not wait for the host here."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    loads = torch.zeros(config.num_experts, dtype=torch.int64, device=ids.device)
    loads.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([loads.new_zeros(1), loads.cumsum(0)])
    return order.to(torch.int32), offsets.to(torch.int32), loads


def _rows(config: MoEConfig, aux_temp: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token of every expert row, its weight), in expert order."""
    order = aux_temp["order"].long()
    return order // config.num_experts_per_tok, aux_temp["weights"].reshape(-1)[order]


def _slot_rows(config: MoEConfig, aux_temp: Tensors) -> torch.Tensor:
    """(tokens, k) int64: the expert row of each token's every routing slot (``order``'s
    inverse)."""
    order = aux_temp["order"].long()
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    return rows.view(-1, config.num_experts_per_tok)


def _combine(
    rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per token, the sum of its slots' rows (times their ``weights``, (tokens, k)), in
    float32 and returned in ``rows``' dtype: (tokens, hidden).

    A gather per slot and a sum, where scattering the rows into their tokens
    (``index_add_``) takes atomic adds: compiled, this is one kernel reading ``k`` rows
    per token (session 19: ``index_add_``'s kernel took 2.3 ms a call at 16K tokens of
    OLMoE, 73 ms of a round's 507 ms of kernels)."""
    total = None
    for slot in range(slot_rows.shape[1]):
        part = rows[slot_rows[:, slot]].float()
        if weights is not None:
            part = part * weights[:, slot, None]
        total = part if total is None else total.add_(part)
    return total.to(rows.dtype)


@attrs.frozen(eq=False)
class ShardWindow:
    """Which expert rows a shard's task works on, in shapes the routing does not change
    (a CUDA graph replays them): ``rows`` (R,) int64, every expert row of the layer once,
    from the shard's first row on and wrapping round, so the shard's rows come first;
    ``valid`` (R,) bool, True for the shard's. The grouped GEMMs, given the shard's
    offsets, compute the shard's rows alone (those past them are left as their buffer
    held them); the valid rows are then added into their tokens (``rows_add_masked``) and
    written back (``put``, ``rows_put_masked``). The window's inputs are gathered the same
    way (``gather``, ``rows_gather_masked``): the masked row ops, whose Triton variants
    read and write the valid rows alone, so that every row past the shard's may hold
    anything and nothing downstream reads it."""

    rows: torch.Tensor
    valid: torch.Tensor

    def gather(self, ops: Any, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``source[index]`` (``index`` in the window's order) at the shard's rows; the
        other rows hold anything."""
        return ops["rows_gather_masked"](source, index, self.valid)

    def add(
        self,
        ops: Any,
        values: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor | None,
        count: int,
        shards: int,
    ) -> torch.Tensor:
        """(count, hidden) float32: each of the shard's rows of ``values`` (the window's
        order; times its ``weights``) added into its token (``tokens``, the window's
        order), the other rows ignored, whatever they hold. The torch variant's float32
        copy of the rows is made a shard's share at a time (``slices``)."""
        return ops["rows_add_masked"](values, tokens, self.valid, weights, count, slices=shards)

    def put(self, ops: Any, values: torch.Tensor, target: torch.Tensor) -> None:
        """``values`` (the window's order) into ``target`` (every row, expert order) at the
        shard's rows; the other rows keep what they hold."""
        ops["rows_put_masked"](values, self.rows, self.valid, target)


def _gate_up(config: MoEConfig, params: Tensors, h2: torch.Tensor, aux_temp: Tensors, ops: Any):
    tokens, _ = _rows(config, aux_temp)
    rows = h2.reshape(-1, config.hidden_size)[tokens]
    return ops["grouped_mm"](rows, params[GATE_UP], aux_temp["offsets"])


def _split(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows, up rows) of the experts' first projection (halves of its width)."""
    return gate_up.chunk(2, dim=-1)


SHARED = SwiGLU(
    Linear("mlp.shared_expert.gate_proj.weight"),
    Linear("mlp.shared_expert.up_proj.weight"),
    Linear("mlp.shared_expert.down_proj.weight"),
)
SHARED_GATE = Linear("mlp.shared_expert_gate.weight")


@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """One more SwiGLU expert that every token goes through beside the routed ones, as a
    part of ``RoutedExperts``, its output scaled by a sigmoid gate of the token (Qwen3-Next,
    Qwen 2 MoE, Qwen 3.5 MoE)::

        y += sigmoid(shared_expert_gate(h)) * down(silu(gate(h)) * up(h))

    ``width`` names the config field of its width. Parameters (HF's names)
    ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``
    (1, hidden), in the layer's main group; saved ``shared_gate`` and ``shared_up`` (its
    two projections); backward makes its output (one down projection) and the gate's
    logit (a (tokens, hidden) x (hidden, 1) product) again rather than saving them."""

    width: str = "shared_expert_intermediate_size"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, inner = config.hidden_size, getattr(config, self.width)
        return (
            TensorSpec(SHARED.gate.weight, (inner, n)),
            TensorSpec(SHARED.up.weight, (inner, n)),
            TensorSpec(SHARED.down.weight, (n, inner)),
            TensorSpec(SHARED_GATE.weight, (1, n)),
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        inner = getattr(config, self.width)
        return (
            TensorSpec("shared_gate", (batch * seq_len, inner)),
            TensorSpec("shared_up", (batch * seq_len, inner)),
        )

    def recompute(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        """Its two projections of ``h`` (tokens, hidden), as forward saves them."""
        return {
            "shared_gate": SHARED.gate.forward(ops, params, h),
            "shared_up": SHARED.up.forward(ops, params, h),
        }

    def forward(
        self, config: Any, params: Tensors, h: torch.Tensor, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        """(its gated output (tokens, hidden), what it saves) of ``h`` (tokens, hidden)."""
        saved = self.recompute(config, params, h, ops)
        act = ops["swiglu_fwd"](saved["shared_gate"], saved["shared_up"])
        scale = torch.sigmoid(SHARED_GATE.forward(ops, params, h))
        return SHARED.down.forward(ops, params, act) * scale, saved

    def backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        dy: torch.Tensor,
        ops: Any,
    ) -> tuple[torch.Tensor, Tensors]:
        """-> (dh, its gradients), ``h`` and ``dy`` (tokens, hidden)."""
        gate, up = saved["shared_gate"], saved["shared_up"]
        out = SHARED.down.forward(ops, params, ops["swiglu_fwd"](gate, up))
        scale = torch.sigmoid(SHARED_GATE.forward(ops, params, h))
        d_logit = (dy * out).sum(-1, keepdim=True) * scale * (1 - scale)
        del out
        d_h, grads = SHARED.backward(ops, params, h, gate, up, dy * scale)
        d_h_gate, g = SHARED_GATE.backward(ops, params, h, d_logit)
        grads.update(g)
        return d_h.add_(d_h_gate), grads

    def matmul_flops(self, config: Any, tokens: int) -> int:
        """Its forward's matmul FLOPs: three projections and the gate."""
        n = config.hidden_size
        return 2 * tokens * 3 * n * getattr(config, self.width) + 2 * tokens * n

    def reference_args(self, config: Any) -> dict[str, Any]:
        return {"shared_width": getattr(config, self.width)}


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """``num_experts`` SwiGLU experts of width ``intermediate_size`` behind a softmax
    router, ``num_experts_per_tok`` of them per token, as the FFN part of a block (see the
    module docstring). Parameters: the router ``mlp.gate.weight`` in the layer's main
    group, the stacked experts their own group ``experts``; Aux ``counts`` pooled over
    the layers (``aux_scope="model"``); AuxTemp the routing; saved ``gate_up``.
    ``shared``: a ``SharedExpert`` beside the routed ones (None: none)."""

    shared: SharedExpert | None = None
    #: the config field of the experts' width (DeepSeek's ``moe_intermediate_size``)
    width: str = "intermediate_size"

    ops = (
        "swiglu_fwd",
        "swiglu_bwd",
        "grouped_mm",
        "grouped_mm_wgrad",
        "rows_add_masked",
        "rows_put_masked",
        "rows_gather_masked",
        "swiglu_rows_bwd",
    )
    aux_scope = "model"
    #: every block of these experts, whatever its kind, adds its loads to ``Aux_moe``
    aux_key = "moe"
    #: the reference module's name in a block (HF's)
    module = "mlp"

    def params(self, config: MoEConfig) -> tuple[TensorSpec, ...]:
        router = TensorSpec(ROUTER.weight, (config.num_experts, config.hidden_size))
        return (router, *(self.shared.params(config) if self.shared is not None else ()))

    def inner(self, config: MoEConfig) -> int:
        """The experts' width."""
        return getattr(config, self.width)

    def groups(self, config: MoEConfig) -> tuple[ParamGroup, ...]:
        """The experts' group ``experts``, or with several shards (``expert_shards``) one
        group ``experts.<j>`` per shard, holding experts ``j * E / S`` up to ``(j + 1) *
        E / S`` (pieces of the state's stacked tensors)."""
        n, inner, e = config.hidden_size, self.inner(config), config.num_experts
        shards = self.shards(config)
        if shards == 1:
            experts = (TensorSpec(GATE_UP, (e, 2 * inner, n)), TensorSpec(DOWN, (e, n, inner)))
            return (ParamGroup(EXPERTS_GROUP, experts),)
        per = e // shards
        return tuple(
            ParamGroup(
                f"{EXPERTS_GROUP}.{j}",
                (
                    TensorSpec(GATE_UP, (per, 2 * inner, n), piece=(j, shards)),
                    TensorSpec(DOWN, (per, n, inner), piece=(j, shards)),
                ),
                shard=(j, shards),
            )
            for j in range(shards)
        )

    def shards(self, config: MoEConfig) -> int:
        """How many shards the experts are stored and run in (``expert_shards``)."""
        return expert_shards(config, self.inner(config))

    def aux(self, config: MoEConfig) -> tuple[TensorSpec, ...]:
        return (TensorSpec("counts", (config.num_experts,), dtype="float32"),)

    def hf_rules(self, config: MoEConfig, prefix: str) -> list[Any]:
        """The router as it is; each expert's tensors (``{prefix}.mlp.experts.{expert}.
        gate_proj.weight``, ...) stacked along the family tensor's dimension 0."""

        expert = prefix + ".mlp.experts.{expert}"
        return [
            *as_is(self.params(config), prefix),
            KeyRule(
                f"{{layer}}.{GATE_UP}",
                (f"{expert}.gate_proj.weight", f"{expert}.up_proj.weight"),
                stack="expert",
            ),
            KeyRule(f"{{layer}}.{DOWN}", f"{expert}.down_proj.weight", stack="expert"),
        ]

    def reference(self, config: MoEConfig) -> Any:

        shared = self.shared.reference_args(config) if self.shared is not None else {}
        return moe_reference.Experts(config, **shared)

    def saved(self, config: MoEConfig, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        slots = batch * seq_len * config.num_experts_per_tok
        routed = TensorSpec("gate_up", (slots, 2 * self.inner(config)))
        shared = self.shared.saved(config, batch, seq_len) if self.shared is not None else ()
        return (routed, *shared)

    def aux_temp(self, config: MoEConfig, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        tokens, k = batch * seq_len, config.num_experts_per_tok
        return (
            TensorSpec("ids", (tokens, k), dtype="int32"),
            TensorSpec("weights", (tokens, k)),
            TensorSpec("order", (tokens * k,), dtype="int32"),
            TensorSpec("offsets", (config.num_experts + 1,), dtype="int32"),
        )

    def forward(
        self, config: MoEConfig, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        """Route ``h`` (the block's ``n2(h_mid)``) once, add the loads into Aux, run the
        routed rows: -> (output like ``h``, saved ``gate_up``, the routing as AuxTemp)."""
        ops = env.ops
        top, ids = self.choose(config, params, h, env)
        order, offsets, loads = dispatch(config, ids)
        if "counts" in env.aux:
            env.aux["counts"].add_(loads.to(env.aux["counts"]))
        aux_temp = {"ids": ids.to(torch.int32), "weights": top.to(h.dtype)}
        aux_temp |= {"order": order, "offsets": offsets}
        gate_up = _gate_up(config, params, h, aux_temp, ops)
        out = self._experts_out(config, params, gate_up, aux_temp, ops)
        if self.shared is None:
            return out.view_as(h), {"gate_up": gate_up}, aux_temp
        shared, saved = self.shared.forward(config, params, h.reshape(out.shape), ops)
        return (out + shared).view_as(h), {"gate_up": gate_up, **saved}, aux_temp

    def choose(
        self, config: MoEConfig, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of the tokens of ``h``: (weights (tokens, k), expert ids (tokens, k));
        the softmax router's top-k (renormalised with ``norm_topk_prob``). A router of
        another kind is a subclass with its own ``choose`` and ``_router_backward``."""
        logits = ROUTER.forward(env.ops, params, h).reshape(-1, config.num_experts)
        probs, (top, ids) = route(config, logits)
        if env.route_ids is not None:  # the choices given (verify's autograd run)
            ids = env.route_ids.long()
            top = probs.gather(1, ids)
        del probs, logits
        if config.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top, ids

    def _expert_rows(self, config, params, gate_up, aux_temp, ops) -> torch.Tensor:
        """Every expert row's output, unweighted (tokens * k, hidden)."""
        act = ops["swiglu_fwd"](*_split(gate_up))
        return ops["grouped_mm"](act, params[DOWN], aux_temp["offsets"])

    def _experts_out(self, config, params, gate_up, aux_temp, ops) -> torch.Tensor:
        rows = self._expert_rows(config, params, gate_up, aux_temp, ops)
        return _combine(rows, _slot_rows(config, aux_temp), aux_temp["weights"])

    def recompute(
        self, config: MoEConfig, params: Tensors, h: torch.Tensor, aux_temp: Tensors, ops: Any
    ) -> Tensors:
        """The experts' ``gate_up`` of every routed row of ``h``, by forward's routing (and
        the shared expert's projections)."""
        saved = {"gate_up": _gate_up(config, params, h, aux_temp, ops)}
        if self.shared is not None:
            saved |= self.shared.recompute(config, params, h.reshape(-1, config.hidden_size), ops)
        return saved

    def backward(
        self,
        config: MoEConfig,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        """-> (dh, the router's and the experts' gradients)."""
        ops, n = env.ops, config.hidden_size
        offsets, gate_up = aux_temp["offsets"], saved["gate_up"]
        tokens, weights = _rows(config, aux_temp)
        flat_h2, flat_dy = h.reshape(-1, n), dy.reshape(-1, n)
        # experts: y = h_mid + sum over rows of weight * down(swiglu(gate_up))
        gate, up = _split(gate_up)
        act = ops["swiglu_fwd"](gate, up)
        rows_dy = flat_dy[tokens]
        # dy through the down projection, unweighted: a row's routing weight's gradient is
        # <down(act), dy> = <act, dy @ down>, so the rows' outputs need not be made again
        d_act = ops["grouped_mm"](rows_dy, params[DOWN].transpose(1, 2), offsets)
        d_row_weights = (act * d_act).sum(-1)
        row_weights = weights.unsqueeze(-1)
        d_act.mul_(row_weights)
        act.mul_(row_weights)  # sum over rows of weight * dy^T act: the down weights' gradient
        grads = {DOWN: ops["grouped_mm_wgrad"](rows_dy, act, offsets)}
        del rows_dy, act
        d_gate_up = torch.cat(ops["swiglu_bwd"](d_act, gate, up), dim=-1)
        del d_act
        grads[GATE_UP] = ops["grouped_mm_wgrad"](d_gate_up, flat_h2[tokens], offsets)
        d_in = ops["grouped_mm"](d_gate_up, params[GATE_UP].transpose(1, 2), offsets)
        del d_gate_up
        slot_rows = _slot_rows(config, aux_temp)
        d_h2 = _combine(d_in, slot_rows)
        del d_in
        # the router: weights = top (or top / sum(top)), top = probs[ids]
        d_weights = d_row_weights[slot_rows.reshape(-1)]
        sequences = h.shape[0] if h.dim() == 3 else 1
        d_logits = self._router_backward(
            config, params, flat_h2, aux_temp, d_weights, env, sequences
        )
        d_router_in, g = ROUTER.backward(ops, params, flat_h2, d_logits)
        grads.update(g)
        d_h2 += d_router_in
        if self.shared is not None:
            d_shared, g = self.shared.backward(config, params, flat_h2, saved, flat_dy, ops)
            grads.update(g)
            d_h2 += d_shared
        del flat_h2
        return d_h2.view_as(h), grads

    def _router_backward(
        self, config, params, flat_h2, aux_temp, d_weights, env, sequences
    ) -> torch.Tensor:
        """d(router logits) (tokens, E) in the activations' dtype: the routing weights'
        gradient, plus the balance term (last round) and the z-loss. ``sequences``: how
        many sequences the tokens are (a per-sequence term's)."""
        k, e = config.num_experts_per_tok, config.num_experts
        logits = ROUTER.forward(env.ops, params, flat_h2)
        probs, _ = route(config, logits)
        ids = aux_temp["ids"].long()
        top = probs.gather(1, ids)
        d_top = d_weights.reshape(-1, k).to(probs.dtype)
        if config.norm_topk_prob:
            total = top.sum(-1, keepdim=True)
            d_top = (d_top - (d_top * top).sum(-1, keepdim=True) / total) / total
        d_probs = torch.zeros_like(probs).scatter_add_(1, ids, d_top)
        layers, tokens = config.num_hidden_layers, probs.shape[0]
        # a step's backward sees its Aux in the last round, never in the earlier ones; the
        # block alone (one round, no Aux) has no loss terms of its own
        in_step = "counts" in env.aux or not env.last_round
        if config.router_aux_loss_coef and env.last_round and in_step:
            counts = env.aux["counts"].to(probs.dtype)  # every layer's, every round's
            per_token = counts / (counts.sum() / k).clamp(min=1)  # f_e: sums to k
            d_probs += config.router_aux_loss_coef * e * per_token / (layers * tokens)
        d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        if config.router_z_loss_coef and in_step:
            lse = torch.logsumexp(logits.to(probs.dtype), -1, keepdim=True)
            scale = config.router_z_loss_coef / (env.rounds * layers * tokens)  # round mean
            d_logits += 2 * scale * lse * probs
        return d_logits.to(flat_h2.dtype)

    # -- the experts apart: a routing task, one task per shard (``block.Block``) -------

    def apart_saved(
        self, config: MoEConfig, batch: int, seq_len: int
    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """With the experts routed apart: (what the routing task saves beside the
        attention half's: the shared expert's; the experts' object ``moe_in``, their
        input, written by the routing task, and ``gate_up``, whose rows each shard's
        forward writes; the experts' gradient to the block, ``d_moe_in`` (tokens, hidden)
        float32 summed over the shards and ``d_weights``, each expert row's routing
        weight's gradient, float32)."""
        tokens, slots = batch * seq_len, batch * seq_len * config.num_experts_per_tok
        shared = self.shared.saved(config, batch, seq_len) if self.shared is not None else ()
        experts = (
            TensorSpec("moe_in", (tokens, config.hidden_size)),
            TensorSpec("gate_up", (slots, 2 * self.inner(config))),
        )
        grad = (
            TensorSpec("d_moe_in", (tokens, config.hidden_size), dtype="float32"),
            TensorSpec("d_weights", (slots,), dtype="float32"),
        )
        return shared, experts, grad

    def route_forward(
        self, config: MoEConfig, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor | None, Tensors, Tensors]:
        """``forward`` without the routed experts: route ``h`` once, add the loads into
        Aux, run the shared expert: -> (its output (tokens, hidden) or None, what it saves,
        the routing as AuxTemp)."""
        top, ids = self.choose(config, params, h, env)
        order, offsets, loads = dispatch(config, ids)
        if "counts" in env.aux:
            env.aux["counts"].add_(loads.to(env.aux["counts"]))
        aux_temp = {"ids": ids.to(torch.int32), "weights": top.to(h.dtype)}
        aux_temp |= {"order": order, "offsets": offsets}
        if self.shared is None:
            return None, {}, aux_temp
        flat = h.reshape(-1, config.hidden_size)
        shared, saved = self.shared.forward(config, params, flat, env.ops)
        return shared, saved, aux_temp

    def route_recompute(
        self, config: MoEConfig, params: Tensors, h: torch.Tensor, aux_temp: Tensors, ops: Any
    ) -> Tensors:
        """What ``route_forward`` saves, again (the shared expert's projections; the
        routing is ``aux_temp``'s, made by forward; the block makes ``moe_in``)."""
        if self.shared is None:
            return {}
        return self.shared.recompute(config, params, h.reshape(-1, config.hidden_size), ops)

    def _shard_window(
        self, config: MoEConfig, aux_temp: Tensors, shard: tuple[int, int]
    ) -> tuple[ShardWindow, torch.Tensor]:
        """(``shard``'s ``ShardWindow`` over every expert row, its experts' offsets from its
        first row (per + 1,) int32). Made on the device alone: how many rows a shard gets is
        the tokens' choice, and reading it on the host would keep the step out of a CUDA
        graph (its tasks would run dispatched, a device-to-host wait each)."""
        index, count = shard
        per = config.num_experts // count
        bounds = aux_temp["offsets"][index * per : (index + 1) * per + 1]
        span = torch.arange(aux_temp["order"].numel(), device=bounds.device)
        first, rows = bounds[0].long(), span.numel()
        window = ShardWindow((span + first).remainder_(max(rows, 1)), span < bounds[-1] - first)
        return window, (bounds - bounds[0]).to(torch.int32)

    def experts_forward(
        self,
        config: MoEConfig,
        params: Tensors,
        moe_in: torch.Tensor,
        aux_temp: Tensors,
        shard: tuple[int, int],
        ops: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, ShardWindow]:
        """The rows routed to ``shard``'s experts (``params`` holds only theirs) ->
        (their weighted outputs summed per token (tokens, hidden) float32, ``gate_up`` of
        the window's rows (the shard's first; past them not computed), the window). The
        shapes are the same whatever the routing: a window of every row, the grouped GEMMs
        computing the shard's alone (``ShardWindow``)."""
        window, offsets = self._shard_window(config, aux_temp, shard)
        tokens, weights = (t[window.rows] for t in _rows(config, aux_temp))
        gate_up = ops["grouped_mm"](window.gather(ops, moe_in, tokens), params[GATE_UP], offsets)
        act = ops["swiglu_fwd"](*_split(gate_up))
        rows = ops["grouped_mm"](act, params[DOWN], offsets)
        del act
        out = window.add(ops, rows, tokens, weights, moe_in.shape[0], shard[1])
        return out, gate_up, window

    def experts_backward(
        self,
        config: MoEConfig,
        params: Tensors,
        moe_in: torch.Tensor,
        gate_up: torch.Tensor | None,
        aux_temp: Tensors,
        dy: torch.Tensor,
        shard: tuple[int, int],
        ops: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, ShardWindow, Tensors]:
        """``backward``'s expert part for the rows routed to ``shard`` (``gate_up``: every
        row's as forward wrote them, or None where the block is re-derived: the shard's
        rows are made again here from ``moe_in``; ``dy`` (tokens, hidden)) -> (their
        gradient to ``moe_in`` (tokens, hidden) float32, their routing weights' gradients
        in the window's order (float32; past the shard's rows meaningless), the window,
        the shard's experts' gradients)."""
        window, offsets = self._shard_window(config, aux_temp, shard)
        tokens, weights = (t[window.rows] for t in _rows(config, aux_temp))
        rows_in = window.gather(ops, moe_in, tokens)
        if gate_up is None:
            gate_up = ops["grouped_mm"](rows_in, params[GATE_UP], offsets)
        else:
            gate_up = window.gather(ops, gate_up, window.rows)
        rows_dy = window.gather(ops, dy, tokens)
        d_act = ops["grouped_mm"](rows_dy, params[DOWN].transpose(1, 2), offsets)
        # the SwiGLU again, the routing weights' gradients, the gate and up gradients
        act, d_gate_up, d_row_weights = ops["swiglu_rows_bwd"](
            gate_up, d_act, weights, window.valid
        )
        del d_act, gate_up
        grads = {DOWN: ops["grouped_mm_wgrad"](rows_dy, act, offsets)}
        del rows_dy, act
        grads[GATE_UP] = ops["grouped_mm_wgrad"](d_gate_up, rows_in, offsets)
        del rows_in
        d_in = ops["grouped_mm"](d_gate_up, params[GATE_UP].transpose(1, 2), offsets)
        del d_gate_up
        d_moe_in = window.add(ops, d_in, tokens, None, moe_in.shape[0], shard[1])
        return d_moe_in, d_row_weights.float(), window, grads

    def route_backward(
        self,
        config: MoEConfig,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        d_experts: Tensors,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        """``backward`` given the shards' part (``d_experts``: ``d_moe_in`` and
        ``d_weights``): the router's and the shared expert's -> (dh, their gradients)."""
        ops, n = env.ops, config.hidden_size
        flat_h2, flat_dy = h.reshape(-1, n), dy.reshape(-1, n)
        d_h2 = d_experts["d_moe_in"].to(h.dtype)
        slot_rows = _slot_rows(config, aux_temp)
        d_weights = d_experts["d_weights"][slot_rows.reshape(-1)]
        sequences = h.shape[0] if h.dim() == 3 else 1
        d_logits = self._router_backward(
            config, params, flat_h2, aux_temp, d_weights, env, sequences
        )
        d_router_in, grads = ROUTER.backward(ops, params, flat_h2, d_logits)
        d_h2 += d_router_in
        if self.shared is not None:
            d_shared, g = self.shared.backward(config, params, flat_h2, saved, flat_dy, ops)
            grads.update(g)
            d_h2 += d_shared
        return d_h2.view_as(h), grads

    def experts_work(
        self, config: MoEConfig, batch: int, seq_len: int, act_bytes: int, shards: int
    ) -> LayerCost:
        """One shard's forward and backward work: its share of the routed rows' three
        projections (backward twice them), and what its window (``ShardWindow``: every
        row of the layer, whatever its share) moves: the rows gathered, the activation
        over them, their outputs in float32 added into their tokens; ``recompute``: what
        its backward adds where the block is re-derived (its rows' ``gate_up`` made again:
        the gate and up projections)."""
        tokens, n, inner = batch * seq_len, config.hidden_size, self.inner(config)
        k = config.num_experts_per_tok
        flops = 2 * tokens * k * 3 * n * inner / shards
        rows = tokens * k
        moved = rows * (act_bytes * (3 * n + 3 * inner) + 16 * n) + tokens * n * 4
        again = Work(2 * flops / 3, rows * act_bytes * (n + 2 * inner))
        return LayerCost(Work(flops, moved), Work(2 * flops, 2 * moved), recompute=again)

    def cost(self, config: MoEConfig, batch: int, seq_len: int, act_bytes: int) -> FfnCost:
        tokens, n, inner = batch * seq_len, config.hidden_size, self.inner(config)
        k, e = config.num_experts_per_tok, config.num_experts
        experts = 2 * tokens * k * 3 * n * inner
        router = 2 * tokens * n * e
        if self.shared is not None:  # one more expert for every token, and its gate
            shared = self.shared.matmul_flops(config, tokens)
            width = getattr(config, self.shared.width)
            return FfnCost(
                matmul=router + experts + shared,
                rederive=Work(
                    2 * experts / 3 + 2 * tokens * 2 * n * width,
                    tokens * act_bytes * (2 * n + k * n + 2 * k * inner + 2 * width),
                ),
                not_recomputed=experts / 3 + 2 * tokens * n * (width + 1),
                moved=2 * k * n,
                backward=router + 2 * tokens * n * (width + 1),
            )
        return FfnCost(
            matmul=router + experts,
            # rederive: n2 of h_mid, then every routed row's gate and up projections
            rederive=Work(2 * experts / 3, tokens * act_bytes * (2 * n + k * n + 2 * k * inner)),
            # recompute stops at the routed rows' gate and up: no expert down
            # projections, no combine, no output
            not_recomputed=experts / 3,
            # the routed rows gathered and combined back per token
            moved=2 * k * n,
            # backward: the router's logits made again
            backward=router,
        )


@attrs.frozen(slots=False)
class MoEFields:
    """The routed experts' config fields, for a config class to take beside its decoder
    config base, before it (``class Config(MoEFields, LinearAttentionConfig)``: two
    slotted attrs bases cannot be combined, and this one has no slots); ``MoEConfig`` is
    ``DecoderConfig`` with them."""

    num_experts: int = attrs.field(default=64, kw_only=True, validator=_positive)
    num_experts_per_tok: int = attrs.field(default=8, kw_only=True, validator=_positive)
    norm_topk_prob: bool = attrs.field(default=False, kw_only=True, validator=flag)
    router_aux_loss_coef: float = attrs.field(default=0.01, kw_only=True, validator=_coefficient)
    router_z_loss_coef: float = attrs.field(default=0.0, kw_only=True, validator=_coefficient)
    #: the shards a layer's experts are stored and run in (0: from their sizes,
    #: ``expert_shards``); a training setting HF's config does not carry
    expert_shards: int = attrs.field(default=0, kw_only=True, validator=_shard_count)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # the decoder config's, after this class in the MRO
        if self.num_experts_per_tok > self.num_experts:
            name = type(self).__name__
            raise ValueError(
                f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                f"{name}.num_experts ({self.num_experts})"
            )


@attrs.frozen
class MoEConfig(MoEFields, DecoderConfig):
    """A decoder whose every FFN is ``num_experts`` SwiGLU experts of width
    ``intermediate_size``, ``num_experts_per_tok`` of them per token."""

    #: attention with per-head q/k norms (Qwen 3 MoE), every layer the routed experts
    architecture: ClassVar[Decoder] = Decoder(
        {"moe": Block(SelfAttention(qk_norm=QKNorm("head")), RoutedExperts())}
    )


def moe_expected_state(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """State key -> shape of every parameter, in chain order (``decoder.expected_state``)."""
    return expected_state(config)


def moe_parameter_count(config: MoEConfig) -> int:
    """``decoder.parameter_count``: every parameter, a tied output projection once."""
    return parameter_count(config)


def moe_active_parameter_count(config: MoEConfig) -> int:
    """Parameters one token uses: all but the experts it is not routed to."""
    n, inner = config.hidden_size, config.intermediate_size
    idle = config.num_experts - config.num_experts_per_tok
    return moe_parameter_count(config) - config.num_hidden_layers * idle * 3 * n * inner
