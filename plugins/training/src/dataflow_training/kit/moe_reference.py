"""A mixture-of-experts decoder (``moe.py``) as one plain-autograd ``nn.Module``: the truth
the kit's MoE math is checked against (OLMoE, Qwen 3 MoE), itself held to transformers'
``OlmoeForCausalLM`` / ``Qwen3MoeForCausalLM`` by each family's HF tests.

The attention, norms, embedding and head are the decoder reference's (plain torch, no
``ops``; each block built by the config's architecture, whose MoE FFN part makes its
``Experts`` here); the FFN is written out here expert by expert, as a loop over the experts that
some token chose (no grouping, no sorting, no ``grouped_mm``). Its ``state_dict()`` keys
are the layers' names (``0.mlp.gate.weight``, ``0.mlp.experts.gate_up_proj``, ...).

``model(rounds)`` takes a step's list of ``(tokens, targets)`` and returns ``(per-round
mean cross-entropies, the router terms)``: the step's objective is the rounds' mean plus
those terms (``moe.py`` defines them: the load balance from the whole step's counts and
the last round's probabilities, both pooled over the layers; the z-loss averaged over
rounds). ``logits(tokens)`` and
``balance(counts)`` are there for the HF tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dataflow_training.kit.decoder_reference import IGNORE_INDEX, MLP, DecoderReference


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Router math in float32, or float64 for a float64 model (the step check's truth)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class Experts(nn.Module):
    """Routed SwiGLU experts with their router; records what the router decided. With
    ``shared_width``, one more SwiGLU expert of that width every token goes through,
    scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen3-Next)."""

    def __init__(self, config: Any, shared_width: int | None = None) -> None:
        super().__init__()
        self.config = config
        e, n, inner = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate = nn.Linear(n, e, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, n))
        self.experts.down_proj = nn.Parameter(torch.empty(e, n, inner))
        if shared_width is not None:
            self.shared_expert = MLP(config, shared_width)
            self.shared_expert_gate = nn.Linear(n, 1, bias=False)
        self.shared = shared_width is not None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, ids)
        #: expert choices (tokens, k) the next forward takes instead of its own top-k
        self.follow: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, c.hidden_size)
        logits = self.gate(flat)
        probs = torch.softmax(_at_least_float32(logits), -1)
        if self.follow is None:
            top, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        else:
            ids, self.follow = self.follow.to(device=probs.device, dtype=torch.long), None
            top = probs.gather(1, ids)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(flat.dtype)
        self.last = (logits, ids)
        out = torch.zeros_like(flat)
        inner = c.intermediate_size
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            w_gate_up = self.experts.gate_up_proj[expert]
            gate, up = (flat[token] @ w_gate_up.t()).split(inner, dim=-1)
            hidden = (F.silu(gate) * up) @ self.experts.down_proj[expert].t()
            out = out.index_add(0, token, hidden * top[token, slot, None])
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class MoEReference(DecoderReference):
    """The decoder reference with every FFN routed (see the module docstring)."""

    steps_over_rounds = True
    #: ``forward`` can route with given expert choices (``routing``); after it,
    #: ``recorded`` holds per round every layer's (router logits, expert choices)
    follows_routing = True
    recorded: list[list[tuple[torch.Tensor, torch.Tensor]]]

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        super().init_weights(generator, std)
        for module in self.modules():
            if isinstance(module, Experts):
                module.experts.gate_up_proj.normal_(0.0, std, generator=generator)
                module.experts.down_proj.normal_(0.0, std, generator=generator)

    def _cross_entropy(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens).flatten(0, 1)
        flat = targets.flatten()
        loss_sum = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum / (flat != IGNORE_INDEX).sum().clamp(min=1)

    def _routers(self) -> list[Experts]:
        return [block.mlp for block in self.blocks()]

    def forward(
        self,
        rounds: list[tuple[torch.Tensor, torch.Tensor]],
        routing: list[list[torch.Tensor]] | None = None,
    ):
        """``routing``: per round, every layer's expert choices (tokens, k) to route
        with instead of the routers' own top-k (the engine's recorded AuxTemp ``ids``, for
        a check that compares the math given the same discrete decisions)."""
        c = self.config
        layers = c.num_hidden_layers
        # every layer's and round's routed slots, where the tokens are (verify's bf16
        # yardstick runs this model on the device)
        counts = torch.zeros(c.num_experts, device=rounds[0][0].device)
        losses, z_loss = [], 0.0
        self.recorded = []
        for r, (tokens, targets) in enumerate(rounds):
            if routing is not None:
                for router, ids in zip(self._routers(), routing[r], strict=True):
                    router.follow = ids
            losses.append(self._cross_entropy(tokens, targets))
            self.recorded.append([router.last for router in self._routers()])
            for router in self._routers():
                logits, ids = router.last
                counts = counts + torch.bincount(ids.reshape(-1), minlength=c.num_experts)
                z = torch.logsumexp(_at_least_float32(logits), -1).pow(2).mean()
                z_loss = z_loss + c.router_z_loss_coef * z / (layers * len(rounds))
        return losses, self.balance(counts) + z_loss

    def balance(self, counts: torch.Tensor) -> torch.Tensor:
        """The load-balancing term from the step's pooled ``counts`` and every layer's
        router probabilities of the last round (the ones ``router.last`` holds)."""
        c = self.config
        probs = torch.cat(
            [torch.softmax(_at_least_float32(r.last[0]), -1) for r in self._routers()]
        )
        per_token = (counts / (counts.sum() / c.num_experts_per_tok)).to(probs)  # sums to k
        return c.router_aux_loss_coef * c.num_experts * (per_token * probs.mean(0)).sum()
