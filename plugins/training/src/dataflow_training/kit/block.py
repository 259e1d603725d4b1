"""A pre-norm residual block composed of parts (``parts.py`` says what a part declares)::

    h_mid = x + attention(norm(x))          input_layernorm, then the attention part
    y     = h_mid + ffn(norm(h_mid))        post_attention_layernorm, then the FFN part

``Block(attention, ffn, norm, norm_names)`` is a whole ``BlockMath`` (protocol v2) and
the layer's declaration: its parameters (the norms', the attention's, the FFN's, in HF's
order; the FFN's own groups after the main one), its HF key rules, its reference module,
and its ``LayerCost`` summed from the parts' costs.

What it saves for backward (the contents of ``A_<layer>``): the attention's tensors, then
``h_mid`` (hidden), the residual stream between the halves, then the FFN's tensors. With
them backward runs no projection and no attention forward again: it rebuilds only
elementwise work (the two norms from ``x`` and ``h_mid``, the attention's q/k norms and
rotations) and calls the fused backward kernels; every projection's gradients are
``linear`` calls. ``forward`` and ``recompute`` share the attention half and the FFN's
``recompute`` (the FFN's ``forward`` is its ``recompute`` plus its output), so they
cannot drift apart.

The block offers one partial save, ``mlp``: forward keeps the attention half's tensors
and ``h_mid``; ``rederive`` makes the FFN's saved tensors again from ``h_mid`` (the second
norm and the FFN's ``recompute``, with forward's AuxTemp: no attention), freeing what is
usually most of what a block saves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dataflow_training.kit import decoder_reference
from dataflow_training.kit.attention import SelfAttention
from dataflow_training.kit.decoder_math import check_seq_len
from dataflow_training.kit.mlp import SwiGLUFFN
from dataflow_training.kit.norms import Norm
from dataflow_training.kit.parts import as_is, ops_of, values_per_token
from dataflow_training.step.family import (
    Env,
    LayerCost,
    LayerSpec,
    ParamGroup,
    PartialSave,
    TensorSpec,
    Work,
)

Tensors = dict[str, torch.Tensor]

#: the two norms' names (HF's Llama names)
NORM_1, NORM_2 = "input_layernorm", "post_attention_layernorm"


@dataclasses.dataclass(frozen=True)
class Block:
    """Pre-norm block of an ``attention`` part, an ``ffn`` part and a ``norm`` kind (see
    the module docstring), its two norms named ``norm_names`` (HF's names: GPT-2's are
    ``ln_1`` and ``ln_2``); the default is Llama's: RMSNorm, causal grouped-query
    attention with RoPE, the dense SwiGLU."""

    attention: Any = SelfAttention()
    ffn: Any = SwiGLUFFN()
    norm: Norm = Norm()
    norm_names: tuple[str, str] = (NORM_1, NORM_2)

    @property
    def ops(self) -> tuple[str, ...]:
        """Every op the block's math calls."""
        return ("linear", *ops_of(self.norm, self.attention, self.ffn))

    def _norms(self, config: Any) -> tuple[Any, Any]:
        first, second = self.norm_names
        return self.norm.op(config, first), self.norm.op(config, second)

    # -- the layer -----------------------------------------------------------------------
    def layer(self, config: Any, name: str, kind: str) -> LayerSpec:
        """Layer ``name`` of kind ``kind``: the main group (norms, attention, the FFN's
        main parameters), the FFN's own groups and its Aux."""
        n, (first, second) = config.hidden_size, self.norm_names
        main = (
            *self.norm.params(first, n),
            *self.attention.params(config),
            *self.norm.params(second, n),
            *self.ffn.params(config),
        )
        return LayerSpec(
            name,
            kind,
            (ParamGroup("", main), *self.ffn.groups(config)),
            aux=self.ffn.aux(config),
            aux_scope=self.ffn.aux_scope,
            aux_key=self.ffn.aux_key if self.ffn.aux_scope == "model" else "",
        )

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        """The HF key rules of the layer's parameters under ``prefix``."""
        n, (first, second) = config.hidden_size, self.norm_names
        return [
            *as_is(self.norm.params(first, n), prefix),
            *self.attention.hf_rules(config, prefix),
            *as_is(self.norm.params(second, n), prefix),
            *self.ffn.hf_rules(config, prefix),
        ]

    def reference(self, config: Any) -> Any:
        """The plain-torch block (``decoder_reference.Block``) of the parts' references,
        each under its name (the norms', the attention's and the FFN's ``module``)."""
        n, (first, second) = config.hidden_size, self.norm_names
        return decoder_reference.Block(
            self.norm.reference(config, n),
            self.attention.reference(config),
            self.norm.reference(config, n),
            self.ffn.reference(config),
            (first, self.attention.module, second, self.ffn.module),
        )

    # -- BlockMath -----------------------------------------------------------------------
    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return (
            *self.attention.saved(config, batch, seq_len),
            TensorSpec("h_mid", (batch, seq_len, config.hidden_size)),
            *self.ffn.saved(config, batch, seq_len),
        )

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return self.ffn.aux_temp(config, batch, seq_len)

    def refuses_segments(self, config: Any) -> str | None:
        """The part that takes no segments (``TrainConfig.segments``): the attention
        where it is not ``SelfAttention``, else None (the lowering refuses a segmented
        step of a kind that names one)."""
        if isinstance(self.attention, SelfAttention):
            return None
        return f"attention {type(self.attention).__name__}"

    def _segments(self, env: Env) -> dict[str, Any]:
        """The attention's ``segments`` keyword where the step has them (``Env.segments``);
        an attention part other than ``SelfAttention`` takes none."""
        if env.segments is None:
            return {}
        if not isinstance(self.attention, SelfAttention):
            raise ValueError(
                f"{type(self.attention).__name__} does not take segments (padded or packed "
                "batches): only SelfAttention does"
            )
        return {"segments": env.segments}

    def _attention_half(
        self, config: Any, params: Tensors, x: torch.Tensor, env: Env
    ) -> tuple[Tensors, torch.Tensor]:
        """``h_mid = x + attention(n1(x))``: (what it saves, ``h_mid`` included, and
        ``n2(h_mid)``, the FFN's input)."""
        check_seq_len(config, x.shape[1])
        ops = env.ops
        norm_1, norm_2 = self._norms(config)
        h1, _ = norm_1.forward(ops, params, x)
        projected = self.attention.project(config, params, h1, ops)
        del h1
        out, attended = self.attention.attend(config, params, projected, ops, **self._segments(env))
        h_mid = x + out
        del out
        h2, _ = norm_2.forward(ops, params, h_mid)
        return {**projected, **attended, "h_mid": h_mid}, h2

    def forward(
        self, config: Any, params: Tensors, x: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        saved, h2 = self._attention_half(config, params, x, env)
        out, ffn_saved, aux_temp = self.ffn.forward(config, params, h2, env)
        del h2
        return saved["h_mid"] + out, saved | ffn_saved, aux_temp

    def recompute(
        self, config: Any, params: Tensors, x: torch.Tensor, aux_temp: Tensors, env: Env
    ) -> Tensors:
        saved, h2 = self._attention_half(config, params, x, env)
        return saved | self.ffn.recompute(config, params, h2, aux_temp, env.ops)

    def partial_saves(self, config: Any) -> tuple[PartialSave, ...]:
        kept = (*(s.name for s in self.attention.saved(config, 1, 1)), "h_mid")
        return (PartialSave("mlp", kept),)

    def rederive(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        kept: Tensors,
        aux_temp: Tensors,
        env: Env,
        partial: str,
    ) -> Tensors:
        if partial != "mlp":
            raise KeyError(f"the block has no partial save {partial!r}; it has: mlp")
        h2, _ = self._norms(config)[1].forward(env.ops, params, kept["h_mid"])
        return self.ffn.recompute(config, params, h2, aux_temp, env.ops)

    def apply_rules(self, config: Any, params: Tensors, aux: Tensors, env: Env) -> None:
        """Move the tensors a rule updates (``TensorSpec.rule``: the FFN's, DeepSeek's
        selection bias) from the layer's Aux; the layer's optimizer task calls it."""
        self.ffn.apply_rules(config, params, aux, env)

    def backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        ops = env.ops
        # the FFN: y = h_mid + ffn(n2(h_mid))
        h2, stats_2 = self._norms(config)[1].forward(ops, params, saved["h_mid"])
        d_h2, grads = self.ffn.backward(config, params, h2, saved, aux_temp, dy, env)
        del h2
        return self._attention_backward(config, params, x, saved, stats_2, d_h2, grads, dy, env)

    def _attention_backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        stats_2: Any,
        d_h2: torch.Tensor,
        grads: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        """From the gradient of the FFN's input ``d_h2`` down: the second norm, the
        residual, the attention half -> (dx, ``grads`` with theirs added)."""
        ops = env.ops
        norm_1, norm_2 = self._norms(config)
        d_h_mid, g = norm_2.backward(ops, params, saved["h_mid"], stats_2, d_h2)
        grads.update(g)
        del d_h2
        d_h_mid += dy  # the residual
        # the attention: h_mid = x + attention(n1(x))
        d_projected = self.attention.backward(
            config, params, x, saved, d_h_mid, grads, ops, **self._segments(env)
        )
        h1, stats_1 = norm_1.forward(ops, params, x)
        d_h1 = self.attention.project_backward(config, params, h1, d_projected, grads, ops)
        del d_projected, h1
        d_x, g = norm_1.backward(ops, params, x, stats_1, d_h1)
        grads.update(g)
        return d_x.add_(d_h_mid), grads

    # -- the experts routed apart ---------------------------------------------------------
    # With its experts in several shards (``kit.moe.expert_shards``) a block runs as a
    # routing task (``route_forward``: the attention half, the router, the shared expert),
    # one task per shard (``experts_forward``: the rows routed to its experts, added into
    # the block's output), and backward mirrors it (``experts_backward`` per shard, then
    # ``route_backward``), so that no task holds more than one shard's weights.

    def experts_apart(self, config: Any) -> int:
        """How many shards the FFN's experts run in (1: the block runs whole)."""
        shards = getattr(self.ffn, "shards", None)
        return 1 if shards is None else shards(config)

    def apart_saved(
        self, config: Any, batch: int, seq_len: int
    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """(what the routing task saves (``A``), the experts' object (``A_<...>.experts``:
        their input ``moe_in`` and ``gate_up``; a re-derived block's holds ``moe_in``
        alone), the experts' gradient to the block (``dE``))."""
        shared, experts, grad = self.ffn.apart_saved(config, batch, seq_len)
        main = (
            *self.attention.saved(config, batch, seq_len),
            TensorSpec("h_mid", (batch, seq_len, config.hidden_size)),
            *shared,
        )
        return main, experts, grad

    def route_forward(
        self, config: Any, params: Tensors, x: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, Tensors, Tensors, Tensors]:
        """``forward`` but the routed experts: -> (``h_mid`` plus the shared expert's
        output, what it saves, AuxTemp, the experts' input ``moe_in``)."""
        saved, h2 = self._attention_half(config, params, x, env)
        shared, shared_saved, aux_temp = self.ffn.route_forward(config, params, h2, env)
        h_mid = saved["h_mid"]
        y = h_mid.clone() if shared is None else h_mid + shared.view_as(h_mid)
        moe_in = h2.reshape(-1, config.hidden_size)
        return y, saved | shared_saved, aux_temp, {"moe_in": moe_in}

    def route_recompute(
        self, config: Any, params: Tensors, x: torch.Tensor, aux_temp: Tensors, env: Env
    ) -> tuple[Tensors, Tensors]:
        """What ``route_forward`` saves (the attention half's, the shared expert's) and the
        experts' input ``moe_in``, made again by forward's routing (``aux_temp``) for a
        re-derived block whose experts run apart: -> (saved, {"moe_in": ...}). Each
        shard's backward then makes its rows' ``gate_up`` again from ``moe_in``."""
        saved, h2 = self._attention_half(config, params, x, env)
        saved |= self.ffn.route_recompute(config, params, h2, aux_temp, env.ops)
        return saved, {"moe_in": h2.reshape(-1, config.hidden_size)}

    def experts_forward(
        self,
        config: Any,
        params: Tensors,
        experts: Tensors,
        aux_temp: Tensors,
        shard: tuple[int, int],
        env: Env,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Shard ``shard``'s experts over the rows routed to them (``RoutedExperts.
        experts_forward``): -> (their share of the output, float32, their ``gate_up``
        rows, the span of rows)."""
        return self.ffn.experts_forward(config, params, experts["moe_in"], aux_temp, shard, env.ops)

    def experts_backward(
        self,
        config: Any,
        params: Tensors,
        experts: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        shard: tuple[int, int],
        env: Env,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], Tensors]:
        """Shard ``shard``'s part of backward (``RoutedExperts.experts_backward``); an
        experts' object without ``gate_up`` (the block re-derived) has its rows made
        again."""
        flat_dy = dy.reshape(-1, config.hidden_size)
        return self.ffn.experts_backward(
            config, params, experts["moe_in"], experts.get("gate_up"), aux_temp, flat_dy,
            shard, env.ops,
        )  # fmt: skip

    def route_backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        d_experts: Tensors,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        """``backward`` given the shards' gradient to the block (``d_experts``)."""
        ops = env.ops
        h2, stats_2 = self._norms(config)[1].forward(ops, params, saved["h_mid"])
        d_h2, grads = self.ffn.route_backward(
            config, params, h2, saved, aux_temp, dy, d_experts, env
        )
        del h2
        return self._attention_backward(config, params, x, saved, stats_2, d_h2, grads, dy, env)

    def apart_cost(
        self, config: Any, batch: int, seq_len: int, act_bytes: int, shards: int
    ) -> tuple[LayerCost, LayerCost]:
        """(the routing tasks' work: the whole block's less every shard's; one shard's)."""
        whole = self.cost(config, batch, seq_len, act_bytes)
        one = self.ffn.experts_work(config, batch, seq_len, act_bytes, shards)

        def less(work: Work, part: Work) -> Work:
            return Work(
                max(0.0, work.flops - shards * part.flops),
                max(0.0, work.bytes - shards * part.bytes),
                work.kernels,
            )

        main = LayerCost(less(whole.forward, one.forward), less(whole.backward, one.backward))
        return main, one

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        """Forward: the parts' matmuls and the attention; activations ``x`` read and ``y``
        written, every saved value written and read back, and what the FFN moves besides.
        Backward: twice the matmuls and the FFN's extra, 2.5 times the attention, twice
        the bytes. Recompute: forward up to the saved tensors (``x`` read, the saved ones
        written, all but the FFN's read again). The ``mlp`` partial save: the FFN's
        ``rederive``."""
        tokens, n = batch * seq_len, config.hidden_size
        projections, attention = self.attention.flops(config, batch, seq_len)
        ffn = self.ffn.cost(config, batch, seq_len, act_bytes)
        matmul = projections + ffn.matmul
        ffn_saved = values_per_token(self.ffn.saved(config, 1, 1))
        saved = values_per_token(self.attention.saved(config, 1, 1)) + n + ffn_saved
        activations = tokens * act_bytes * (2 * n + 2 * saved + ffn.moved)
        rederived = tokens * act_bytes * (n + 2 * saved - ffn_saved)
        return LayerCost(
            forward=Work(matmul + attention, activations),
            backward=Work(2 * matmul + ffn.backward + 2.5 * attention, 2 * activations),
            recompute=Work(matmul - ffn.not_recomputed + attention, rederived),
            partial={"mlp": ffn.rederive},
        )
