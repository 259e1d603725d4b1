"""No import circles in the core (ARCHITECTURE.md section 2, rule 4).

Every import counts: module level and inside functions, relative and absolute,
``from pkg import submodule`` as an import of the submodule
(``dataflow.testing.import_cycles``). To list the circles and the imports that close
them::

    python -m dataflow.testing.import_cycles core/dataflow dataflow
"""

from __future__ import annotations

from pathlib import Path

from dataflow.testing.import_cycles import describe, import_cycles, imports_in, main

CORE = Path(__file__).resolve().parents[2] / "core" / "dataflow"


def test_the_core_has_no_import_circles() -> None:
    assert import_cycles(CORE, "dataflow") == [], describe(CORE, "dataflow")


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_finder_sees_planted_circles(tmp_path: Path, capsys) -> None:
    """Three circles, each closed by an import of another kind: a function-local relative
    one, a submodule named by ``from pkg import``, one under ``TYPE_CHECKING``; and imports
    that close none (a name from a package's ``__init__``, the standard library)."""
    package = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import os\nfrom pkg.b import helper\n",
            "pkg/b.py": "def helper():\n    from . import a\n    return a\n",
            "pkg/sub/__init__.py": "from pkg import d\n",
            "pkg/d.py": "import pkg.sub.e\n",
            "pkg/sub/e.py": "from .. import sub\n",
            "pkg/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.g import G\n",
            "pkg/g.py": "from pkg.f import *\nfrom pkg import a\n",
            "pkg/h.py": "from pkg import a, b\nfrom pkg.sub import d as named\n",
        },
    )
    assert import_cycles(package, "pkg") == [
        ("pkg.a", "pkg.b"),
        ("pkg.d", "pkg.sub", "pkg.sub.e"),
        ("pkg.f", "pkg.g"),
    ]
    edges = {(i.importer, i.imported, i.line) for i in imports_in(package, "pkg")}
    assert ("pkg.b", "pkg.a", 2) in edges  # inside a function, relative
    assert ("pkg.sub", "pkg.d", 1) in edges  # from pkg import <submodule>
    assert ("pkg.h", "pkg.sub", 2) in edges  # a name from a package: its __init__
    assert not any(importer == "pkg.a" and line == 1 for importer, _, line in edges)  # os
    assert "pkg.b -> pkg.a (" in describe(package, "pkg")
    assert main([str(package), "pkg"]) == 1
    assert "3 modules: pkg.d, pkg.sub, pkg.sub.e" in capsys.readouterr().out


def test_a_package_without_circles_reports_none(tmp_path: Path) -> None:
    package = _plant(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "x = 1\n"})
    assert import_cycles(package, "pkg") == [] and describe(package, "pkg") == ""
    assert main([str(package), "pkg"]) == 0
