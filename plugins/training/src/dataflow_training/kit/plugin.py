"""One helper for a family package's entry-point module: the ``dataflow_families`` hook that
registers the family, loading its code lazily.

A family's ``plugin.py`` is then two lines::

    from dataflow_training.kit import family_plugin

    dataflow_families = family_plugin(
        "llama3", "Llama 3 (...)", "dataflow_family_llama3.family:Llama3Family"
    )

Kept light on purpose (dataflow imports every entry-point module on each CLI call): this
module imports neither torch nor the family; ``load`` imports the family's module and
makes its object when the family is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dataflow import FamilySpec, hookimpl


def lazy(target: str | Callable[[], Any]) -> Callable[[], Any]:
    """A ``FamilySpec.load``: import ``"module:Class"`` and make a ``Class()`` (a class or
    function given instead of its name is called as it is: code that has it at hand)."""
    if callable(target):
        return target
    module, _, attribute = target.partition(":")
    if not module or not attribute:
        raise ValueError(f"a family's load target is 'module:Class', got {target!r}")

    def load() -> Any:
        return getattr(importlib.import_module(module), attribute)()

    return load


def family_plugin(
    name: str, description: str, target: str | Callable[[], Any]
) -> Callable[[], list[FamilySpec]]:
    """The ``dataflow_families`` hook implementation registering family ``name`` (its
    object made by ``lazy(target)``); assign it to ``dataflow_families`` in the
    entry-point module."""
    spec = FamilySpec(name=name, description=description, load=lazy(target))

    @hookimpl
    def dataflow_families() -> list[FamilySpec]:
        return [spec]

    return dataflow_families
