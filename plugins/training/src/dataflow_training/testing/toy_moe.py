"""``toy_moe``: a small mixture-of-experts family that proves the family protocol v2.

Each block is ``y = x + sum_k w_k * expert_{e_k}(x)`` over the top-2 of ``experts``
experts, ``expert_e(x) = w_out[e] @ tanh(w_in[e] @ x)``, with router
``p = softmax(x @ router.T)`` and the chosen probabilities renormalised into ``w``. It
uses every part of the protocol a real MoE family needs:

- **parameter groups**: the router is the layer's main group (``W_<layer>``), the experts
  their own (``W_<layer>.experts``), so a planner can stream experts apart;
- **AuxTemp**: forward decides the routing once and writes it (``ids``, ``weights``);
  recompute and backward read it verbatim, never routing again;
- **Aux**: ``counts``, the expert loads over the whole step: zeroed before round 0,
  accumulated by every round's forward, read by the last round's backward for the
  balance term ``balance * experts * sum_e f_e * P_e``, where ``f_e`` is expert e's share
  of the step's routed slots (no gradient) and ``P_e`` the mean router probability of
  the last round's tokens. The reference computes exactly that (``ToyMoEReference``).

Registered as family ``toy_moe`` (preset ``toy_moe_tiny``) by the training plugin, so
``dataflow verify --family toy_moe --preset toy_moe_tiny`` runs it.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from dataflow_training.step.family import Env, LayerCost, LayerSpec, ParamGroup, TensorSpec, Work

OPS = ("linear", "chunked_cross_entropy")


@attrs.frozen
class ToyMoEConfig:
    vocab: int = 41
    dim: int = 16
    ffn: int = 24
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    balance: float = 0.1


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _route(config: ToyMoEConfig, params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router probabilities (tokens, experts) in float32 at least, logits)."""
    logits = F.linear(_tokens(x), params["router"])
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1), logits


def _experts(config: ToyMoEConfig, params, x: torch.Tensor, ids: torch.Tensor):
    """pre-activations (tokens, k, ffn) and expert outputs (tokens, k, dim) for the chosen
    experts of every token."""
    flat = _tokens(x)
    w_in = params["w_in"][ids.long()]  # (tokens, k, ffn, dim)
    pre = torch.einsum("tkfd,td->tkf", w_in, flat)
    out = torch.einsum("tkdf,tkf->tkd", params["w_out"][ids.long()], torch.tanh(pre))
    return pre, out


class Embed:
    def forward(self, config, params, tokens, env):
        return params["wte"][tokens]

    def backward(self, config, tokens, d_hidden, env):
        acc = torch.promote_types(d_hidden.dtype, torch.float32)
        grad = torch.zeros(config.vocab, config.dim, dtype=acc, device=d_hidden.device)
        grad.index_add_(0, tokens.reshape(-1), _tokens(d_hidden).to(acc))
        return {"wte": grad}

    def cost(self, config, batch, seq_len, act_bytes):
        return LayerCost(Work(0, 2 * batch * seq_len * config.dim * act_bytes), Work(0, 0))


