"""Test kit for dataflow and its plugin authors (a pytest plugin plus conformance bases)."""
