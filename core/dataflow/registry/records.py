"""The records registry hooks return: one frozen attrs class per kind of thing a plugin adds.

A record names a thing and holds a callable that makes it. The callable imports heavy code
(torch, model code, compiled kernels) only when it is called, so the entry-point module that
returns the record stays tiny and fast to import.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from dataflow.schema import Program

#: Names are non-empty and have no whitespace (they are typed on command lines).
_NAME = re.compile(r"^\S+$")


def check_name(what: str, value: object) -> str:
    """Return ``value`` when it is a valid registry name; raise ``ValueError`` naming ``what``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid name: it must be non-empty text without spaces"
        )
    return value


def _valid_name(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_name(f"{type(instance).__name__}.{attribute.name}", value)


def _valid_scheme(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if ":" in check_name(f"{type(instance).__name__}.{attribute.name}", value):
        raise ValueError(
            f"FeedSpec.scheme {value!r} must not contain ':' (feed specs are "
            "written SCHEME:LOCATION)"
        )


def _devices(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(
            f"KernelVariant.devices must be a tuple of device names, got the "
            f"string {value!r}; write ({value!r},)"
        )
    return tuple(value)


def _valid_devices(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("KernelVariant.devices must name at least one device")
    for device in value:
        check_name("KernelVariant device", device)


_callable = attrs.validators.is_callable()
_text = attrs.validators.instance_of(str)


@attrs.frozen
class FamilySpec:
    """A model family. ``load()`` imports the family's code and returns its family object."""

    name: str = attrs.field(validator=_valid_name)
    description: str = attrs.field(validator=_text)
    load: Callable[[], Any] = attrs.field(validator=_callable)

    @property
    def key(self) -> str:
        return self.name


@attrs.frozen
class ResolverSpec:
    """A way to turn compute keys into executables: ``build(program)`` returns a Resolver."""

    name: str = attrs.field(validator=_valid_name)
    build: Callable[[Program], Any] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=_text)

    @property
    def key(self) -> str:
        return self.name


@attrs.frozen
class KernelVariant:
    """One implementation of op ``op``; ``load()`` imports it and returns the callable.

    Among the variants of one op that support a device, the highest ``priority`` is
    preferred. ``deterministic`` says whether two runs give bitwise-equal results.
    """

    op: str = attrs.field(validator=_valid_name)
    name: str = attrs.field(validator=_valid_name)
    load: Callable[[], Callable[..., Any]] = attrs.field(validator=_callable)
    devices: tuple[str, ...] = attrs.field(
        default=("cpu", "cuda"), converter=_devices, validator=_valid_devices
    )
    deterministic: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    priority: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    description: str = attrs.field(default="", validator=_text)

    @property
    def key(self) -> str:
        """Registry name: ``OP/NAME`` (variant names are unique per op, not overall)."""
        return f"{self.op}/{self.name}"


@attrs.frozen
class FeedSpec:
    """A data feed, opened from a spec string ``SCHEME:LOCATION`` (``shards:data/tok``).

    ``open(location, **options)`` returns the feed.
    """

    scheme: str = attrs.field(validator=_valid_scheme)
    open: Callable[..., Any] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=_text)

    @property
    def key(self) -> str:
        return self.scheme


@attrs.frozen
class PlannerSpec:
    """A planner: ``plan(program, budget_bytes, **options)`` returns the planned Program.

    What else it can do, each optional (None: ``dataflow.planning`` does without):

    - ``minimal_budget(program, **options)`` returns the smallest fast budget the planner
      plans ``program`` for, one at which static placement also fits.
    - ``run(program, budget_bytes, **options)`` is ``plan`` with what the planner worked
      out on the way (a ``dataflow.planning.plans.PlannerRun``: the chain's lower bounds,
      and whether the program is well formed by construction): ``dataflow.planning.plan``
      calls it instead of ``plan``, and neither bounds nor validates the chain again.
    - ``replan(program, budget_bytes, **options)`` returns the planner's
      ``dataflow.planning.Plan`` at ``budget_bytes`` found without searching for a smaller
      budget that works, or None when it finds none there (option ``fit_below``: then a
      few budgets halfway up towards it too). Static placement re-plans with it; without
      it, through ``plan``.
    """

    name: str = attrs.field(validator=_valid_name)
    plan: Callable[..., Program] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=_text)
    minimal_budget: Callable[..., int] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_callable)
    )
    run: Callable[..., Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_callable)
    )
    replan: Callable[..., Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_callable)
    )

    @property
    def key(self) -> str:
        return self.name
