"""Every code block of README.md, docs/*.md and examples/rl_training/README.md runs as
written.

Per page, in a scratch folder of its own (where ``examples``, ``tests`` and ``docs`` point
at the repository's), the blocks run in page order, so a later block may use a file or a
name an earlier one made:

- ``python``: executed, all of a page's blocks in one namespace;
- ``bash``: each command line run by the shell; it must exit 0, or the exit code its
  comment names (``# exits 1``);
- ``console``: the same for the lines after ``$ `` (the rest is sample output);
- ``json``: a program document: it must load, validate, simulate and plan;
- ``toml``: it must parse;
- ``text``: not code (directory trees, sample output, error messages): never run.

A block that cannot run here (it installs packages, needs a GPU, publishes) is preceded
by ``<!-- not run: REASON -->``, and its page says why in words.
"""

from __future__ import annotations
import __future__

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]
# the RL example's README is a walk-through an outside author follows step by step
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "examples" / "rl_training" / "README.md",
]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*\S)\s*-->\s*$")
LANGUAGES = {"python", "bash", "console", "json", "toml", "text"}
EXITS = re.compile(r"#.*\bexits (\d+)")


@attrs.frozen
class Block:
    page: Path
    line: int
    lang: str
    body: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        found.append(
            Block(
                page,
                text.count("\n", 0, match.start()) + 1,
                match["lang"],
                match["body"],
                marker["reason"] if marker else None,
            )
        )
    return found


@pytest.fixture(scope="module")
def sandboxes(tmp_path_factory) -> dict[Path, Path]:
    return {}


def sandbox(sandboxes: dict[Path, Path], tmp_path_factory, page: Path) -> Path:
    if page not in sandboxes:
        folder = tmp_path_factory.mktemp(page.stem)
        for name in ("examples", "tests", "docs"):
            (folder / name).symlink_to(ROOT / name)
        sandboxes[page] = folder
    return sandboxes[page]


def commands(block: Block) -> list[str]:
    lines = block.body.splitlines()
    if block.lang == "console":
        return [line[2:] for line in lines if line.startswith("$ ")]
    joined, pending = [], ""
    for line in lines:  # a trailing backslash continues the command
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if pending.strip() and not pending.lstrip().startswith("#"):
                joined.append(pending)
            pending = ""
    return joined


def run_shell(command: str, cwd: Path) -> None:
    wanted = int(EXITS.search(command)[1]) if EXITS.search(command) else 0
    env = {
        **os.environ,
        "COLUMNS": "120",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    result = subprocess.run(
        command, shell=True, cwd=cwd, capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == wanted, (
        f"`{command}` exited {result.returncode}, not {wanted}:\n{result.stdout}\n{result.stderr}"
    )
    assert "Traceback" not in result.stderr, result.stderr


def check_program_json(body: str, cwd: Path) -> None:
    from dataflow.planning import plan
    from dataflow.schema import Program, validate
    from dataflow.sim import simulate

    program = Program.from_dict(json.loads(body))
    assert validate(program) == []
    assert simulate(program).valid, simulate(program).error
    budget = program.budget.fast_bytes if program.budget else 2**30
    assert plan(program.bare(), budget).sim.valid


ALL = [block for page in PAGES for block in blocks(page)]
NAMESPACES: dict[Path, dict] = {}


def test_the_pages_have_blocks() -> None:
    assert len(ALL) > 30 and {block.lang for block in ALL} >= {"python", "bash", "text"}


@pytest.mark.parametrize("block", ALL, ids=[block.where for block in ALL])
def test_block(block: Block, sandboxes, tmp_path_factory, monkeypatch) -> None:
    assert block.lang in LANGUAGES, f"{block.where}: say what the block is: ```{sorted(LANGUAGES)}"
    if block.not_run is not None or block.lang == "text":
        assert block.lang != "text" or block.not_run is None, f"{block.where}: text never runs"
        return
    cwd = sandbox(sandboxes, tmp_path_factory, block.page)
    if block.lang == "toml":
        tomllib.loads(block.body)
    elif block.lang == "json":
        check_program_json(block.body, cwd)
    elif block.lang == "python":
        monkeypatch.chdir(cwd)
        namespace = NAMESPACES.setdefault(block.page, {"__name__": "__doc_example__"})
        flags = __future__.annotations.compiler_flag
        exec(compile(block.body, block.where, "exec", flags=flags), namespace)
    else:
        for command in commands(block):
            run_shell(command, cwd)
