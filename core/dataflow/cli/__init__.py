"""The ``dataflow`` command: thin click layers over the Python API of the same name.

The facade for plugins that add subcommands (``dataflow_cli_commands``): the option types
and helpers that make their options and errors behave like the core's. Import from here,
never from a submodule (docs/api.md). Light: the names load when first used.
"""

from dataflow._lazy import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    "dataflow.cli.options": (
        "BUDGET",
        "Size",
        "size_callback",
        "COUNT",
        "Device",
        "OutputFile",
        "lookup",
        "parse_value",
    ),
    "dataflow.cli.errors": (
        "Failure",
        "one_line",
        "plugin_failure",
        "USAGE_EXIT",
        "FAILURE_EXIT",
    ),
    "dataflow.cli.perfetto": ("write_perfetto",),
}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
