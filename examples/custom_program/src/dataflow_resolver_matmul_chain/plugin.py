"""Entry-point module: registers the resolver; imports torch only when it is built."""

from __future__ import annotations

from dataflow import ResolverSpec, hookimpl


def _build(program):
    from dataflow_resolver_matmul_chain.resolver import build

    return build(program)


@hookimpl
def dataflow_resolvers() -> list[ResolverSpec]:
    return [ResolverSpec("matmul-chain", _build, "the example matmul chain's three keys")]
