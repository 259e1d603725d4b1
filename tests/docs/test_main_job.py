"""The README's first command is the main job, and ``nox -s demo`` runs exactly it: real
training on the embedded default corpus, on the CPU, in a fast-memory budget. (The doc
test runs the command itself; this keeps the page and the nox session from drifting.)"""

from __future__ import annotations

import ast
import importlib.util
import json
import shlex
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _doc_blocks():
    """The doc test's own page reader (its ``blocks`` and ``commands``)."""
    spec = importlib.util.spec_from_file_location(
        "doc_blocks", Path(__file__).with_name("test_doc_blocks.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main_job() -> str:
    """``MAIN_JOB`` as noxfile.py spells it, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["MAIN_JOB"]:
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py has no MAIN_JOB")


def test_the_readme_starts_with_the_main_job_nox_demo_runs() -> None:
    pages = _doc_blocks()
    readme = pages.blocks(ROOT / "README.md")
    first = next(b for b in readme if b.lang == "bash" and b.not_run is None)
    assert pages.commands(first)[0] == _main_job()
    args = shlex.split(_main_job())
    assert args[:2] == ["dataflow", "train"]
    assert "--data" not in args  # the embedded default corpus
    assert args[args.index("--device") + 1] == "cpu"
    assert "--budget" in args  # the fast-memory peak is shown against a budget
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "session.run(*MAIN_JOB.split())" in noxfile.split("def demo(")[1].split("\ndef ")[0]


def test_the_readme_gpu_figures_are_those_of_the_run_it_names() -> None:
    readme = (ROOT / "README.md").read_text()
    log = "benchmarks/results/train_gpt2_124m_4GiB.log"
    assert log in readme
    lines = (ROOT / log.replace(".log", "_metrics.jsonl")).read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    tok_s = round(statistics.median(m["tok_s"] for m in metrics), -2)
    peak_gib = max(m["allocator_peak_bytes"] for m in metrics) / 2**30
    assert f"about {tok_s:,.0f} tokens/s" in readme
    assert f"allocator's peak at {peak_gib:.2f} GiB" in readme
    assert (
        f"from {metrics[0]['loss']:.2f} to {metrics[-1]['loss']:.2f} in {len(metrics)} steps"
        in readme
    )
