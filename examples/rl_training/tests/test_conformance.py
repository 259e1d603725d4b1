"""The package passes dataflow's conformance tests for resolver plugins (among them: its
entry-point module imports no torch)."""

import pytest
from dataflow_rl_example import lower_update
from dataflow_training import load_family

from dataflow.testing import ResolverConformance


class TestRLUpdateResolver(ResolverConformance):
    distribution = "dataflow-rl-example"
    expected_names = ("rl-update",)

    @pytest.fixture
    def program(self):
        """An update of the tiny Llama whose compute keys the resolver knows."""
        family = load_family("llama3")
        return lower_update(family, family.config("llama3_tiny"), rows=2, length=4).program
