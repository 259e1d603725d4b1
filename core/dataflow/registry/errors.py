"""Errors of the plugin registries; each names the distributions and names involved."""

from __future__ import annotations

from collections.abc import Sequence


class PluginError(Exception):
    """Something is wrong with the installed plugins as a whole (not with one plugin alone)."""


class DuplicateNameError(PluginError):
    """Two records of one registry share a name."""

    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        self.kind, self.name, self.distributions = kind, name, (first, second)
        by = (
            f"twice by distribution {first!r}"
            if first == second
            else (f"by distribution {first!r} and by distribution {second!r}")
        )
        super().__init__(
            f"{kind} name {name!r} is registered {by}; uninstall one, or leave one out with "
            f"DATAFLOW_LOAD_PLUGINS (a comma-separated list of the distributions to load)"
        )


class UnknownNameError(PluginError, LookupError):
    """A lookup asked a registry for a name no loaded plugin registers."""

    def __init__(
        self, kind: str, name: str, known: Sequence[str], broken: Sequence[str] = ()
    ) -> None:
        self.kind, self.name, self.known = kind, name, tuple(known)
        known_text = ", ".join(known) if known else "none"
        message = f"no {kind} named {name!r}; known: {known_text}"
        if broken:
            message += f"; broken plugins (not loaded): {', '.join(broken)}"
        super().__init__(
            f"{message}. Run `dataflow plugins list` to see which plugins are loaded and "
            "which are broken."
        )
