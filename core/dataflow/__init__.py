"""dataflow: train models bigger than the GPU, at close to full speed.

The facade for program authors and every plugin: the Program's records (schema), planning,
simulation, the engine (with the torch backends' few helpers plugins use), timelines and
bundles, the registry records and the plugin registries, byte sizes, and ``hookimpl``.
Import from here, never from a submodule (docs/api.md; what this module does not export is
private). CLI helpers for a plugin's subcommands are in ``dataflow.cli``; the test kit is
``dataflow.testing``.

Importing ``dataflow`` is cheap: no torch, no plugins. Each name below but ``hookimpl``,
``__version__`` and ``DISTRIBUTION`` is imported from its module when first used (the torch
backends' names import torch then). Plugins load when a plugin manager is built
(``get_plugin_manager``).
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

from dataflow._lazy import exported, lazy_exports

#: The distribution that installs this package (``dataflow`` on the package index is another
#: project's): plugins depend on it, ``DATAFLOW_LOAD_PLUGINS`` names it for the builtins.
DISTRIBUTION = "dataflow-runtime"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

#: Mark a plugin's hook implementations with this; plugins never import pluggy.
hookimpl = pluggy.HookimplMarker("dataflow")

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    "dataflow.schema": (
        "Program",
        "Task",
        "Obj",
        "Directive",
        "TensorMeta",
        "Links",
        "Link",
        "Budget",
        "Role",
        "Location",
        "Resource",
        "DTYPE_BYTES",
        "validate",
    ),
    "dataflow.sim": ("simulate", "SimResult"),
    "dataflow.planning": (
        "plan",
        "Plan",
        "place",
        "Placement",
        "minimal_budget",
        "lower_bound",
        "without_workspace",
        "fast_homes",
        "PRESSUREFIT",
        "PlanningError",
        "InfeasibleBudget",
    ),
    "dataflow.engine": (
        "Engine",
        "LaunchContext",
        "DictResolver",
        "BudgetBreachError",
        "EngineRunError",
        "RunValues",
        "MissingValueError",
    ),
    "dataflow.engine.backends.torch_cuda": (
        "runtime_reserve_bytes",
        "measure_links",
        "CudaRunner",
    ),
    "dataflow.engine.backends.graph_memsets": ("memsets_to_kernels",),
    "dataflow.engine.backends.torch_storage": ("typed_view", "slow_pool_bytes"),
    "dataflow.engine.measure": ("measure_tasks", "priced_by_measurement"),
    "dataflow.timeline": ("Timeline", "TaskSpan", "TransferSpan", "Counter", "write_chrome_trace"),
    "dataflow.timeline.wire": ("timeline_to_dict", "timeline_from_dict", "TimelineFormatError"),
    "dataflow.bundle": (
        "Bundle",
        "Summary",
        "Measured",
        "BundleError",
        "read_bundle",
        "write_bundle",
        "write_measured",
        "bundle_of",
        "plan_summary",
        "predicted_timeline",
        "measured_timeline",
        "link_counters",
        "stalls",
    ),
    "dataflow.registry": (
        "FamilySpec",
        "ResolverSpec",
        "KernelVariant",
        "FeedSpec",
        "PlannerSpec",
        "OptimizerSpec",
        "OptimizerArg",
        "StateField",
        "TrainerKindSpec",
        "UnknownNameError",
    ),
    "dataflow.plugins": (
        "get_plugin_manager",
        "set_default_plugin_manager",
        "DataflowPluginManager",
        "families",
        "resolvers",
        "kernels",
        "feeds",
        "planners",
        "optimizers",
        "trainer_kinds",
    ),
    "dataflow.units": ("format_size", "parse_size"),
    "dataflow.durable": ("fsync_path",),
}

__all__ = [
    "DISTRIBUTION",
    "__version__",
    "hookimpl",
    "lazy_exports",
    "exported",
    *exported(_HOMES),
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
