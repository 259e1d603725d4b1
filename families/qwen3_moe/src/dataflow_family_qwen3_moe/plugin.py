"""The module the ``dataflow`` entry point names: it only registers the qwen3_moe family.

Kept tiny on purpose (dataflow imports it on every CLI call): torch and the model code are
imported by ``load`` when the family is used.
"""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl
from dataflow.registry import FamilySpec


def load() -> Any:
    from dataflow_family_qwen3_moe.family import Qwen3MoeFamily

    return Qwen3MoeFamily()


@hookimpl
def dataflow_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name="qwen3_moe",
            description="Qwen 3 MoE (30B-A3B, a 12-layer cut, a tiny CPU preset); HF safetensors "
            "import/export",
            load=load,
        )
    ]
