"""A toy family with real math, for tests of lowerings, resolvers, planners and engines
that need a training step but not a real model: an embedding, blocks
``y = x + tanh(x @ w.T + b)`` and a head ``x * g`` with a tied output projection and
cross-entropy. ``ToyFamily`` satisfies ``dataflow_training.step.family.Family``; ``plain_ops()``
gives plain-torch implementations of the ops its math calls (no kernel package needed).
Not registered as a plugin: tests register it themselves when they need it by name."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from dataflow_training.step.family import LayerCost, LayerSpec, TensorSpec, Work


@attrs.frozen
class ToyConfig:
    vocab: int = 37
    dim: int = 16
    layers: int = 3


def _cost(config, batch, seq_len, act_bytes):
    work = Work(2 * batch * seq_len * config.dim**2, 4 * batch * seq_len * config.dim * act_bytes)
    return LayerCost(forward=work, backward=Work(2 * work.flops, 2 * work.bytes))


class Embed:
    cost = staticmethod(_cost)

    def forward(self, config, params, tokens, env):
        return params["wte"][tokens]

    def backward(self, config, tokens, d_hidden, env):
        grad = torch.zeros(config.vocab, config.dim, dtype=d_hidden.dtype, device=d_hidden.device)
        grad.index_add_(0, tokens.reshape(-1), d_hidden.reshape(-1, config.dim))
        return {"wte": grad}


class Block:
    cost = staticmethod(_cost)

    def saved(self, config, batch, seq_len):
        return (TensorSpec("pre", (batch, seq_len, config.dim)),)

    def aux_temp(self, config, batch, seq_len):
        return ()

    def forward(self, config, params, x, env):
        saved = self.recompute(config, params, x, {}, env)
        return x + torch.tanh(saved["pre"]), saved, {}

    def recompute(self, config, params, x, aux_temp, env):
        return {"pre": env.ops["linear"](x, params["w"], params["b"])}

    def backward(self, config, params, x, saved, aux_temp, dy, env):
        t = torch.tanh(saved["pre"])
        dpre = dy * (1 - t * t)
        dx = dy + dpre @ params["w"]
        flat_x, flat_d = x.reshape(-1, config.dim), dpre.reshape(-1, config.dim)
        return dx, {"w": flat_d.T @ flat_x, "b": flat_d.sum(0)}


class Head:
    cost = staticmethod(_cost)

    def forward_backward(self, config, params, x, targets, env):
        g, wte = params["g"], params["wte"]
        flat = x.reshape(-1, config.dim)
        n = flat.shape[0]
        loss_sum, d_h, d_wte = env.ops["chunked_cross_entropy"](
            flat * g, wte, targets.reshape(-1), env.chunk_tokens, grad_scale=env.grad_scale
        )
        d_h = d_h / n
        return (
            loss_sum / n,
            (d_h * g).reshape(x.shape),
            {"g": (d_h * flat).sum(0), "wte": d_wte / n},
        )


class ToyFamily:
    name = "toy"
    presets = {"small": ToyConfig()}
    ops = ("linear", "chunked_cross_entropy")

    def config(self, preset, **overrides):
        return attrs.evolve(self.presets[preset], **overrides)

    def layers(self, config):
        return [
            LayerSpec.single("emb", "embed", (TensorSpec("wte", (config.vocab, config.dim)),)),
            *(
                LayerSpec.single(
                    str(i),
                    "block",
                    (
                        TensorSpec("w", (config.dim, config.dim)),
                        TensorSpec("b", (config.dim,), decay=False),
                    ),
                )
                for i in range(config.layers)
            ),
            LayerSpec.single(
                "head",
                "head",
                (TensorSpec("g", (config.dim,), decay=False),),
                tied={"wte": "emb.wte"},
            ),
        ]

    def hidden_shape(self, config, batch, seq_len):
        return (batch, seq_len, config.dim)

    def math(self, kind):
        return {"embed": Embed(), "block": Block(), "head": Head()}[kind]

    def reference_model(self, config):
        return ToyReference(config)


def toy_weights(family: ToyFamily, config: ToyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Start weights by ``layer.param``: 0.3 x normal, the head's gain 1 + 0.1 x normal."""
    torch.manual_seed(seed)
    state = {
        f"{layer.name}.{p.name}": 0.3 * torch.randn(p.shape)
        for layer in family.layers(config)
        for p in layer.params
    }
    state["head.g"] = 1 + 0.1 * torch.randn(config.dim)
    return state


class ToyReference(torch.nn.Module):
    """Plain autograd; ``state_dict()`` keys are ``{layer}.{param}`` as the protocol asks."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

        def holder(**shapes):
            module = torch.nn.Module()
            for name, shape in shapes.items():
                module.register_parameter(name, torch.nn.Parameter(0.3 * torch.randn(shape)))
            return module

        layers = {"emb": holder(wte=(config.vocab, config.dim))}
        for i in range(config.layers):
            layers[str(i)] = holder(w=(config.dim, config.dim), b=(config.dim,))
        layers["head"] = holder(g=(config.dim,))
        self.layers = torch.nn.ModuleDict(layers)

    def state_dict(self, *args, **kwargs):
        return {
            k.removeprefix("layers."): v for k, v in super().state_dict(*args, **kwargs).items()
        }

    def load_state_dict(self, state, strict=True):
        return super().load_state_dict({f"layers.{k}": v for k, v in state.items()}, strict)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.removeprefix("layers."), p

    def param(self, name):
        layer, _, param = name.partition(".")
        return getattr(self.layers[layer], param)

    def forward(self, tokens, targets):
        x = self.param("emb.wte")[tokens]
        for i in range(self.config.layers):
            x = x + torch.tanh(x @ self.param(f"{i}.w").T + self.param(f"{i}.b"))
        logits = (x * self.param("head.g")) @ self.param("emb.wte").T
        return F.cross_entropy(logits.reshape(-1, self.config.vocab), targets.reshape(-1))


def plain_ops():
    """Plain torch implementations of the ops the toy math calls."""

    def chunked_cross_entropy(hidden, weight, targets, chunk_tokens, *, grad_scale=1.0):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden, d_weight = torch.zeros_like(hidden), torch.zeros_like(weight)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            t = targets[start : start + chunk_tokens]
            logits = (h @ weight.T).float()
            loss += F.cross_entropy(logits, t, reduction="sum")
            d = torch.softmax(logits, -1)
            d[torch.arange(len(t)), t] -= 1
            d_hidden[start : start + chunk_tokens] = (d @ weight.float()).to(hidden.dtype)
            d_weight += (d.T @ h.float()).to(weight.dtype)
        return loss, d_hidden * grad_scale, d_weight * grad_scale

    def adamw_multi(
        params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay
    ):
        for param, grad, exp_avg, exp_avg_sq in zip(
            params, grads, exp_avgs, exp_avg_sqs, strict=True
        ):
            param.mul_(1 - lr * weight_decay)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))

    return {
        "linear": F.linear,
        "chunked_cross_entropy": chunked_cross_entropy,
        "adamw_multi": adamw_multi,
    }
