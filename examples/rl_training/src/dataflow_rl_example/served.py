"""The trainer kind ``rl``: the policy update served by ``dataflow serve-trainer``.

``load`` with ``"kind": "rl"`` opens a ``ServedPolicy`` (``open_policy``) and every
``step`` is one update on a rollouts folder; the server checkpoints, restores and exports
the weights (docs/engine_service.md of dataflow). ``load``'s fields:

- ``family`` (a family's name; default: the installed family that has ``preset``; with
  ``init`` alone, required),
- ``init`` (an HF checkpoint folder to start from) or ``preset`` (a random model of that
  preset, drawn with ``seed``), one of them at least,
- ``budget`` (the fast-memory budget, bytes or ``"8MiB"``; default: everything fits),
- ``loss`` (``grpo`` or ``ppo``), ``clip``, ``weight_decay``, ``kl`` (true: the update
  has the KL term to the reference, whose log-probs the rollouts then carry), ``dtype``
  (``float32`` or ``bfloat16``: the parameters', gradients' and activations') and
  ``rounds`` (micro-batches of each update's rows, a whole number that divides them;
  default 1).

``step``'s fields: ``lr`` (default 1e-3) and ``kl_coef`` (default 0; above 0 needs ``kl``).
Every error is a ``ValueError`` whose message names the field at fault.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dataflow_training import load_family

from dataflow import families, parse_size
from dataflow_rl_example.loss import LOSSES
from dataflow_rl_example.policy import PolicyTrainer
from dataflow_rl_example.program import DTYPES, UpdateOptions
from dataflow_rl_example.rollouts import RolloutError, read_rollouts


class ServedPolicy:
    """A ``PolicyTrainer`` with the methods a served trainer kind has
    (``dataflow_training.service.kinds.ServedTrainer``)."""

    def __init__(
        self,
        family: Any,
        config: Any,
        state: Mapping[str, torch.Tensor],
        options: UpdateOptions,
        *,
        budget_bytes: int | None,
        device: str,
        preset: str | None,
    ) -> None:
        self.family, self.config, self.options = family, config, options
        self.budget_bytes, self.device, self.preset = budget_bytes, device, preset
        self.trainer = PolicyTrainer(
            family, config, state, options, budget_bytes=budget_bytes, device=device
        )

    @property
    def updates(self) -> int:
        return self.trainer.updates

    def describe(self) -> dict[str, Any]:
        return {
            "family": self.family.name,
            "preset": self.preset,
            "loss": self.options.loss,
            "kl": self.options.kl,
            "dtype": self.options.dtype,
            "rounds": self.options.rounds,
            "budget": self.budget_bytes,
        }

    def step(self, path: Path, lr: Any = 1e-3, kl_coef: Any = 0.0) -> dict[str, float]:
        """One update on the rollouts folder ``path``; its stats."""
        lr, kl_coef = _rate("lr", lr), _rate("kl_coef", kl_coef)
        if kl_coef and not self.options.kl:
            raise ValueError(
                f"args.kl_coef: {kl_coef}, but the update was loaded without the KL term "
                "(load with kl: true)"
            )
        try:
            rollouts = read_rollouts(path)
            rollouts.check(str(path))
        except RolloutError as error:
            raise ValueError(f"args.batch.path: {error}") from None
        if self.options.kl and rollouts.ref_logprobs is None:
            raise ValueError(
                f"args.batch.path: {path} carries no ref_logprobs; the update has the KL term"
            )
        if rollouts.rows % self.options.rounds:
            raise ValueError(
                f"args.rounds: {self.options.rounds} (loaded) does not divide the "
                f"{rollouts.rows} rows of {path}"
            )
        return self.trainer.update(rollouts, lr=lr, kl_coef=kl_coef)

    def state(self) -> dict[str, torch.Tensor]:
        return self.trainer.state()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.trainer.optimizer_state()

    def load_state(
        self, weights: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, torch.Tensor]
    ) -> None:
        """Start over from ``weights`` and ``optimizer_state`` (a checkpoint's)."""
        mine = self.trainer.state()
        for name in sorted(set(mine) | set(weights)):
            if name not in weights or name not in mine:
                raise ValueError(f"checkpoint: tensor {name!r} is not one of this model's")
            if tuple(weights[name].shape) != tuple(mine[name].shape):
                raise ValueError(
                    f"checkpoint: tensor {name!r} has shape {tuple(weights[name].shape)}; this "
                    f"model's is {tuple(mine[name].shape)}"
                )
        if "updates" not in optimizer_state:
            raise ValueError("checkpoint: the optimizer state has no 'updates'")
        trainer = PolicyTrainer(
            self.family,
            self.config,
            weights,
            self.options,
            budget_bytes=self.budget_bytes,
            device=self.device,
            optimizer_state=optimizer_state,
        )
        self.trainer.close()
        self.trainer = trainer

    def close(self) -> None:
        self.trainer.close()


def open_policy(options: Mapping[str, Any], *, device: str) -> ServedPolicy:
    """The ``rl`` kind's trainer from ``load``'s fields (module docstring)."""
    preset, init = _text(options, "preset"), _text(options, "init")
    if preset is None and init is None:
        raise ValueError("args.init: missing (an HF checkpoint folder; or give args.preset)")
    name = _text(options, "family")
    if name is None and preset is None:
        raise ValueError("args.family: missing (the family of the checkpoint args.init names)")
    name = name or _family_of(preset)
    try:
        family = load_family(name)
    except LookupError as error:
        raise ValueError(f"args.family: {error}") from None
    if init is not None:
        if not Path(init).is_dir():
            raise ValueError(f"args.init: {init} is not a folder (an HF checkpoint)")
        try:
            config, state = family.import_hf(init)
        except (ValueError, OSError) as error:
            raise ValueError(f"args.init: {error}") from None
    else:
        if preset not in family.presets:
            raise ValueError(
                f"args.preset: {name} has no preset {preset!r}; known: {', '.join(family.presets)}"
            )
        config = family.config(preset)
        seed = options.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"args.seed: a whole number, not {seed!r}")
        torch.manual_seed(seed)
        state = family.reference_model(config).state_dict()
    loss = options.get("loss", "grpo")
    if loss not in LOSSES:
        raise ValueError(f"args.loss: {loss!r} is not one of {', '.join(LOSSES)}")
    kl = options.get("kl", False)
    if not isinstance(kl, bool):
        raise ValueError(f"args.kl: true or false, not {kl!r}")
    dtype = options.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"args.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    rounds = options.get("rounds", 1)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"args.rounds: a whole number >= 1, not {rounds!r}")
    update = UpdateOptions(
        loss=loss,
        clip_eps=_rate("clip", options.get("clip", 0.2)),
        kl=kl,
        weight_decay=_rate("weight_decay", options.get("weight_decay", 0.0)),
        dtype=dtype,
        rounds=rounds,
    )
    return ServedPolicy(
        family,
        config,
        state,
        update,
        budget_bytes=_size(options.get("budget")),
        device=device,
        preset=preset,
    )


def _text(options: Mapping[str, Any], name: str) -> str | None:
    value = options.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"args.{name}: a string, not {value!r}")
    return value


def _rate(name: str, value: Any) -> float:
    """A finite number >= 0 (a learning rate, a coefficient)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"args.{name}: a number, not {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"args.{name}: {value} is not a finite number >= 0")
    return float(value)


def _size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as error:
            raise ValueError(f"args.budget: {error}") from None
    raise ValueError(f'args.budget: a size (bytes, or a string such as "8MiB"), not {value!r}')


def _family_of(preset: str | None) -> str:
    """The one installed family that has ``preset``."""
    owners = [spec.name for spec in families() if preset in getattr(spec.load(), "presets", ())]
    if len(owners) != 1:
        which = "no installed family has" if not owners else f"families {', '.join(owners)} have"
        raise ValueError(f"args.family: {which} a preset {preset!r}; name one in args.family")
    return owners[0]
