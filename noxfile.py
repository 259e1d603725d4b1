"""Every developer and CI entry point: ``nox -s tests``, ``nox -s lint``, ``nox -s demo``.

Sessions install torch 2.13.0 (a CPU build) before the project, so pip never resolves
``torch>=2.11`` to a multi-gigabyte CUDA build on a CPU-only machine.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
PLUGIN_FOLDERS = ("families", "resolvers", "kernels", "plugins")
EXAMPLE_PACKAGES = ("examples/third_party_plugin", "examples/custom_program")

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def plugin_packages() -> list[str]:
    """Every plugin distribution in the monorepo: a folder with its own pyproject.toml."""
    found = []
    for folder in PLUGIN_FOLDERS:
        for pyproject in sorted((ROOT / folder).glob("*/pyproject.toml")):
            found.append(str(pyproject.parent.relative_to(ROOT)))
    return found


def install_project(session: nox.Session, *, examples: bool = False) -> None:
    session.install(TORCH_CPU)
    editable = [".", *plugin_packages()]
    if examples:
        editable += [path for path in EXAMPLE_PACKAGES if (ROOT / path / "pyproject.toml").exists()]
    args = []
    for path in editable:
        args += ["-e", path]
    session.install(*args, "pytest>=8", "hypothesis>=6.100")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole CPU test suite (GPU tests skip themselves without CUDA)."""
    install_project(session, examples=True)
    session.install("transformers>=4.40")  # families/gpt2's HF checkpoint round trip
    suites = ["tests", *plugin_packages(), *EXAMPLE_PACKAGES]  # every package's own tests
    session.run("pytest", *(session.posargs or ["-q", *suites]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on its embedded default: no download, runs on CPU."""
    install_project(session)
    session.run("python", "examples/demo.py", *session.posargs)
