"""What the plugin manager reports about each plugin: where it comes from and its status."""

from __future__ import annotations

import enum

import attrs


class Status(enum.StrEnum):
    """A plugin's state in a plugin manager."""

    OK = "ok"
    BROKEN = "broken"
    DISABLED = "disabled"  # its distribution is not selected, so it was not imported


@attrs.frozen
class PluginReport:
    """What ``dataflow plugins list`` shows for one plugin (one entry point, or one extra).

    ``registers`` maps a registry name (``planners``) to the names this plugin adds to it.
    """

    name: str
    distribution: str
    version: str | None
    entry_point: str | None
    status: Status
    reason: str | None = None
    hooks: tuple[str, ...] = ()
    registers: dict[str, tuple[str, ...]] = attrs.field(factory=dict, hash=False)

    @classmethod
    def of(
        cls,
        name: str,
        source: PluginSource,
        status: Status,
        reason: str | None = None,
        *,
        hooks: tuple[str, ...] = (),
        registers: dict[str, tuple[str, ...]] | None = None,
    ) -> PluginReport:
        """The report of plugin ``name`` (its name in the plugin manager) from ``source``."""
        return cls(
            name=name,
            distribution=source.distribution,
            version=source.version,
            entry_point=source.entry_point,
            status=status,
            reason=reason,
            hooks=hooks,
            registers=registers or {},
        )

    @property
    def status_text(self) -> str:
        return self.status.value if self.reason is None else f"{self.status}: {self.reason}"

    def describe(self) -> str:
        where = f" (entry point {self.entry_point})" if self.entry_point else ""
        return f"distribution {self.distribution!r}{where}: {self.status_text}"


@attrs.frozen
class PluginSource:
    """Where a plugin comes from: its distribution and, if loaded from one, entry point."""

    distribution: str
    version: str | None = None
    entry_point: str | None = None
