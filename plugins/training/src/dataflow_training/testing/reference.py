"""The plain-autograd truth a training step is held to: a family's reference model in
float64 and torch's AdamW over it, with the engine's weight-decay rule."""

from __future__ import annotations

from typing import Any

import torch


def float64_reference(
    family: Any,
    config: Any,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.nn.Parameter]]:
    """``family``'s reference model of ``config`` in float64 holding ``state``, torch's
    AdamW over it with weight decay off where the family declares it off (as the engine's
    update), and the model's parameters by name: the plain-autograd truth a step is held
    to."""
    model = family.reference_model(config).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    no_decay = {
        f"{layer.name}.{p.name}"
        for layer in family.layers(config)
        for p in layer.params
        if not p.decay
    }
    named = dict(model.named_parameters())
    groups = [
        {
            "params": [p for n, p in named.items() if n not in no_decay],
            "weight_decay": weight_decay,
        },
        {"params": [p for n, p in named.items() if n in no_decay], "weight_decay": 0.0},
    ]
    return model, torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8), named
