"""Lazy re-exports for the facades (PEP 562); the plugins' facades use it too, through
``dataflow.lazy_exports`` and ``dataflow.exported``.

A facade names each public name's home module; the home is imported when the name is
first used, so importing a facade costs no more than importing this module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    facade: str, homes: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of module ``facade``, re-exporting each name of
    ``homes`` (home module -> names) from its home when first used (then kept); ``__dir__``
    lists the facade's ``__all__`` too."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home_of.get(name)
        if module is None:
            raise AttributeError(f"module {facade!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[facade], name, value)
        return value

    def __dir__() -> list[str]:
        module = sys.modules[facade]
        return sorted({*vars(module), *module.__all__})

    return __getattr__, __dir__


def exported(homes: Mapping[str, Iterable[str]]) -> list[str]:
    """Every name of ``homes``, in order (what a facade's ``__all__`` lists)."""
    return [name for names in homes.values() for name in names]
