"""Probe, 2026-12-08 (session 45): why do the compiled resolver's gpu tests give NaN on CUDA?

On an H100 (session 45, ``pytest -n 8 -m gpu resolvers/torch/tests/test_compiled.py``)
``test_compiled_tiny_steps_match_the_reference_on_cuda`` failed for llama3_tiny, olmoe_tiny
and qwen3_moe_tiny in float32 (every weight NaN after the first step; olmoe's first
routing NaN) while gpt2_tiny (no RoPE) passed, and the routing and bf16 MoE tests failed
for some families and passed for others in the same run. The same checks on the CPU
with inductor pass. This runs the tests' step checks one case after another in one
process, each from a clean state (dynamo reset, RoPE table cache emptied, no profile
cache unless the case says so), under variants that each take one suspect away:

- ``as is``: the tests' own call;
- ``rotary guard off``: ``rotary.cached_tables`` keeps every table, as before session 44;
- ``engine capture off``: the engine dispatches every step (no step graph);
- ``profiling capture off``: the profiling pass times dispatched launches (no task graphs);
- ``profile cache warm``: a second run of ``as is`` over the profiles the first one kept
  (no task of the pass runs at all, as in most pytest-xdist workers);
- ``eager resolver``: ``resolver="torch"`` (not compiled);
- ``no reset``: ``as is`` without the clean state (dynamo's caches and the RoPE tables
  of every case before it kept, as one pytest worker keeps them from test to test).

Each line: the case, the variant, how many checks failed, whether any was NaN, and the
first three failing checks::

    python -m benchmarks.probes.compiled_nan [--cases llama3:llama3_tiny:fp32,...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import traceback

import torch

CASES = "llama3:llama3_tiny:fp32,olmoe:olmoe_tiny:fp32"
VARIANTS = (
    "as is",
    "rotary guard off",
    "engine capture off",
    "profiling capture off",
    "profile cache warm",
    "eager resolver",
    "no reset",
)


@contextlib.contextmanager
def patched(variant: str):
    """The variant's one change, undone after."""
    from dataflow_training.kit import rotary
    from dataflow_training.plan import profile

    from dataflow.engine.engine import Engine

    def refuse(*args, **kwargs):
        raise RuntimeError("profiling capture off (probe)")

    swaps = {
        "rotary guard off": (rotary, "_capturing", lambda device: False),
        "engine capture off": (Engine, "_may_capture", lambda self, values: False),
        "profiling capture off": (profile, "_replayed_us", refuse),
    }
    swap = swaps.get(variant)
    if swap is None:
        yield
        return
    owner, name, value = swap
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def one(family_name: str, preset: str, policy: str, variant: str, cache: str, device: str) -> str:
    """The step checks of one case under one variant; ``cache``: the profile cache folder
    (used by ``profile cache warm`` and its filling run alone)."""
    from dataflow_training import TOLERANCES, step_checks
    from dataflow_training.kit import rotary

    from dataflow import families

    if variant != "no reset":
        torch._dynamo.reset()
        rotary._TABLES.clear()
    warm = variant in ("profile cache warm", "fill")
    os.environ["DATAFLOW_PROFILE_CACHE"] = cache if warm else "off"
    torch.backends.cuda.matmul.allow_tf32 = False
    with patched(variant):
        checks = step_checks(
            families().get(family_name).load(),
            preset,
            device=device,
            policy=policy,
            steps=2,
            rounds=2,
            batch=2,
            seq_len=16,
            budget_bytes=None,
            seed=0,
            tolerance=TOLERANCES[policy]["step"],
            resolver="torch" if variant == "eager resolver" else "torch-compiled",
        )
    failed = [c for c in checks if not c.ok]
    nan = any(c.max_abs != c.max_abs for c in failed)
    shown = [(c.name, c.max_abs) for c in failed[:3]]
    return f"{len(failed)} of {len(checks)} failed, NaN {nan}: {shown}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES, help="family:preset:policy, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda", help="cpu: a check of the probe itself")
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix="compiled_nan_profiles_")
    for case in args.cases.split(","):
        family_name, preset, policy = case.split(":")
        for variant in args.variants.split(","):
            if variant == "profile cache warm":  # fill the cache first, then the case
                with contextlib.suppress(Exception):
                    one(family_name, preset, policy, "fill", cache, args.device)
            started = time.monotonic()
            try:
                said = one(family_name, preset, policy, variant, cache, args.device)
            except Exception:  # noqa: BLE001 - a probe reports every case
                said = "raised:\n" + traceback.format_exc()
            took = time.monotonic() - started
            print(f"{case} | {variant} | {took:.0f} s | {said}", flush=True)


if __name__ == "__main__":
    main()
