"""The README's list of distributions (its first ``pip install`` block, which the doc test
does not run: it would install packages) names only distributions of this checkout, with
extras their pyproject declares, and names every one a user installs: each family's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = re.compile(r"^pip install '?(?P<name>[\w.-]+)(\[(?P<extra>[\w,-]+)\])?'?\s", re.M)


def projects() -> dict[str, dict]:
    """Each pyproject's ``[project]`` table in the checkout, by distribution name."""
    found = {}
    for path in [ROOT / "pyproject.toml", *sorted(ROOT.glob("*/*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text()).get("project")
        if project:
            found[project["name"]] = project
    return found


def listed() -> list[tuple[str, str | None]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Installing", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [(m["name"], m["extra"]) for m in INSTALL.finditer(block)]


def test_the_readme_installs_distributions_of_this_checkout() -> None:
    known = projects()
    names = listed()
    assert len(names) >= 10, names  # the block was found and read
    for name, extra in names:
        assert name in known, f"README installs {name!r}: no pyproject in the checkout names it"
        if extra is not None:
            extras = known[name].get("optional-dependencies", {})
            assert set(extra.split(",")) <= set(extras), f"{name}[{extra}]: extras {extras}"
    families = {n for n in known if n.startswith("dataflow-family-")}
    assert families <= {n for n, _ in names}, families - {n for n, _ in names}
