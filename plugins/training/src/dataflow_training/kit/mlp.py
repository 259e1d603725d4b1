"""The dense feed-forward parts of a block: the SwiGLU (Llama, Qwen), ``down(silu(gate(x)) *
up(x))``, no biases (the op pair ``SwiGLU`` and the part ``SwiGLUFFN``), and GPT-2's MLP,
``c_proj(gelu_tanh(c_fc(x)))`` with biases (the part ``GELUFFN``).

Forward saves the projections' outputs (``gate`` and ``up``; ``fc``); backward rebuilds the
activation elementwise (``swiglu_fwd``; ``gelu``) and differentiates through its backward
op (``swiglu_bwd``; ``gelu_bwd``), so no projection runs again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dataflow_training.kit import decoder_reference
from dataflow_training.kit.linear import Linear
from dataflow_training.kit.parts import FfnCost, as_is, conv1d
from dataflow_training.step.family import Env, TensorSpec, Work

Tensors = Mapping[str, torch.Tensor]


#: a stdlib frozen dataclass, not attrs: block math builds these inside torch.compile's
#: trace, and dynamo cannot trace attrs' frozen __init__ (a graph break in every block)
@dataclasses.dataclass(frozen=True)
class SwiGLU:
    gate: Linear
    up: Linear
    down: Linear

    def forward(
        self, ops: Any, params: Tensors, x: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (output, saved ``{"gate": ..., "up": ...}``)."""
        gate, up = self.gate.forward(ops, params, x), self.up.forward(ops, params, x)
        return self.down.forward(ops, params, ops["swiglu_fwd"](gate, up)), {"gate": gate, "up": up}

    def backward(
        self,
        ops: Any,
        params: Tensors,
        x: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        dy: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (dx, gradients of the three projections)."""
        d_act, grads = self.down.backward(ops, params, ops["swiglu_fwd"](gate, up), dy)
        d_gate, d_up = ops["swiglu_bwd"](d_act, gate, up)
        del d_act
        dx, g = self.gate.backward(ops, params, x, d_gate)
        grads.update(g)
        dx_up, g = self.up.backward(ops, params, x, d_up)
        grads.update(g)
        return dx + dx_up, grads


MLP = SwiGLU(
    Linear("mlp.gate_proj.weight"), Linear("mlp.up_proj.weight"), Linear("mlp.down_proj.weight")
)
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class SwiGLUFFN:
    """The dense SwiGLU FFN, as a part of a block: ``down_proj(silu(gate_proj(h)) *
    up_proj(h))`` of width ``config.intermediate_size``. Parameters (HF's names)
    ``mlp.{gate,up,down}_proj.weight``; saved ``gate`` and ``up`` (intermediate values a
    token each); no AuxTemp, no Aux. Its ``forward`` is its ``recompute`` plus the
    product and ``down_proj``, so the two cannot drift apart."""

    ops = ("swiglu_fwd", "swiglu_bwd")
    #: the reference module's name in a block (HF's)
    module = "mlp"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, inner = config.hidden_size, config.intermediate_size
        shapes = {"gate_proj": (inner, n), "up_proj": (inner, n), "down_proj": (n, inner)}
        return tuple(TensorSpec(f"mlp.{p}.weight", shapes[p]) for p in _PROJECTIONS)

    def groups(self, config: Any) -> tuple:
        return ()

    def aux(self, config: Any) -> tuple[TensorSpec, ...]:
        return ()

    aux_scope = "layer"

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        inner = config.intermediate_size
        return (
            TensorSpec("gate", (batch, seq_len, inner)),
            TensorSpec("up", (batch, seq_len, inner)),
        )

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return ()

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return as_is(self.params(config), prefix)

    def reference(self, config: Any) -> Any:

        return decoder_reference.MLP(config)

    def recompute(
        self, config: Any, params: Tensors, h: torch.Tensor, aux_temp: Tensors, ops: Any
    ) -> dict[str, torch.Tensor]:
        """The two projections of ``h``, as forward saves them."""
        return {"gate": MLP.gate.forward(ops, params, h), "up": MLP.up.forward(ops, params, h)}

    def forward(
        self, config: Any, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """-> (output, saved, AuxTemp (none))."""
        saved = self.recompute(config, params, h, {}, env.ops)
        act = env.ops["swiglu_fwd"](saved["gate"], saved["up"])
        return MLP.down.forward(env.ops, params, act), saved, {}

    def backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (dh, the projections' gradients)."""
        return MLP.backward(env.ops, params, h, saved["gate"], saved["up"], dy)

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> FfnCost:
        tokens, n, inner = batch * seq_len, config.hidden_size, config.intermediate_size
        return FfnCost(
            matmul=2 * tokens * 3 * n * inner,
            # rederive: n2 reads h_mid and writes h2, gate and up each read h2 and write
            # their own
            rederive=Work(2 * tokens * 2 * n * inner, tokens * act_bytes * (4 * n + 2 * inner)),
            # recompute stops at the saved gate and up: no product, no down_proj
            not_recomputed=2 * tokens * n * inner,
        )


C_FC = Linear("mlp.c_fc.weight", "mlp.c_fc.bias")
C_PROJ = Linear("mlp.c_proj.weight", "mlp.c_proj.bias")


@dataclasses.dataclass(frozen=True)
class GELUFFN:
    """GPT-2's MLP, as the FFN part of a block: ``c_proj(gelu(c_fc(h)))`` with biases, the
    tanh GELU (the ``gelu`` op), of the width the config field ``width`` holds.

    Parameters (HF's names) ``mlp.c_fc.{weight,bias}`` and ``mlp.c_proj.{weight,bias}``,
    weights stored ``(out, in)``, biases without weight decay; HF stores the weights as
    ``Conv1D`` ``(in, out)``, so its key rules transpose them. Saved ``fc``, the
    pre-activation (``width`` values a token); no AuxTemp, no Aux. Backward makes
    ``gelu(fc)`` again elementwise for ``c_proj``'s gradient and calls ``gelu_bwd``. Its
    ``forward`` is its ``recompute`` plus the GELU and ``c_proj``."""

    width: str = "intermediate_size"

    ops = ("gelu", "gelu_bwd")
    aux_scope = "layer"
    #: the reference module's name in a block (HF's)
    module = "mlp"

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, inner = config.hidden_size, getattr(config, self.width)
        return (
            TensorSpec(C_FC.weight, (inner, n)),
            TensorSpec(C_FC.bias, (inner,), decay=False),
            TensorSpec(C_PROJ.weight, (n, inner)),
            TensorSpec(C_PROJ.bias, (n,), decay=False),
        )

    def groups(self, config: Any) -> tuple:
        return ()

    def aux(self, config: Any) -> tuple[TensorSpec, ...]:
        return ()

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec("fc", (batch, seq_len, getattr(config, self.width))),)

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return ()

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return conv1d(self.params(config), prefix)

    def reference(self, config: Any) -> Any:
        return decoder_reference.GELUMLP(config, getattr(config, self.width))

    def recompute(
        self, config: Any, params: Tensors, h: torch.Tensor, aux_temp: Tensors, ops: Any
    ) -> dict[str, torch.Tensor]:
        """The pre-activation ``c_fc(h)``, as forward saves it."""
        return {"fc": C_FC.forward(ops, params, h)}

    def forward(
        self, config: Any, params: Tensors, h: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """-> (output, saved, AuxTemp (none))."""
        saved = self.recompute(config, params, h, {}, env.ops)
        return C_PROJ.forward(env.ops, params, env.ops["gelu"](saved["fc"])), saved, {}

    def backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (dh, the projections' gradients)."""
        ops, fc = env.ops, saved["fc"]
        d_act, grads = C_PROJ.backward(ops, params, ops["gelu"](fc), dy)
        d_fc = ops["gelu_bwd"](d_act, fc)
        del d_act
        d_h, g = C_FC.backward(ops, params, h, d_fc)
        grads.update(g)
        return d_h, grads

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> FfnCost:
        tokens, n, inner = batch * seq_len, config.hidden_size, getattr(config, self.width)
        return FfnCost(
            matmul=2 * tokens * 2 * n * inner,
            # rederive: n2 reads h_mid and writes h2, c_fc reads h2 and writes fc
            rederive=Work(2 * tokens * n * inner, tokens * act_bytes * (3 * n + inner)),
            # recompute stops at the saved fc: no GELU, no c_proj
            not_recomputed=2 * tokens * n * inner,
        )
