"""Every hook a dataflow plugin can implement, grouped by phase.

A plugin is a module (or object) named by an entry point in the group ``dataflow``; it marks
its implementations with ``dataflow.hookimpl`` and never imports pluggy::

    from dataflow import hookimpl
    from dataflow.registry import PlannerSpec

    @hookimpl
    def dataflow_planners():
        return [PlannerSpec("keep-all", plan_keep_all, "keep every object resident")]

Every hook is named ``dataflow_<what>``. Each docstring says when the hook is called, what
it returns and whether the first non-None result wins. ``docs/plugin_hooks.md`` has a
section per hook with the same signature (a test keeps the two in step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import click

    from dataflow.registry import (
        FamilySpec,
        FeedSpec,
        KernelVariant,
        OptimizerSpec,
        PlannerSpec,
        ResolverSpec,
        TrainerKindSpec,
    )

hookspec = pluggy.HookspecMarker("dataflow")


# -- Registries ---------------------------------------------------------------------------
# Called once per plugin manager, when it collects its registries (right after the plugins
# load). Each returns a list of frozen records; the manager flattens every plugin's lists,
# attributes each record to the plugin's distribution, sorts by name and raises
# DuplicateNameError on a name registered twice. A plugin whose registry hook raises, or
# returns anything but a list of the record type, is reported broken and skipped whole.
# Records hold callables that import heavy code lazily: returning a record must be cheap.


@hookspec
def dataflow_families() -> list[FamilySpec]:
    """Model families this plugin provides.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``FamilySpec`` whose ``load()`` imports the family's code only when called. Every
    plugin's result is collected (not firstresult).
    """


@hookspec
def dataflow_resolvers() -> list[ResolverSpec]:
    """Resolvers: ways to turn a task's compute key into an executable.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``ResolverSpec`` whose ``build(program)`` returns a Resolver for that program. Every
    plugin's result is collected (not firstresult).
    """


@hookspec
def dataflow_kernels() -> list[KernelVariant]:
    """Kernel variants: implementations of ops, each with devices and a determinism flag.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``KernelVariant``; variants are keyed ``OP/NAME`` and ``load()`` imports the kernel.
    Every plugin's result is collected (not firstresult).
    """


@hookspec
def dataflow_feeds() -> list[FeedSpec]:
    """Data feeds, each opened from a spec string ``SCHEME:LOCATION``.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``FeedSpec`` whose ``open(location, **options)`` opens the feed. Every plugin's result
    is collected (not firstresult).
    """


@hookspec
def dataflow_planners() -> list[PlannerSpec]:
    """Planners: write a program's directives so it runs within a fast-memory budget.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``PlannerSpec`` whose ``plan(program, budget_bytes, **options)`` returns the planned
    Program. Every plugin's result is collected (not firstresult).
    """


@hookspec
def dataflow_optimizers() -> list[OptimizerSpec]:
    """Optimizers: the state each keeps per parameter, its arguments and its update.

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``OptimizerSpec`` (``dataflow train --optimizer NAME`` picks one); its ``update`` runs
    once per optimizer task over the lists of a parameter group's tensors. Every plugin's
    result is collected (not firstresult).
    """


@hookspec
def dataflow_trainer_kinds() -> list[TrainerKindSpec]:
    """Kinds of update ``dataflow serve-trainer`` can serve (``load`` with ``"kind"``).

    Called once per plugin manager, when the registries are collected. Returns a list of
    ``TrainerKindSpec`` whose ``open(options, *, device)`` makes a trainer the server
    drives verb by verb (an RL policy update on rollouts, say). Every plugin's result is
    collected (not firstresult).
    """


# -- Command line --------------------------------------------------------------------------
# Called when the ``dataflow`` command lists or looks up its subcommands.


@hookspec
def dataflow_cli_commands() -> list[click.Command]:
    """Extra ``dataflow`` subcommands.

    Called once per plugin manager, when the registries are collected (the ``dataflow``
    command asks for them when it lists or looks up a subcommand it does not know). Returns
    a list of ``click.Command``; a name that clashes with another plugin's command or a
    builtin one is an error. Every plugin's result is collected (not firstresult).
    """