class MoEBlock:
    def saved(self, config, batch, seq_len):
        tokens = batch * seq_len
        return (TensorSpec("pre", (tokens, config.top_k, config.ffn)),)

    def aux_temp(self, config, batch, seq_len):
        tokens = batch * seq_len
        return (
            TensorSpec("ids", (tokens, config.top_k), dtype="int32"),
            TensorSpec("weights", (tokens, config.top_k)),
        )

    def forward(self, config, params, x, env: Env):
        probs, _ = _route(config, params, x)
        top, ids = probs.topk(config.top_k, dim=-1)
        weights = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        if "counts" in env.aux:
            counts = torch.bincount(ids.reshape(-1), minlength=config.experts)
            env.aux["counts"].add_(counts.to(env.aux["counts"].dtype))
        aux_temp = {"ids": ids.to(torch.int32), "weights": weights}
        saved = self.recompute(config, params, x, aux_temp, env)
        _, out = _experts(config, params, x, aux_temp["ids"])
        moe = (weights.unsqueeze(-1) * out).sum(1).view_as(x)
        return x + moe, saved, aux_temp

    def recompute(self, config, params, x, aux_temp, env: Env):
        pre, _ = _experts(config, params, x, aux_temp["ids"])
        return {"pre": pre}

    def backward(self, config, params, x, saved, aux_temp, dy, env: Env):
        ids, weights, pre = aux_temp["ids"].long(), aux_temp["weights"], saved["pre"]
        flat_x, flat_dy = _tokens(x), _tokens(dy)
        act = torch.tanh(pre)
        w_out, w_in = params["w_out"][ids], params["w_in"][ids]
        out = torch.einsum("tkdf,tkf->tkd", w_out, act)
        d_out = weights.unsqueeze(-1) * flat_dy.unsqueeze(1)  # (tokens, k, dim)
        d_weights = (out * flat_dy.unsqueeze(1)).sum(-1)  # (tokens, k)
        d_pre = torch.einsum("tkdf,tkd->tkf", w_out, d_out) * (1 - act * act)
        grads = {
            "w_out": torch.zeros_like(params["w_out"]).index_add_(
                0, ids.reshape(-1), torch.einsum("tkd,tkf->tkdf", d_out, act).flatten(0, 1)
            ),
            "w_in": torch.zeros_like(params["w_in"]).index_add_(
                0, ids.reshape(-1), torch.einsum("tkf,td->tkfd", d_pre, flat_x).flatten(0, 1)
            ),
        }
        dx = flat_dy + torch.einsum("tkfd,tkf->td", w_in, d_pre)
        # the router: weights = top / sum(top), top = probs[ids], probs = softmax(logits)
        probs, _ = _route(config, params, x)
        top = probs.gather(1, ids)
        total = top.sum(-1, keepdim=True)
        d_top = (
            d_weights.to(top.dtype) - (d_weights.to(top.dtype) * top).sum(-1, keepdim=True) / total
        ) / total
        d_probs = torch.zeros_like(probs).scatter_add_(1, ids, d_top)
        if env.last_round and "counts" in env.aux:
            share = env.aux["counts"].to(probs.dtype) / env.aux["counts"].sum().clamp(min=1)
            d_probs += config.balance * config.experts * share / probs.shape[0]
        d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        d_logits = d_logits.to(x.dtype)
        grads["router"] = d_logits.t() @ flat_x
        dx = dx + d_logits @ params["router"]
        return dx.view_as(x), grads

    def cost(self, config, batch, seq_len, act_bytes):
        tokens = batch * seq_len
        flops = (
            2 * tokens * (config.experts * config.dim + 2 * config.top_k * config.ffn * config.dim)
        )
        bytes_ = tokens * act_bytes * (2 * config.dim + config.top_k * config.ffn)
        return LayerCost(Work(flops, bytes_), Work(2 * flops, 2 * bytes_))


class Head:
    def forward_backward(self, config, params, x, targets, env: Env):
        g, wte = params["g"], params["wte"]
        flat = _tokens(x)
        n = flat.shape[0]
        loss_sum, d_h, d_wte = env.ops["chunked_cross_entropy"](
            flat * g, wte, targets.reshape(-1), env.chunk_tokens, grad_scale=env.grad_scale
        )
        d_h = d_h / n
        grads = {"g": (d_h * flat).sum(0), "wte": d_wte / n}
        return loss_sum / n, (d_h * g).view_as(x), grads

    def cost(self, config, batch, seq_len, act_bytes):
        flops = 6 * batch * seq_len * config.vocab * config.dim
        return LayerCost(Work(flops, 4 * batch * seq_len * config.dim * act_bytes), Work())


