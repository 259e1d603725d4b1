"""Every developer and CI entry point: ``nox -s tests``, ``nox -s lint``, ``nox -s demo``,
``nox -s wheels isolated``.

Sessions install torch 2.13.0 (a CPU build) before the project, so pip never resolves
``torch>=2.11`` to a multi-gigabyte CUDA build on a CPU-only machine.

``wheels`` builds every distribution of the repository (the core and each folder with a
``pyproject.toml`` under families/ resolvers/ kernels/ plugins/ examples/) into ``dist/``,
plus the third-party wheels they need (torch aside) into ``dist/deps/``. ``isolated`` then
gives each distribution a fresh virtual environment that installs only that wheel, and
what it declares, from those two folders with no package index (torch, pinned, is the one
exception: installed once from the normal pip config and shared by every environment that
needs it, see ``_add_shared_torch``): it imports the package, finds it ``ok`` in
``dataflow plugins list`` and runs the smoke commands its pyproject lists under
``[tool.dataflow.isolated]`` (for a model family a real ``dataflow train`` on the
embedded default data), all before its ``test`` extra is installed, and then its own
tests. A distribution whose requirements
(followed through the other distributions here) need no torch gets none, which is how the
core is checked to plan and simulate without torch.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
from functools import cache
from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
TEST_TOOLS = ("pytest>=8", "hypothesis>=6.100")
PLUGIN_FOLDERS = ("families", "resolvers", "kernels", "plugins")
DIST = ROOT / "dist"
DEPS = DIST / "deps"
SHARED_TORCH = ROOT / ".nox" / f"shared-{TORCH_CPU.replace('==', '-')}"  # see isolated
#: The main job, the README's first command: GPT-2 tiny really trained on the embedded
#: corpus (no download) on the CPU, in a 2 MiB fast-memory budget
MAIN_JOB = (
    "dataflow train --preset gpt2_tiny --steps 300 --lr 2e-3 --warmup 20 --budget 2MiB "
    "--device cpu --out runs/main"
)

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _packages_under(*folders: str) -> list[str]:
    found = []
    for folder in folders:
        for pyproject in sorted((ROOT / folder).glob("*/pyproject.toml")):
            found.append(pyproject.parent.relative_to(ROOT).as_posix())
    return found


def plugin_packages() -> list[str]:
    """Every plugin distribution in the monorepo: a folder with its own pyproject.toml."""
    return _packages_under(*PLUGIN_FOLDERS)


def example_packages() -> list[str]:
    """The example distributions (a third-party planner, a custom program's resolver)."""
    return _packages_under("examples")


def distribution_folders() -> list[str]:
    """The core (``.``) and every other distribution of the repository."""
    return [".", *plugin_packages(), *example_packages()]


def install_project(session: nox.Session, *, examples: bool = False) -> None:
    session.install(TORCH_CPU)
    editable = [".", *plugin_packages(), *(example_packages() if examples else [])]
    args = []
    for path in editable:
        args += ["-e", path]
    session.install(*args, *TEST_TOOLS)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole CPU test suite (GPU tests skip themselves without CUDA).

    Two worker processes (CI's two cores), each taking whole files (``--dist loadfile``: a
    module's fixtures are built once), then the tests marked ``alone`` (timing
    comparisons) in one process with nothing beside them; posargs replace all of it, e.g. ``nox -s tests --
    -q tests/cli`` for one folder in one process."""
    install_project(session, examples=True)
    session.install("transformers>=4.40")  # the families' HF checkpoint and parity tests
    session.install("peft>=0.21")  # LoRA's export is loaded by peft (plugins/training)
    # the viewer's browser tests drive the system's chromium (.ci/run installs it); no
    # browser download: playwright is only the driver
    session.install("playwright>=1.40", "pytest-xdist>=3.5")
    suites = ["tests", *plugin_packages(), *example_packages()]  # every package's own tests
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    session.run("pytest", "-q", "-n", "2", "--dist", "loadfile", "-m", "not alone", *suites)
    # the timing comparisons (marker ``alone``) with no second worker beside them: CI's
    # two cores busy with the other worker's tests made a measured step 2.2x its
    # prediction in three tries running (the prediction-ratio test of tests/engine)
    session.run("pytest", "-q", "-m", "alone", *suites)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on its embedded default (no download, runs on CPU; ``MAIN_JOB``, the
    README's first command), then ``examples/demo.py``: plans at shrinking budgets and
    GPT-2 tiny checked against plain PyTorch."""
    install_project(session)
    earlier = ROOT / "runs" / "main"
    if earlier.exists():  # an earlier demo's run: the command would refuse its folder
        aside = earlier.with_name(f"main.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        earlier.rename(aside)
        session.log(f"moved the earlier demo's run aside to {aside}")
    session.run(*MAIN_JOB.split())
    session.run("python", "examples/demo.py", *session.posargs)


# -- distributions ----------------------------------------------------------------------------
def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name_and_extras(requirement: str) -> tuple[str, tuple[str, ...]]:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    if match is None:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    extras = tuple(_canonical(extra) for extra in (match[2] or "").split(",") if extra.strip())
    return _canonical(match[1]), extras


@cache
def project_table(folder: str) -> dict:
    """The ``[project]`` table of ``folder``'s pyproject.toml, plus its ``[tool.dataflow]``."""
    data = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())
    return {**data["project"], "tool": data.get("tool", {}).get("dataflow", {})}


@cache
def distributions() -> dict[str, str]:
    """Canonical distribution name -> folder, for every distribution of the repository."""
    return {_canonical(project_table(folder)["name"]): folder for folder in distribution_folders()}


def _requirements(name: str, extras: tuple[str, ...] = ()) -> list[str]:
    table = project_table(distributions()[name])
    optional = table.get("optional-dependencies", {})
    return [*table.get("dependencies", []), *(r for extra in extras for r in optional[extra])]


def needs_torch(name: str, extras: tuple[str, ...] = ()) -> bool:
    """Whether installing ``name[extras]`` pulls torch, following our own distributions."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(name, extras)]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for requirement in _requirements(*current):
            dependency, dependency_extras = _requirement_name_and_extras(requirement)
            if dependency == "torch":
                return True
            if dependency in distributions():
                todo.append((dependency, dependency_extras))
    return False


def third_party_requirements() -> list[str]:
    """What the distributions here require from elsewhere (every extra included), less torch."""
    found = set()
    for folder in distribution_folders():
        table = project_table(folder)
        for requirement in [
            *table.get("dependencies", []),
            *(r for extra in table.get("optional-dependencies", {}).values() for r in extra),
        ]:
            dependency, _ = _requirement_name_and_extras(requirement)
            if dependency != "torch" and dependency not in distributions():
                found.add(requirement)
    return sorted(found)


# How setuptools announces a pyproject form it is retiring (the licence as a table, licence
# classifiers, ...): "WARNING `project.license` as a TOML table is deprecated", then a "!!"
# box. A build that prints one fails the session.
BUILD_WARNING = re.compile(r"^WARNING\b|Deprecat|^!!")


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every distribution's sdist and wheel into dist/ (third-party wheels: dist/deps/).

    Each wheel is built from its sdist, so an sdist that leaves a file out fails here."""
    session.install("build>=1.2", "setuptools>=77")
    shutil.rmtree(DIST, ignore_errors=True)
    for folder in distribution_folders():
        output = session.run(
            *("python", "-m", "build", "--no-isolation", "--outdir", str(DIST), folder),
            silent=True,
        )
        warned = [line for line in output.splitlines() if BUILD_WARNING.search(line)]
        if warned:
            session.error(f"building {folder} warned:\n" + "\n".join(warned))
        session.log(f"built {folder}: {output.strip().splitlines()[-1]}")
    session.run(
        *("python", "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(DEPS)),
        *third_party_requirements(),
        silent=True,
    )
    if any(DEPS.glob("torch-*")):
        session.error("a third-party requirement pulled torch into dist/deps")


def _isolated_id(folder: str) -> str:
    return project_table(folder)["name"]


@nox.session(reuse_venv=False)
@nox.parametrize("folder", distribution_folders(), ids=map(_isolated_id, distribution_folders()))
def isolated(session: nox.Session, folder: str) -> None:
    """One distribution alone in a fresh environment, installed from dist/ with no index.

    The wheel goes in with what it declares and nothing else: the import, ``plugins list``
    and smoke checks run before the ``test`` extra and the test tools are added for its own
    tests, so an extra cannot hide a missing runtime requirement."""
    if not any(DIST.glob("*.whl")):
        session.error("no wheels in dist/: run `nox -s wheels` first")
    table = project_table(folder)
    name = _canonical(table["name"])
    extras = ("test",) if "test" in table.get("optional-dependencies", {}) else ()
    tests = (ROOT / folder / "tests").is_dir() and folder != "."  # the core's: `nox -s tests`
    with_torch = needs_torch(name)
    if with_torch:
        _add_shared_torch(session)
    _install_from_dist(session, table["name"])  # alone: no extras
    installed = session.run("python", "-m", "pip", "list", "--format=freeze", silent=True)
    session.log("installed: " + ", ".join(installed.split()))
    _check_imports(session, folder)
    _check_listed(session, table["name"])
    tmp = session.create_tmp()
    for command in _smoke_commands(session, folder):
        session.run(*(part.replace("{tmp}", tmp) for part in command))
    if not with_torch:
        _check_torch_is_absent(session)
    if tests:
        if not with_torch and needs_torch(name, extras):
            _add_shared_torch(session)
        session.install("--no-compile", *TEST_TOOLS)
        if extras:
            _install_from_dist(session, f"{table['name']}[{','.join(extras)}]")
        session.run("pytest", "-q", "-p", "no:cacheprovider", f"{folder}/tests")
    # Passed: its environment (a few hundred MB with transformers) is not kept, so a run of
    # every distribution never holds more than one at a time. A failed one stays to look at.
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _install_from_dist(session: nox.Session, requirement: str) -> None:
    """Install ``requirement`` from dist/ and dist/deps/ only (no package index).

    ``--no-compile``: pip byte-compiles every module it installs, which for transformers
    (thousands of modules, a few dozen of them imported here) took most of a minute per
    environment; Python compiles what is imported when it is imported."""
    session.install(
        *("--no-compile", "--no-index", "--only-binary", ":all:", "--find-links", str(DIST)),
        *("--find-links", str(DEPS), requirement),
    )


def _smoke_commands(session: nox.Session, folder: str) -> list[list[str]]:
    """The commands ``[tool.dataflow.isolated] smoke`` lists; ``{tmp}`` is a scratch folder.

    A family must list a ``dataflow train`` there (on the embedded default data, no
    ``--data``): that is the check that installing the family alone gives a working train."""
    smoke = project_table(folder)["tool"].get("isolated", {}).get("smoke", [])
    trains = any(
        command[:2] == ["dataflow", "train"] and "--data" not in command for command in smoke
    )
    if folder.startswith("families/") and not trains:
        session.error(
            f"{folder}/pyproject.toml: [tool.dataflow.isolated] smoke lists no `dataflow train` "
            "command, which is what shows the family trains when installed alone; add e.g. "
            '["dataflow", "train", "--preset", "NAME_tiny", "--steps", "3", "--device", "cpu", '
            '"--out", "{tmp}/run"]'
        )
    return smoke


def _add_shared_torch(session: nox.Session) -> None:
    """Make the pinned CPU torch importable here, from one install every environment shares.

    torch comes from the normal pip config, pinned, and is installed (and byte-compiled)
    once, into a folder that a ``.pth`` file adds to this environment's path: pip sees it
    as installed, so no requirement can make pip look for another torch, and five
    environments do not unpack the same 200 MB wheel five times."""
    shared, done = SHARED_TORCH, SHARED_TORCH / "INSTALLED"
    if not done.exists():
        shutil.rmtree(shared, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "--quiet", "--target", str(shared), TORCH_CPU)
        done.write_text(f"{TORCH_CPU}\n")
    site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    (Path(site.strip()) / "shared_torch.pth").write_text(f"{shared}\n")


def _check_imports(session: nox.Session, folder: str) -> None:
    """Import each top-level package of the distribution, from site-packages (the wheel)."""
    source = ROOT / folder / ("core" if folder == "." else "src")
    modules = sorted(path.parent.name for path in source.glob("*/__init__.py"))
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    module = importlib.import_module(name)\n"
        "    assert 'site-packages' in module.__file__, f'{name} from {module.__file__}'\n"
        "    print(name, 'from', module.__file__)\n"
    )
    session.run("python", "-c", code, *modules)


def _check_listed(session: nox.Session, distribution: str) -> None:
    """``dataflow plugins list`` shows the distribution, and no plugin there is broken."""
    output = session.run("dataflow", "plugins", "list", "--json", silent=True, stderr=None)
    listed = json.loads(output)["plugins"]
    statuses = {plugin["distribution"]: plugin["status"] for plugin in listed}
    if statuses.get(distribution) != "ok" or any(s != "ok" for s in statuses.values()):
        session.error(f"dataflow plugins list: {statuses} (wanted {distribution!r} ok)")
    session.log(f"dataflow plugins list: {statuses}")


def _check_torch_is_absent(session: nox.Session) -> None:
    """No torch here: it is not importable, and an engine command says what to install."""
    session.run(
        "python", "-c", "import importlib.util as u, sys; sys.exit(bool(u.find_spec('torch')))"
    )
    program = "examples/programs/training_step.json"
    output = session.run(
        *("dataflow", "trace", program, "--resolver", "torch"), success_codes=[1], silent=True
    )
    if "pip install 'dataflow-runtime[torch]'" not in output:
        session.error(f"`dataflow trace` without torch did not say what to install:\n{output}")
    session.log(f"without torch, `dataflow trace` says: {output.strip()}")
