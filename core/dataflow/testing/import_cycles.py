"""Import circles in a package, found by reading its source (nothing is imported).

``imports_in(root, package)`` lists every import between the modules under ``root`` (the
folder of ``package``): each ``import`` and ``from ... import`` statement anywhere in a
file (module level, inside functions, under ``if TYPE_CHECKING``), relative or absolute.
An import names the longest module it spells (``import a.b.c`` of ``a.b`` when ``a.b.c`` is
a class); ``from pkg import name`` is an import of the submodule ``pkg.name`` when there is
one, else of ``pkg``. The package ``__init__`` that Python runs before a submodule is not
counted (every submodule would import it), only the ones a statement names.

``import_cycles(root, package)`` returns the circles: each strongly connected component of
that graph with more than one module, its modules sorted. Command line (one circle a
line, then the imports that close it)::

    python -m dataflow.testing.import_cycles core/dataflow dataflow
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class Import(NamedTuple):
    """``importer`` imports ``imported`` at ``path``:``line``."""

    importer: str
    imported: str
    path: Path
    line: int


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by its dotted name (``package.sub.module``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_in(root: Path | str, package: str) -> list[Import]:
    """Every import of one module under ``root`` by another (module doc)."""
    modules = module_files(Path(root), package)
    found: dict[Import, None] = {}  # in order, each once
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, is_package):
                imported = _known(target, modules)
                if imported is not None and imported != name:
                    found[Import(name, imported, path, node.lineno)] = None
    return list(found)


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement names (``from pkg import name``: ``pkg.name``,
    which ``_known`` cuts back to ``pkg`` when ``name`` is no module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    # ``from pkg import name``: the submodule pkg.name when there is one, else pkg
    return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def _known(target: str, modules: dict[str, Path]) -> str | None:
    """The longest module of ``modules`` that ``target`` starts with (None: none)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_cycles(root: Path | str, package: str) -> list[tuple[str, ...]]:
    """The circles of imports under ``root``: every strongly connected component of more
    than one module, each sorted, in sorted order."""
    modules = module_files(Path(root), package)
    return strongly_connected(
        modules, ((i.importer, i.imported) for i in imports_in(root, package))
    )


def strongly_connected(
    nodes: Iterable[str], edges: Iterable[tuple[str, str]]
) -> list[tuple[str, ...]]:
    """The components of more than one node of a directed graph (Tarjan's algorithm,
    without recursion), each sorted, in sorted order."""
    successors: dict[str, list[str]] = {node: [] for node in nodes}
    for source, target in edges:
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(successors):
        if start in index:
            continue
        work = [(start, iter(sorted(set(successors[start]))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            following = next(pending, None)
            if following is not None:
                if following not in index:
                    index[following] = low[following] = len(index)
                    stack.append(following)
                    on_stack.add(following)
                    work.append((following, iter(sorted(set(successors[following])))))
                elif following in on_stack:
                    low[node] = min(low[node], index[following])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(tuple(sorted(component)))
    return sorted(components)


def describe(root: Path | str, package: str) -> str:
    """Each circle on a line, then the imports between its modules (empty: none)."""
    lines = []
    found = imports_in(root, package)
    for cycle in import_cycles(root, package):
        lines.append(f"{len(cycle)} modules: {', '.join(cycle)}")
        members = set(cycle)
        for item in found:
            if item.importer in members and item.imported in members:
                lines.append(f"  {item.importer} -> {item.imported} ({item.path}:{item.line})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root, package = argv
    report = describe(root, package)
    print(report or f"no import circles in {package} ({root})")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
