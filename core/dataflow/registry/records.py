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


def same_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """``StateField.shape`` of a state the size of its parameter (AdamW's moments)."""
    return tuple(shape)


@attrs.frozen
class StateField:
    """One tensor an optimizer keeps per parameter: ``shape(param_shape, role)`` is its
    shape (``role``: ``"embed"``, ``"block"`` or ``"head"``, where the parameter's layer
    sits; ``()`` or a zero-size shape keeps nothing for that parameter), ``dtype`` its
    dtype, or None for the dtype the run's precision gives optimizer state."""

    name: str = attrs.field(validator=_valid_name)
    shape: Callable[[tuple[int, ...], str], tuple[int, ...]] = attrs.field(
        default=same_shape, validator=_callable
    )
    dtype: str | None = attrs.field(default=None, validator=attrs.validators.optional(_text))


#: ``OptimizerArg.kind``'s types, by name (what ``--optimizer-arg K=V`` parses V as)
ARG_KINDS: dict[str, type] = {"float": float, "int": int, "bool": bool, "str": str}
_KIND_WORDS = {
    "float": "a number",
    "int": "a whole number",
    "bool": "true or false",
    "str": "text",
}


@attrs.frozen
class OptimizerArg:
    """A hyperparameter an optimizer takes (``--optimizer-arg NAME=VALUE``): its ``kind``
    (a key of ``ARG_KINDS``), its default and one line of help."""

    name: str = attrs.field(validator=_valid_name)
    kind: str = attrs.field(validator=attrs.validators.in_(tuple(ARG_KINDS)))
    default: Any
    help: str = attrs.field(default="", validator=_text)

    def parse(self, text: str) -> Any:
        """``text`` as this argument's kind; ValueError names the argument and its kind."""
        if self.kind == "bool":
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return ARG_KINDS[self.kind](text)
            except ValueError:
                pass
        raise ValueError(f"{self.name}={text!r}: {self.name} takes {_KIND_WORDS[self.kind]}")


@attrs.frozen
class OptimizerSpec:
    """An optimizer: the state it keeps per parameter, the ops it calls and its update.

    ``update(ops, params, grads, states, *, step, policy, weight_decay, roles)`` changes
    ``params`` and ``states`` (state field name -> list parallel to ``params``) in place,
    over every trainable tensor of one parameter group at once (a multi-tensor step per
    optimizer task): ``ops`` maps each name of ``ops`` to its kernel, ``step`` counts from
    1, ``policy`` holds ``lr``, ``weight_decay`` and every argument of ``arguments``
    (defaults filled in), ``weight_decay`` is the decay of these tensors (0 for those a
    family exempts) and ``roles`` each tensor's ``StateField`` role. ``elementwise``: the
    update treats every element alike, so the task may hand it one flat tensor for a
    whole group instead of one tensor per parameter.
    """

    name: str = attrs.field(validator=_valid_name)
    description: str = attrs.field(validator=_text)
    state: tuple[StateField, ...] = attrs.field(converter=tuple)
    update: Callable[..., None] = attrs.field(validator=_callable)
    ops: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    arguments: tuple[OptimizerArg, ...] = attrs.field(default=(), converter=tuple)
    elementwise: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def key(self) -> str:
        return self.name

    @property
    def state_fields(self) -> tuple[str, ...]:
        return tuple(field.name for field in self.state)

    def argument(self, name: str) -> OptimizerArg:
        """The declared argument ``name``; ValueError lists the known ones."""
        for arg in self.arguments:
            if arg.name == name:
                return arg
        known = ", ".join(a.name for a in self.arguments) or "none"
        raise ValueError(f"optimizer {self.name!r} has no argument {name!r}; known: {known}")

    def parse_args(self, pairs: Iterable[str]) -> dict[str, Any]:
        """``K=V`` texts as typed arguments (validated against ``arguments``)."""
        parsed: dict[str, Any] = {}
        for pair in pairs:
            name, equals, value = pair.partition("=")
            if not equals:
                raise ValueError(f"{pair!r} is not NAME=VALUE")
            parsed[name.strip()] = self.argument(name.strip()).parse(value.strip())
        return parsed

    def defaults(self) -> dict[str, Any]:
        return {arg.name: arg.default for arg in self.arguments}


def _not_tokens(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value == "tokens":
        raise ValueError(
            "TrainerKindSpec.name: 'tokens' is dataflow serve-trainer's own kind (its "
            "token-batch step); name the plugin's kind otherwise"
        )


@attrs.frozen
class TrainerKindSpec:
    """A kind of update ``dataflow serve-trainer`` can serve besides its own token-batch
    step (``load`` with ``"kind": NAME``). ``open(options, *, device)`` makes the trainer
    from ``load``'s fields (less ``kind``, ``device`` and ``resume``), raising
    ``ValueError`` naming the field at fault; the trainer's methods are the protocol
    ``dataflow_training.service.kinds.ServedTrainer`` (docs/engine_service.md).
    ``load_args`` and ``step_args`` name the fields ``load`` and ``step`` take (a name
    outside them is refused before ``open`` or ``step`` is called). ``tokens`` is the
    server's own kind: a record of that name is refused."""

    name: str = attrs.field(validator=[_valid_name, _not_tokens])
    description: str = attrs.field(validator=_text)
    open: Callable[..., Any] = attrs.field(validator=_callable)
    load_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    step_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def key(self) -> str:
        return self.name
