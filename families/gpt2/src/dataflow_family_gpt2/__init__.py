"""dataflow-family-gpt2: GPT-2 as a dataflow model family.

The entry point is ``dataflow_family_gpt2.plugin`` (tiny: it registers the family); the
family object is ``dataflow_family_gpt2.family.GPT2Family``. Importing this package imports
nothing heavy: torch loads with every module but ``config`` and ``plugin``.
"""
