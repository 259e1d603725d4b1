"""One-off investigations: each script answered one question once, and its docstring's
first line says which and when (the date and the session from its git history), the
next lines what the answer was and where it is written up. Kept so that the question can
be asked again: run one from the repository root as ``python -m benchmarks.probes.NAME``.
A probe whose answer later work superseded says so; it is not kept working by CI unless
a test under tests/benchmarks/ runs it."""
