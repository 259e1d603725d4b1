"""The module the ``dataflow`` entry point names: it only registers the qwen3 family.

Kept tiny on purpose (dataflow imports it on every CLI call): torch and the model code are
imported by ``load`` when the family is used.
"""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl
from dataflow.registry import FamilySpec


def load() -> Any:
    from dataflow_family_qwen3.family import Qwen3Family

    return Qwen3Family()


@hookimpl
def dataflow_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name="qwen3",
            description="Qwen 3 dense (0.6B to 8B, a tiny CPU preset); HF safetensors "
            "import/export",
            load=load,
        )
    ]