class ToyMoEFamily:
    name = "toy_moe"
    presets = {"toy_moe_tiny": ToyMoEConfig()}
    ops = OPS

    def config(self, preset, **overrides):
        if preset not in self.presets:
            raise KeyError(f"unknown toy_moe preset {preset!r}; known: {sorted(self.presets)}")
        return attrs.evolve(self.presets[preset], **overrides)

    def layers(self, config):
        e, d, f = config.experts, config.dim, config.ffn
        blocks = [
            LayerSpec(
                str(i),
                "moe",
                (
                    ParamGroup("", (TensorSpec("router", (e, d), decay=False),)),
                    ParamGroup(
                        "experts", (TensorSpec("w_in", (e, f, d)), TensorSpec("w_out", (e, d, f)))
                    ),
                ),
                aux=(TensorSpec("counts", (e,), dtype="float32"),),
            )
            for i in range(config.layers)
        ]
        return [
            LayerSpec.single("emb", "embed", (TensorSpec("wte", (config.vocab, d)),)),
            *blocks,
            LayerSpec.single(
                "head", "head", (TensorSpec("g", (d,), decay=False),), tied={"wte": "emb.wte"}
            ),
        ]

    def hidden_shape(self, config, batch, seq_len):
        return (batch, seq_len, config.dim)

    def math(self, kind):
        kinds = {"embed": Embed, "moe": MoEBlock, "head": Head}
        if kind not in kinds:
            raise KeyError(f"toy_moe has no layer kind {kind!r}; its kinds: {', '.join(kinds)}")
        return kinds[kind]()

    def reference_model(self, config):
        return ToyMoEReference(config)


class ToyMoEReference(torch.nn.Module):
    """Plain autograd over a whole step: ``model(rounds)`` takes the step's list of
    ``(tokens, targets)`` and returns ``(per-round losses, the balance term)``; the
    step's objective is their mean plus the balance term."""

    steps_over_rounds = True

    def __init__(self, config: ToyMoEConfig) -> None:
        super().__init__()
        self.config = config
        e, d, f = config.experts, config.dim, config.ffn
        params = {"emb.wte": 0.5 * torch.randn(config.vocab, d), "head.g": 1 + 0.1 * torch.randn(d)}
        for i in range(config.layers):
            params[f"{i}.router"] = torch.randn(e, d)
            params[f"{i}.w_in"] = 0.3 * torch.randn(e, f, d)
            params[f"{i}.w_out"] = 0.3 * torch.randn(e, d, f)
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(v) for k, v in params.items()}
        )

    def state_dict(self, *args, **kwargs):
        return {
            k.removeprefix("params.").replace("__", "."): v
            for k, v in super().state_dict(*args, **kwargs).items()
        }

    def load_state_dict(self, state, strict=True):
        return super().load_state_dict(
            {f"params.{k.replace('.', '__')}": v for k, v in state.items()}, strict
        )

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.removeprefix("params.").replace("__", "."), p

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def forward(self, rounds):
        config = self.config
        losses, loads, last_probs = (
            [],
            [
                torch.zeros(config.experts, dtype=torch.float64, device=rounds[0][0].device)
                for _ in range(config.layers)
            ],
            [],
        )
        for tokens, targets in rounds:
            x = self.p("emb.wte")[tokens].reshape(-1, config.dim)
            last_probs = []
            for i in range(config.layers):
                probs = torch.softmax(x @ self.p(f"{i}.router").T, -1)
                top, ids = probs.topk(config.top_k, -1)
                weights = top / top.sum(-1, keepdim=True)
                loads[i] = loads[i] + torch.bincount(ids.reshape(-1), minlength=config.experts)
                last_probs.append(probs)
                hidden = torch.tanh(torch.einsum("tkfd,td->tkf", self.p(f"{i}.w_in")[ids], x))
                out = torch.einsum("tkdf,tkf->tkd", self.p(f"{i}.w_out")[ids], hidden)
                x = x + (weights.unsqueeze(-1) * out).sum(1)
            logits = (x * self.p("head.g")) @ self.p("emb.wte").T
            losses.append(F.cross_entropy(logits, targets.reshape(-1)))
        balance = sum(
            config.balance
            * config.experts
            * ((load / load.sum()).to(probs.dtype) * probs.mean(0)).sum()
            for load, probs in zip(loads, last_probs, strict=True)
        )
        return losses, balance
