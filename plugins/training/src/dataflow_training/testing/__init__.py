"""For family and kit authors' tests: conformance bases, toy families, the docs generator."""
