"""The module the ``dataflow`` entry point names: it only registers the olmoe family.

Kept tiny on purpose (dataflow imports it on every CLI call): torch and the model code are
imported by ``load`` when the family is used.
"""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl
from dataflow.registry import FamilySpec


def load() -> Any:
    from dataflow_family_olmoe.family import OlmoeFamily

    return OlmoeFamily()


@hookimpl
def dataflow_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name="olmoe",
            description="OLMoE mixture of experts (1B-7B, a tiny CPU preset); HF safetensors "
            "import/export",
            load=load,
        )
    ]
