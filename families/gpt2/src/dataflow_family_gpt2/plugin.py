"""The module the ``dataflow`` entry point names: it only registers the gpt2 family.

Kept tiny on purpose (dataflow imports it on every CLI call): torch and the model code are
imported by ``load`` when the family is used.
"""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl
from dataflow.registry import FamilySpec


def load() -> Any:
    from dataflow_family_gpt2.family import GPT2Family

    return GPT2Family()


@hookimpl
def dataflow_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name="gpt2",
            description="GPT-2 (124M to 1.5B, and a tiny CPU preset); HF safetensors import/export",
            load=load,
        )
    ]
