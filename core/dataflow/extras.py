"""Optional dependencies of ``dataflow-runtime``: a clear error when one is missing.

Schema, simulator, planner and CLI install without torch (``pip install dataflow-runtime``);
the engine's torch backends come with the ``torch`` extra
(``pip install 'dataflow-runtime[torch]'``), which every plugin that runs tensors declares.
"""

from __future__ import annotations

import importlib.util

from dataflow import DISTRIBUTION


class MissingExtraError(ImportError):
    """A feature needs an optional dependency that is not installed; says what to install."""


def require_torch(feature: str) -> None:
    """Raise ``MissingExtraError`` naming ``feature`` when torch cannot be imported."""
    if importlib.util.find_spec("torch") is None:
        raise MissingExtraError(
            f"{feature} needs torch, which is not installed; "
            f"install it with: pip install '{DISTRIBUTION}[torch]'"
        )
