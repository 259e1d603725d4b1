"""DeepSeek V3's mixture of experts, as an FFN part: sigmoid scores, a selection bias moved
by a load rule instead of a gradient, group-limited top-k, routed scaling, shared experts
every token goes through, and the sequence-wise balance loss (DeepSeek-V3 Technical
Report, arXiv:2412.19437, sections 2.1.2 and 4.2; transformers' ``DeepseekV3MoE``)::

    s      = sigmoid(u @ gate.T)                                      (float32, tokens x E)
    groups = the topk_group of n_group expert groups whose two best (s + bias) sum highest
    ids    = the k experts of highest s + bias within those groups    (bias: selection only)
    w      = routed_scaling_factor * s[ids] (/ sum(s[ids]) with norm_topk_prob)
    y      = h + sum_j w_j * expert_{ids_j}(u) + shared_experts(u)

The router is its own part (``GroupLimitedRouter``: its parameters, its choice, its
backward, its Aux and its rule), and ``SigmoidExperts`` is the kit's ``RoutedExperts``
with that router and ungated shared experts, so a family of the same MoE under another
attention (DeepSeek V3.2, GLM 5) takes the part as it is.

**Selection bias** ``mlp.gate.e_score_correction_bias`` (E,) float32, in the layer's main
group, ``trainable=False`` with ``rule="expert_load_sign"``: no gradient and no optimizer
state; the group's optimizer task reads the layer's Aux and moves it by the paper's
auxiliary-loss-free rule ``bias += gamma * sign(mean(load) - load)`` (``gamma`` the
config's ``bias_update_speed``, default 0.001, the paper's for its first 14.3T tokens;
0 turns the rule off).

**Aux** ``counts`` (E,) float32, each MoE layer's own (``Aux_<layer>``): the tokens routed
to each expert by that layer, over every round of the step (zeroed by the step's first
forward, added to by every round's forward, read by the layer's optimizer task).

**AuxTemp** as ``RoutedExperts``: ``ids``, ``weights`` (routed scaling included), ``order``,
``offsets``.

**Sequence-wise balance loss** (``seq_aux_loss_coef``, alpha, default 0.0001, the paper's),
per MoE layer and sequence of ``T`` tokens: ``alpha * sum_i f_i * P_i`` with ``f_i = E / (k
T) * (slots routed to i)`` (no gradient) and ``P_i`` the mean over the sequence of
``s_i / sum_j s_j``. The step's objective adds, per round, its mean over the round's
sequences summed over the MoE layers (and averaged over rounds as the cross-entropy is).
It needs only the round's own routing, so each backward applies it from AuxTemp; a block
task that does not see its Aux (``dataflow verify``'s task level) differentiates the
block's output alone, as ``RoutedExperts`` does. transformers' model has no such term (it
trains nothing of the router's balance); the HF tests add it to its objective, written
out from its router's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch

from dataflow_training.kit.decoder import _positive, flag
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.mlp import SwiGLU
from dataflow_training.kit.moe import ROUTER, RoutedExperts, _coefficient, _shard_count
from dataflow_training.kit.parts import FfnCost
from dataflow_training.step.family import Env, TensorSpec, Work

Tensors = dict[str, torch.Tensor]

BIAS = "mlp.gate.e_score_correction_bias"
#: the update rule of the selection bias (``TensorSpec.rule``)
LOAD_SIGN_RULE = "expert_load_sign"


def _positive_number(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive number, got {value!r}"
        )


@attrs.frozen(slots=False)
class SigmoidMoEFields:
    """The config fields of DeepSeek V3's experts (HF's names where HF has them; the
    expert count is ``num_experts``, HF's ``n_routed_experts``), for a config class to
    take before its decoder config base. ``seq_aux_loss_coef`` and ``bias_update_speed``
    are training settings HF's config does not carry (module docstring)."""

    num_experts: int = attrs.field(default=256, kw_only=True, validator=_positive)
    num_experts_per_tok: int = attrs.field(default=8, kw_only=True, validator=_positive)
    moe_intermediate_size: int = attrs.field(default=2048, kw_only=True, validator=_positive)
    n_shared_experts: int = attrs.field(default=1, kw_only=True, validator=_positive)
    n_group: int = attrs.field(default=8, kw_only=True, validator=_positive)
    topk_group: int = attrs.field(default=4, kw_only=True, validator=_positive)
    norm_topk_prob: bool = attrs.field(default=True, kw_only=True, validator=flag)
    routed_scaling_factor: float = attrs.field(
        default=2.5, kw_only=True, validator=_positive_number
    )
    seq_aux_loss_coef: float = attrs.field(default=0.0001, kw_only=True, validator=_coefficient)
    bias_update_speed: float = attrs.field(default=0.001, kw_only=True, validator=_coefficient)
    #: the shards a layer's experts are stored and run in (0: from their sizes,
    #: ``kit.moe.expert_shards``); a training setting HF's config does not carry
    expert_shards: int = attrs.field(default=0, kw_only=True, validator=_shard_count)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # the decoder config's, after this class in the MRO
        name, e = type(self).__name__, self.num_experts
        if e % self.n_group or e // self.n_group < 2:
            raise ValueError(
                f"{name}.n_group ({self.n_group}) must divide {name}.num_experts ({e}) into "
                "groups of at least 2 experts (a group is scored by its two best)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"{name}.topk_group ({self.topk_group}) must be at most {name}.n_group "
                f"({self.n_group})"
            )
        if self.num_experts_per_tok > self.topk_group * (e // self.n_group):
            raise ValueError(
                f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) must be at most the "
                f"experts of {name}.topk_group groups ({self.topk_group * (e // self.n_group)})"
            )

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts' width, as one SwiGLU: ``moe_intermediate_size *
        n_shared_experts``."""
        return self.moe_intermediate_size * self.n_shared_experts


# -- the router --------------------------------------------------------------------------


def _scores(params: Tensors, h: torch.Tensor, ops: Any, experts: int) -> torch.Tensor:
    """sigmoid of the router logits (tokens, E), in float32 at least."""
    logits = ROUTER.forward(ops, params, h).reshape(-1, experts)
    return torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))


@dataclasses.dataclass(frozen=True)
class GroupLimitedRouter:
    """DeepSeek V3's router, as a part of ``SigmoidExperts`` (module docstring). Parameters
    ``mlp.gate.weight`` (E, hidden) and the selection bias; Aux ``counts`` per layer."""

    aux_scope = "layer"
    aux_key = ""

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        e = config.num_experts
        return (
            TensorSpec(ROUTER.weight, (e, config.hidden_size)),
            TensorSpec(
                BIAS, (e,), dtype="float32", decay=False, trainable=False, rule=LOAD_SIGN_RULE
            ),
        )

    def aux(self, config: Any) -> tuple[TensorSpec, ...]:
        return (TensorSpec("counts", (config.num_experts,), dtype="float32"),)

    def choose(
        self, config: Any, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (tokens, k), expert ids (tokens, k)) of the tokens of ``h``."""
        e, groups = config.num_experts, config.n_group
        scores = _scores(params, h, env.ops, e)
        biased = scores + params[BIAS].to(scores.dtype)
        tokens = biased.shape[0]
        best = biased.view(tokens, groups, e // groups).topk(2, dim=-1).values.sum(-1)
        chosen = best.topk(config.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.unsqueeze(-1).expand(tokens, groups, e // groups).reshape(tokens, e)
        ids = (
            biased.masked_fill(~keep, float("-inf"))
            .topk(config.num_experts_per_tok, dim=-1, sorted=False)
            .indices
        )
        if env.route_ids is not None:  # the choices given (verify's autograd run)
            ids = env.route_ids.long()
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, ids

    def backward(
        self,
        config: Any,
        params: Tensors,
        flat_h: torch.Tensor,
        aux_temp: Tensors,
        d_weights: torch.Tensor,
        env: Env,
        sequences: int,
    ) -> torch.Tensor:
        """d(router logits) (tokens, E) in the activations' dtype: the routing weights'
        gradient, plus the sequence-wise balance loss's where the step sees it."""
        k, e = config.num_experts_per_tok, config.num_experts
        scores = _scores(params, flat_h, env.ops, e)
        ids = aux_temp["ids"].long()
        top = scores.gather(1, ids)
        d_top = d_weights.reshape(-1, k).to(scores.dtype) * config.routed_scaling_factor
        if config.norm_topk_prob:
            total = top.sum(-1, keepdim=True) + 1e-20
            d_top = (d_top - (d_top * top).sum(-1, keepdim=True) / total) / total
        d_scores = torch.zeros_like(scores).scatter_add_(1, ids, d_top)
        in_step = "counts" in env.aux or not env.last_round  # as RoutedExperts' terms
        if config.seq_aux_loss_coef and in_step:
            d_scores += self._balance_backward(config, scores, ids, sequences, env.rounds)
        return (d_scores * scores * (1 - scores)).to(flat_h.dtype)

    def _balance_backward(
        self, config: Any, scores: torch.Tensor, ids: torch.Tensor, sequences: int, rounds: int
    ) -> torch.Tensor:
        """d(alpha * mean over sequences of sum_i f_i P_i) / d scores, over ``rounds``."""
        k, e = config.num_experts_per_tok, config.num_experts
        tokens = scores.shape[0]
        seq = tokens // sequences
        slots = torch.zeros(sequences, e, dtype=scores.dtype, device=scores.device)
        slots.scatter_add_(
            1,
            ids.view(sequences, seq * k),
            torch.ones_like(ids, dtype=scores.dtype).view(sequences, seq * k),
        )
        f = slots * (e / (k * seq))  # (sequences, E)
        d_share = config.seq_aux_loss_coef * f / (seq * sequences * rounds)
        d_share = d_share.repeat_interleave(seq, dim=0)  # (tokens, E): d/d(s_i / sum s)
        total = scores.sum(-1, keepdim=True)
        share = scores / total
        return (d_share - (d_share * share).sum(-1, keepdim=True)) / total

    def apply_rule(self, config: Any, bias: torch.Tensor, counts: torch.Tensor) -> None:
        """``bias += gamma * sign(mean(counts) - counts)``, in place."""
        if config.bias_update_speed:
            step = torch.sign(counts.mean() - counts) * config.bias_update_speed
            bias.add_(step.to(bias.dtype))

    def flops(self, config: Any, tokens: int) -> int:
        return 2 * tokens * config.hidden_size * config.num_experts


# -- the shared experts ------------------------------------------------------------------

SHARED = SwiGLU(
    Linear("mlp.shared_experts.gate_proj.weight"),
    Linear("mlp.shared_experts.up_proj.weight"),
    Linear("mlp.shared_experts.down_proj.weight"),
)


@dataclasses.dataclass(frozen=True)
class SharedExperts:
    """DeepSeek's shared experts, one SwiGLU of ``shared_intermediate_size`` every token goes
    through, ungated (HF's ``mlp.shared_experts.{gate,up,down}_proj.weight``), as a part
    of ``SigmoidExperts``; saved ``shared_gate`` and ``shared_up``."""

    width: str = "shared_intermediate_size"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, inner = config.hidden_size, getattr(config, self.width)
        return (
            TensorSpec(SHARED.gate.weight, (inner, n)),
            TensorSpec(SHARED.up.weight, (inner, n)),
            TensorSpec(SHARED.down.weight, (n, inner)),
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        inner = getattr(config, self.width)
        return (
            TensorSpec("shared_gate", (batch * seq_len, inner)),
            TensorSpec("shared_up", (batch * seq_len, inner)),
        )

    def recompute(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        return {
            "shared_gate": SHARED.gate.forward(ops, params, h),
            "shared_up": SHARED.up.forward(ops, params, h),
        }

    def forward(
        self, config: Any, params: Tensors, h: torch.Tensor, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        saved = self.recompute(config, params, h, ops)
        act = ops["swiglu_fwd"](saved["shared_gate"], saved["shared_up"])
        return SHARED.down.forward(ops, params, act), saved

    def backward(
        self, config: Any, params: Tensors, h: torch.Tensor, saved: Tensors, dy, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        return SHARED.backward(ops, params, h, saved["shared_gate"], saved["shared_up"], dy)

    def matmul_flops(self, config: Any, tokens: int) -> int:
        return 2 * tokens * 3 * config.hidden_size * getattr(config, self.width)


# -- the FFN part ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SigmoidExperts(RoutedExperts):
    """``RoutedExperts`` of width ``moe_intermediate_size`` behind a ``GroupLimitedRouter``,
    with ``SharedExperts`` (module docstring). Main group: the router's weight and bias and
    the shared experts; group ``experts``: the routed ones; Aux ``counts`` per layer."""

    shared: Any = SharedExperts()
    width: str = "moe_intermediate_size"
    router: GroupLimitedRouter = GroupLimitedRouter()

    @property
    def aux_scope(self) -> str:  # type: ignore[override]
        return self.router.aux_scope

    @property
    def aux_key(self) -> str:  # type: ignore[override]
        return self.router.aux_key

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        return (*self.router.params(config), *self.shared.params(config))

    def aux(self, config: Any) -> tuple[TensorSpec, ...]:
        return self.router.aux(config)

    def reference(self, config: Any) -> Any:
        # the reference module imports only torch; loaded with the part's reference
        from dataflow_training.kit.sigmoid_moe_reference import SigmoidExperts as Reference

        return Reference(config)

    def choose(
        self, config: Any, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router.choose(config, params, h, env)

    def _router_backward(self, config, params, flat_h2, aux_temp, d_weights, env, sequences):
        return self.router.backward(config, params, flat_h2, aux_temp, d_weights, env, sequences)

    def apply_rules(self, config: Any, params: Tensors, aux: Tensors, env: Env) -> None:
        """The selection bias moved by the layer's loads over the step (``Aux``)."""
        self.router.apply_rule(config, params[BIAS], aux["counts"])

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> FfnCost:
        tokens, n, inner = batch * seq_len, config.hidden_size, self.inner(config)
        k = config.num_experts_per_tok
        experts = 2 * tokens * k * 3 * n * inner
        router = self.router.flops(config, tokens)
        shared = self.shared.matmul_flops(config, tokens)
        width = getattr(config, self.shared.width)
        return FfnCost(
            matmul=router + experts + shared,
            # rederive: n2 of h_mid, the routed rows' and the shared experts' gate and up
            rederive=Work(
                2 * experts / 3 + 2 * shared / 3,
                tokens * act_bytes * (2 * n + k * n + 2 * k * inner + 2 * width),
            ),
            # recompute stops at the gate and up projections: no down projections, no combine
            not_recomputed=experts / 3 + shared / 3,
            moved=2 * k * n,
            backward=router,
        )


__all__ = [
    "BIAS",
    "LOAD_SIGN_RULE",
    "GroupLimitedRouter",
    "SharedExperts",
    "SigmoidExperts",
    "SigmoidMoEFields",
]
