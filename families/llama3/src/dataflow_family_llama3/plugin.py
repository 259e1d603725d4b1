"""The module the ``dataflow`` entry point names: it only registers the llama3 family.

Kept tiny on purpose (dataflow imports it on every CLI call): torch and the model code are
imported by ``load`` when the family is used.
"""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl
from dataflow.registry import FamilySpec


def load() -> Any:
    from dataflow_family_llama3.family import Llama3Family

    return Llama3Family()


@hookimpl
def dataflow_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name="llama3",
            description="Llama 3 (3.2 1B and 3B, 3.1 8B, a tiny CPU preset); HF safetensors "
            "import/export",
            load=load,
        )
    ]
