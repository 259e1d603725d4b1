"""The package's entry point: the resolver ``rl-update``, so that ``dataflow trace`` and
``dataflow plan --measured --resolver rl-update`` run an update's program written to JSON
(``dataflow-rl lower``). Light: the resolver is built, and torch imported, on first use."""

from __future__ import annotations

from typing import Any

from dataflow import ResolverSpec, hookimpl


def _build(program: Any) -> Any:
    from dataflow_rl_example.tasks import build_from_program  # imports torch

    return build_from_program(program)


@hookimpl
def dataflow_resolvers() -> list[ResolverSpec]:
    return [ResolverSpec("rl-update", _build, "the RL example's policy-update tasks")]
