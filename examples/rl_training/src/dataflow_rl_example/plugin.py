"""The package's entry point: the resolver ``rl-update``, so that ``dataflow trace`` and
``dataflow plan --measured --resolver rl-update`` run an update's program written to JSON
(``dataflow-rl lower``); and the trainer kind ``rl``, so that ``dataflow serve-trainer``
serves the update (``load`` with ``"kind": "rl"``, ``dataflow_rl_example.served``). Light:
the resolver and the trainer are built, and torch imported, on first use."""

from __future__ import annotations

from typing import Any

from dataflow import ResolverSpec, TrainerKindSpec, hookimpl

#: the ``rl`` kind's ``load`` and ``step`` fields (``dataflow_rl_example.served`` reads them)
LOAD_ARGS = (
    "family",
    "preset",
    "init",
    "seed",
    "budget",
    "loss",
    "clip",
    "weight_decay",
    "kl",
    "dtype",
    "rounds",
)
STEP_ARGS = ("lr", "kl_coef")


def _build(program: Any) -> Any:
    from dataflow_rl_example.tasks import build_from_program  # imports torch

    return build_from_program(program)


def _open(options: Any, *, device: str) -> Any:
    from dataflow_rl_example.served import open_policy  # imports torch

    return open_policy(options, device=device)


@hookimpl
def dataflow_resolvers() -> list[ResolverSpec]:
    return [ResolverSpec("rl-update", _build, "the RL example's policy-update tasks")]


@hookimpl
def dataflow_trainer_kinds() -> list[TrainerKindSpec]:
    return [
        TrainerKindSpec(
            "rl",
            "a GRPO/PPO policy update on a rollouts folder (the RL example)",
            _open,
            LOAD_ARGS,
            STEP_ARGS,
        )
    ]
