"""GPT-2 as one plain-autograd ``nn.Module``: the truth the family's math is checked against.

No ``ops``, only plain torch, so a bug in a kernel or in the parts' hand-written backward
cannot hide in it: the embedding and the head are written here, each block is the one its
parts declare (``GPT2Block().reference``: ``nn.LayerNorm`` and the kit's plain-torch
modules of GPT-2's attention, written out as the softmax of masked scores, and of its
MLP). Its ``state_dict()`` keys are the family's ``f"{layer}.{param}"`` names
(``emb.wte``, ``0.attn.c_attn.weight``, ``head.ln_f.bias``); the output projection is
``emb.wte`` itself (tied). No dropout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dataflow_family_gpt2.model import GPT2Block

if TYPE_CHECKING:
    from dataflow_family_gpt2.config import GPT2Config

IGNORE_INDEX = -100


class Embed(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.empty(config.vocab_size, config.n_embd))
        self.wpe = nn.Parameter(torch.empty(config.n_positions, config.n_embd))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte[tokens] + self.wpe[: tokens.shape[1]]


class Head(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2Reference(nn.Module):
    """``model(tokens, targets)`` -> mean cross-entropy over the scored tokens (targets other
    than -100; 0 when none is scored). Blocks are the submodules ``"0"`` .. ``"n_layer-1"``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.emb = Embed(config)
        for layer in range(config.n_layer):
            self.add_module(str(layer), GPT2Block().reference(config))
        self.head = Head(config)
        self.init_weights()

    def blocks(self) -> list[nn.Module]:
        return [self.get_submodule(str(layer)) for layer in range(self.config.n_layer)]

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2's initialization: weights N(0, 0.02), the residual projections scaled by
        1/sqrt(2 * n_layer), biases 0, norms 1."""
        std = 0.02
        self.emb.wte.normal_(0.0, std, generator=generator)
        self.emb.wpe.normal_(0.0, std / 2, generator=generator)
        for block in self.blocks():
            for linear in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                linear.weight.normal_(0.0, std, generator=generator)
                linear.bias.zero_()
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                projection.weight.mul_(1.0 / math.sqrt(2 * self.config.n_layer))
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final-norm output (batch, seq, n_embd)."""
        if tokens.shape[1] > self.config.n_positions:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds n_positions ({self.config.n_positions})"
            )
        x = self.emb(tokens)
        for block in self.blocks():
            x = block(x)
        return self.head.ln_f(x)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, seq, vocab) logits against the tied token embedding."""
        return self.hidden(tokens) @ self.emb.wte.t()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens).flatten(0, 1)
        flat_targets = targets.flatten()
        loss_sum = F.cross_entropy(logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum / (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
