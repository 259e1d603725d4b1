"""Test kit for family and kit authors (docs/api.md): the conformance bases a family
package's tests subclass, and toy families with real math. Import from here, never from a
submodule. Light: each name (they import torch and pytest) loads when first used.
"""

from dataflow import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    "dataflow_training.testing.conformance": (
        "TrainingFamilyConformance",
        "assert_predicts_at_16_gib",
    ),
    "dataflow_training.testing.decoder": ("DecoderFamilyChecks", "DecoderHFParity"),
    "dataflow_training.testing.hybrid": ("HybridHFChecks",),
    "dataflow_training.testing.moe": (
        "MoEFamilyChecks",
        "MoEHFParity",
        "assert_tasks_route_as_forward",
    ),
    "dataflow_training.testing.served": ("ServerProcess", "short_folder"),
    "dataflow_training.testing.reference": ("float64_reference",),
    "dataflow_training.testing.toy": ("ToyFamily", "plain_ops", "toy_weights"),
    "dataflow_training.testing.toy_moe": ("ToyMoEFamily",),
}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
