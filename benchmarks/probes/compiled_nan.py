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
- ``after a failed capture``: the same, after a capture that a host read broke, in the
  same process (torch's ``capture_end`` raises before it ends the allocators' routing to
  the capture's pool, and the pool is never released: the state an MoE float32 run, whose
  captures fail by design, leaves every later test of its pytest worker);
- ``after olmoe fp32``: the same, after olmoe_tiny's float32 checks (whose captures fail)
  in the same process without a reset between, as a pytest worker runs them;
- ``rotary guard off``: ``rotary.cached_tables`` keeps every table, as before session 44;
- ``engine capture off``: the engine dispatches every step (no step graph);
- ``profiling capture off``: the profiling pass times dispatched launches (no task graphs);
- ``profile cache warm``: a second run of ``as is`` over the profiles the first one kept
  (no task of the pass runs at all, as in most pytest-xdist workers);
- ``eager resolver``: ``resolver="torch"`` (not compiled).

Each (case, variant) runs in a process of its own, so that no variant inherits another's
state. After it was written, an unordered zero fill of the engine's per-step values
buffer was found and fixed (``DeviceValues``, commit baf0b56): a race that eight pytest
processes sharing the GPU make likely and one process alone hardly ever shows, so every
variant here passing is what that cause predicts; the gpu tests under ``-n 8`` are its
check. Each line: the case, the variant, how many checks failed, whether any was NaN, and the
first three failing checks::

    python -m benchmarks.probes.compiled_nan [--cases llama3:llama3_tiny:fp32,...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

CASES = "llama3:llama3_tiny:fp32"
VARIANTS = (
    "as is",
    "after a failed capture",
    "after olmoe fp32",
    "rotary guard off",
    "engine capture off",
    "profiling capture off",
    "profile cache warm",
    "eager resolver",
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


def one(
    family_name: str,
    preset: str,
    policy: str,
    variant: str,
    cache: str,
    device: str,
    clean: bool = True,
) -> str:
    """The step checks of one case under one variant; ``cache``: the profile cache folder
    (used by ``profile cache warm`` and its filling run alone); ``clean``: dynamo's caches
    and the RoPE tables emptied first."""
    from dataflow_training import TOLERANCES, step_checks
    from dataflow_training.kit import rotary

    from dataflow import families

    if clean:
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


def fail_a_capture(device: str) -> str:
    """A capture broken by a host read, ended as the engine ends one (its generators
    taken out of capture mode); what it raised."""
    from dataflow.engine.engine import _end_generator_capture

    x = torch.ones(4, device=device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            x.sum().item()
    except Exception as exc:  # noqa: BLE001 - the failure is the point
        said = str(exc).splitlines()[0]
    else:
        said = "nothing (the capture did not fail)"
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    _end_generator_capture(torch.device(device))
    return said


def run_one(case: str, variant: str, cache: str, device: str) -> str:
    """One (case, variant) in this process."""
    family_name, preset, policy = case.split(":")
    said = ""
    if variant == "after a failed capture":
        said = f"[capture raised: {fail_a_capture(device)}] "
        variant = "as is"
    elif variant == "after olmoe fp32":
        said = f"[olmoe first: {one('olmoe', 'olmoe_tiny', 'fp32', 'as is', cache, device)}] "
        return said + one(family_name, preset, policy, "as is", cache, device, clean=False)
    elif variant == "profile cache warm":  # fill the cache first, then the case
        with contextlib.suppress(Exception):
            one(family_name, preset, policy, "fill", cache, device)
    return said + one(family_name, preset, policy, variant, cache, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES, help="family:preset:policy, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda", help="cpu: a check of the probe itself")
    p.add_argument("--one", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # a child: one (case, variant), its line printed
        case, variant = args.one
        started = time.monotonic()
        try:
            said = run_one(case, variant, args.cache, args.device)
        except Exception:  # noqa: BLE001 - a probe reports every case
            said = "raised:\n" + traceback.format_exc()
        print(f"{case} | {variant} | {time.monotonic() - started:.0f} s | {said}", flush=True)
        return
    for case in args.cases.split(","):
        for variant in args.variants.split(","):
            cache = tempfile.mkdtemp(prefix="compiled_nan_profiles_")
            command = [sys.executable, "-m", "benchmarks.probes.compiled_nan", "--one", case]
            command += [variant, "--device", args.device, "--cache", cache]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if " | " in line]
            if not lines:  # the child died before its line: its exit and last error line
                last = done.stderr.strip().splitlines()[-1:]
                lines = [f"{case} | {variant} | exit {done.returncode}: {last}"]
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
