"""The package passes dataflow's conformance tests for resolver plugins (among them: its
entry-point module imports no torch)."""

import pytest
from dataflow_resolver_matmul_chain.chain import build_program

from dataflow.testing import ResolverConformance


class TestMatmulChainResolver(ResolverConformance):
    distribution = "dataflow-resolver-matmul-chain"
    expected_names = ("matmul-chain",)

    @pytest.fixture
    def program(self):
        """The chain whose three compute keys the resolver knows."""
        return build_program(layers=2, dim=4, batch=4)
