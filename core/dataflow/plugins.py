"""The plugin manager: load plugins from entry points, collect their registries, report.

``get_plugin_manager()`` returns the process's default manager, built on first use; nothing
loads when this module is imported. Building a manager:

1. adds the hook specs (``dataflow.hookspecs``);
2. loads every entry point of the group ``dataflow`` whose distribution is selected:
   ``DATAFLOW_LOAD_PLUGINS`` (comma-separated distribution names; set but empty = none)
   selects exactly those; otherwise all load, unless ``DATAFLOW_DISABLE_PLUGIN_AUTOLOAD``
   is set (non-empty), which loads none. The core's own builtins are the entry point
   ``core = dataflow.builtins`` of distribution ``dataflow``, selected like any other;
3. registers ``extra`` plugin objects (tests use these);
4. calls ``check_pending()``, then every plugin's registry hooks.

A plugin whose entry point fails to import, that implements a hook with no spec, or whose
registry hook raises or returns something else than a list of its record type is reported
broken (``dataflow plugins list``), warned about once, and left out whole; it never stops
the others from loading.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from dataflow import hookspecs
from dataflow.registry import (
    KINDS_BY_NAME,
    REGISTRY_KINDS,
    DuplicateNameError,
    FamilySpec,
    FeedRegistry,
    KernelRegistry,
    OptimizerSpec,
    PlannerSpec,
    Registry,
    RegistryKind,
    ResolverSpec,
    TrainerKindSpec,
    check_name,
)
from dataflow.registry.report import PluginReport, PluginSource, Status
from dataflow.registry.selection import (
    DISABLE_AUTOLOAD_ENV,
    LOAD_PLUGINS_ENV,
    Selection,
    normalize_distribution,
    select_distributions,
)

if TYPE_CHECKING:
    import click

__all__ = [
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "LOAD_PLUGINS_ENV",
    "DataflowPluginManager",
    "PluginReport",
    "PluginWarning",
    "Status",
    "build_plugin_manager",
    "families",
    "feeds",
    "get_plugin_manager",
    "hook_names",
    "isolated_plugin_manager",
    "kernels",
    "normalize_distribution",
    "optimizers",
    "planners",
    "resolvers",
    "set_default_plugin_manager",
    "trainer_kinds",
]

ENTRY_POINT_GROUP = "dataflow"


RegistryT = TypeVar("RegistryT", bound=Registry)
_REGISTRY_CLASSES: dict[str, type[Registry]] = {"kernels": KernelRegistry, "feeds": FeedRegistry}


class PluginWarning(UserWarning):
    """A plugin is broken and was skipped."""


def _plugin_label(plugin: object) -> str:
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    named = plugin if isinstance(plugin, type) else type(plugin)
    return f"{named.__module__}.{named.__qualname__}"


class DataflowPluginManager(pluggy.PluginManager):
    """A pluggy manager that knows each plugin's distribution, the broken ones, and the
    registries. Build one with ``get_plugin_manager``; add plugins with ``add_plugin``."""

    def __init__(self) -> None:
        super().__init__("dataflow")
        self.add_hookspecs(hookspecs)
        self._sources: dict[str, PluginSource] = {}
        self._left_out: list[PluginReport] = []
        self._collected: dict[str, dict[str, list[Any]]] | None = None
        #: Names of the allowlist that match no installed distribution (likely typos).
        self.unmatched_allow: tuple[str, ...] = ()

    # -- adding plugins --------------------------------------------------------------------
    def add_plugin(
        self,
        plugin: object,
        *,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
    ) -> bool:
        """Register ``plugin`` as coming from ``distribution`` (default: the plugin's module
        or class name) through ``entry_point`` (``NAME = MODULE``, if any).

        Returns False, and reports the plugin broken, when pluggy rejects it or it
        implements a hook that has no spec.
        """
        source = PluginSource(distribution or _plugin_label(plugin), version, entry_point)
        name = self._free_name(
            f"{source.distribution}:{entry_point.split(' = ')[0]}"
            if entry_point
            else _plugin_label(plugin)
        )
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            if self.get_plugin(name) is plugin:  # pluggy leaves it half registered
                self.unregister(plugin)
            self._mark_broken(name, source, f"cannot register: {exc}")
            return False
        except ValueError as exc:  # this very object is registered already
            self._mark_broken(name, source, f"cannot register: {exc}")
            return False
        self._sources[name] = source
        unknown = sorted(c.name for c in self.get_hookcallers(plugin) or () if not c.has_spec())
        if unknown:
            self.unregister(plugin)
            known = ", ".join(hook_names())
            self._mark_broken(
                name, source, f"implements unknown hook(s) {', '.join(unknown)}; known: {known}"
            )
            return False
        return True

    def _free_name(self, wanted: str) -> str:
        name, count = wanted, 1
        while self.has_plugin(name):
            count += 1
            name = f"{wanted}#{count}"
        return name

    def load_entry_points(self, selection: Selection) -> None:
        """Import and register every selected entry point of the group ``dataflow``."""
        found: set[str] = set()
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for entry_point in sorted(entry_points, key=lambda ep: (_dist_name(ep), ep.name)):
            distribution = _dist_name(entry_point)
            found.add(normalize_distribution(distribution))
            source = PluginSource(
                distribution,
                entry_point.dist.version if entry_point.dist else None,
                f"{entry_point.name} = {entry_point.value}",
            )
            name = f"{distribution}:{entry_point.name}"
            if not selection.admits(distribution):
                self._left_out.append(
                    PluginReport.of(name, source, Status.DISABLED, selection.why_not)
                )
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # any failure of a plugin's import is the plugin's
                self._mark_broken(name, source, f"import failed: {type(exc).__name__}: {exc}")
                continue
            self.add_plugin(
                plugin,
                distribution=source.distribution,
                version=source.version,
                entry_point=source.entry_point,
            )
        if selection.allow is not None:
            self.unmatched_allow = tuple(sorted(selection.allow - found))

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self._collected = None
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        self._collected = None
        return super().unregister(plugin, name)

    def _mark_broken(self, name: str, source: PluginSource, reason: str) -> None:
        report = PluginReport.of(name, source, Status.BROKEN, reason)
        self._left_out.append(report)
        # Attributed to the plugin, not to a line of dataflow (which would be printed with it).
        warnings.warn_explicit(
            f"{report.describe()}; skipped (see `dataflow plugins list`)",
            PluginWarning,
            filename=f"<dataflow plugin {source.distribution}>",
            lineno=0,
        )

    # -- registries ------------------------------------------------------------------------
    def _collect(self) -> dict[str, dict[str, list[Any]]]:
        """plugin name -> registry name -> its records; calls each registry hook once."""
        if self._collected is None:
            collected: dict[str, dict[str, list[Any]]] = {}
            failed: list[tuple[str, object, Exception]] = []
            for name, plugin in sorted(self.list_name_plugin()):
                try:
                    collected[name] = self._call_registry_hooks(plugin)
                except Exception as exc:  # the plugin's fault: report it, leave it out whole
                    failed.append((name, plugin, exc))
            for name, plugin, exc in failed:
                self.unregister(plugin)
                self._mark_broken(name, self.source_of(name), str(exc))
            self._collected = collected
        return self._collected

    def _call_registry_hooks(self, plugin: object) -> dict[str, list[Any]]:
        records: dict[str, list[Any]] = {}
        for kind in REGISTRY_KINDS:
            for impl in getattr(self.hook, kind.hook).get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                if impl.hookwrapper or impl.wrapper:
                    raise TypeError(f"{kind.hook} is a registry hook and cannot be a wrapper")
                try:
                    result = impl.function()
                except Exception as exc:
                    raise RuntimeError(f"{kind.hook} raised {type(exc).__name__}: {exc}") from exc
                records[kind.name] = _checked_records(kind, result)
        return records

    def source_of(self, plugin_name: str) -> PluginSource:
        return self._sources.get(plugin_name, PluginSource(plugin_name))

    def records(self, kind_name: str) -> list[tuple[str, Any]]:
        """``(distribution, record)`` for every record of the registry ``kind_name``."""
        return [
            (self.source_of(name).distribution, record)
            for name, by_kind in self._collect().items()
            for record in by_kind.get(kind_name, ())
        ]

    def registry(self, kind_name: str) -> Registry[Any]:
        """The registry ``kind_name`` (``families``, ``planners`` ...); raises
        DuplicateNameError when two records share a name."""
        return self._build(kind_name, _REGISTRY_CLASSES.get(kind_name, Registry))

    def _build(self, kind_name: str, cls: type[RegistryT]) -> RegistryT:
        broken = [r.distribution for r in self._left_out if r.status is Status.BROKEN]
        return cls.build(KINDS_BY_NAME[kind_name], self.records(kind_name), broken=broken)

    def families(self) -> Registry[FamilySpec]:
        return self.registry("families")

    def resolvers(self) -> Registry[ResolverSpec]:
        return self.registry("resolvers")

    def kernels(self) -> KernelRegistry:
        return self._build("kernels", KernelRegistry)

    def feeds(self) -> FeedRegistry:
        return self._build("feeds", FeedRegistry)

    def planners(self) -> Registry[PlannerSpec]:
        return self.registry("planners")

    def optimizers(self) -> Registry[OptimizerSpec]:
        return self.registry("optimizers")

    def trainer_kinds(self) -> Registry[TrainerKindSpec]:
        return self.registry("trainer_kinds")

    def cli_commands(self) -> Registry[click.Command]:
        """The subcommands plugins add (``dataflow.cli.main.plugin_commands`` checks them
        against the builtins)."""
        return self.registry("cli_commands")

    def conflicts(self) -> list[DuplicateNameError]:
        """Every duplicate name in every registry (without raising), for reports."""
        found = []
        for kind in REGISTRY_KINDS:
            first: dict[str, str] = {}
            for distribution, record in self.records(kind.name):
                name = kind.key(record)
                if name in first:
                    found.append(DuplicateNameError(kind.noun, name, first[name], distribution))
                first.setdefault(name, distribution)
        return found

    # -- reports ---------------------------------------------------------------------------
    def reports(self) -> list[PluginReport]:
        """One report per plugin: loaded ones (ok), then the broken and the disabled."""
        collected = self._collect()
        loaded = [
            PluginReport.of(
                name,
                self.source_of(name),
                Status.OK,
                hooks=tuple(sorted(c.name for c in self.get_hookcallers(plugin) or ())),
                registers={
                    kind.name: tuple(sorted(kind.key(r) for r in collected[name][kind.name]))
                    for kind in REGISTRY_KINDS
                    if kind.name in collected[name]
                },
            )
            for name, plugin in self.list_name_plugin()
        ]
        return sorted(loaded + self._left_out, key=lambda r: (r.distribution, r.name))


def _dist_name(entry_point: metadata.EntryPoint) -> str:
    return entry_point.dist.name if entry_point.dist else f"<unknown distribution of {entry_point}>"


def _checked_records(kind: RegistryKind, result: object) -> list[Any]:
    if result is None:
        return []
    if not isinstance(result, list | tuple):
        raise TypeError(
            f"{kind.hook} returned {type(result).__name__}, expected a list of "
            f"{kind.record_type.__name__}"
        )
    for record in result:
        if not isinstance(record, kind.record_type):
            raise TypeError(
                f"{kind.hook} returned {record!r} ({type(record).__name__}), expected "
                f"{kind.record_type.__name__}"
            )
        check_name(kind.noun, kind.key(record))
    return list(result)


def hook_names() -> list[str]:
    """Every hook a plugin can implement, sorted."""
    return sorted(name for name in vars(hookspecs) if name.startswith("dataflow_"))


# -- factory and the default manager --------------------------------------------------------
def build_plugin_manager(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    extra: Iterable[object] = (),
) -> DataflowPluginManager:
    """A fresh manager. ``allow`` (distribution names) and ``autoload`` override the
    environment variables when given; ``extra`` plugin objects are always registered."""
    manager = DataflowPluginManager()
    manager.load_entry_points(select_distributions(autoload, allow))
    return _finish(manager, extra)


def isolated_plugin_manager(*plugins: object) -> DataflowPluginManager:
    """A fresh manager holding only ``plugins``: no entry point is read or loaded, and the
    environment is ignored."""
    return _finish(DataflowPluginManager(), plugins)


def _finish(manager: DataflowPluginManager, extra: Iterable[object]) -> DataflowPluginManager:
    for plugin in extra:
        manager.add_plugin(plugin)
    manager.check_pending()
    manager.reports()  # call the registry hooks now, so broken plugins show at once
    return manager


_default: DataflowPluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    extra: Iterable[object] = (),
) -> DataflowPluginManager:
    """The default manager (built once, from the environment) when called without
    arguments; a fresh one built with ``build_plugin_manager`` otherwise."""
    global _default
    extra = tuple(extra)
    if autoload is not None or allow is not None or extra:
        return build_plugin_manager(autoload=autoload, allow=allow, extra=extra)
    with _default_lock:
        if _default is None:
            _default = build_plugin_manager()
        return _default


def set_default_plugin_manager(
    manager: DataflowPluginManager | None,
) -> DataflowPluginManager | None:
    """Make ``manager`` the default (None: rebuild from the environment on next use);
    returns the previous default. Tests use it to run code against an isolated manager."""
    global _default
    with _default_lock:
        previous, _default = _default, manager
    return previous


# -- lookups on the default manager ---------------------------------------------------------
def families() -> Registry[FamilySpec]:
    return get_plugin_manager().families()


def resolvers() -> Registry[ResolverSpec]:
    return get_plugin_manager().resolvers()


def kernels() -> KernelRegistry:
    return get_plugin_manager().kernels()


def feeds() -> FeedRegistry:
    return get_plugin_manager().feeds()


def planners() -> Registry[PlannerSpec]:
    return get_plugin_manager().planners()


def optimizers() -> Registry[OptimizerSpec]:
    return get_plugin_manager().optimizers()


def trainer_kinds() -> Registry[TrainerKindSpec]:
    return get_plugin_manager().trainer_kinds()
