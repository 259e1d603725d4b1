"""A hand-built matmul chain, its resolver and its plain-autograd reference."""

from dataflow_resolver_matmul_chain.chain import build_program, initial_values

__all__ = ["build_program", "initial_values"]
