"""dataflow: train models bigger than the GPU, at close to full speed.

Importing ``dataflow`` is cheap: no torch, no plugins. Plugins load when a plugin manager
is built (``dataflow.plugins.get_plugin_manager``).
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

#: The distribution that installs this package (``dataflow`` on the package index is another
#: project's): plugins depend on it, ``DATAFLOW_LOAD_PLUGINS`` names it for the builtins.
DISTRIBUTION = "dataflow-runtime"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

#: Mark a plugin's hook implementations with this; plugins never import pluggy.
hookimpl = pluggy.HookimplMarker("dataflow")

__all__ = ["DISTRIBUTION", "__version__", "hookimpl"]
