"""The repository's benchmarks: standing ones here, one-off probes in ``probes/``, what
they share in ``harness/``, their results in ``results/`` (benchmarks/README.md maps each
script to the page and the results file it feeds).

A package, so that scripts import the harness normally: run each from the repository root
as ``python -m benchmarks.NAME`` (a probe: ``python -m benchmarks.probes.NAME``), where
the current folder is on ``sys.path`` and the project is installed (editable) as usual.
"""
