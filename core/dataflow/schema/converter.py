"""Every wire rule of the schema, in one cattrs converter.

Rules: unknown keys are errors; scalars are not coerced (``"5"`` is not an int); every
document carries ``"schema": "dataflow.program/v2"`` and older versions migrate forward
through explicit dict -> dict steps in ``MIGRATIONS``. An empty ``prologue`` and an empty
``persistent`` list are left out of what is written, and so are a task's default
``resource`` (compute), an absent collective link and an absent duplex limit: a program
without them reads and writes exactly as before they existed. Those fields carry
``OMIT_IF_DEFAULT`` in their attrs metadata; the converter leaves out any field so marked
while it holds its default.

The converter knows the schema's classes only through the class it is asked for (the
schema imports it, never the other way round): ``Program.from_dict`` and the rest call
the functions here with their class.
"""

from __future__ import annotations

import enum
import json
import reprlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_unstructure_fn, override

from dataflow.schema.program_file import (
    ProgramFileError,
    json_depth_problem,
    json_loads,
    read_program_bytes,
)

SCHEMA_KEY = "schema"
PROGRAM_SCHEMA = "dataflow.program/v2"

_OMIT_KEY = "dataflow.schema.omit_if_default"
#: attrs field metadata: the field is left out of what is written while it holds its
#: default (``attrs.field(..., metadata=OMIT_IF_DEFAULT)``).
OMIT_IF_DEFAULT = {_OMIT_KEY: True}

#: the Program class the functions below are handed (``Program.from_dict`` and the rest)
P = TypeVar("P")


def _v1_to_v2(body: dict[str, Any]) -> dict[str, Any]:
    """v2 added ``prologue`` and ``persistent``; a v1 program has neither (both empty)."""
    return dict(body)


#: version -> (next version, step). Each step takes the dict of its version (without the
#: ``schema`` key) and returns the dict of the next.
MIGRATIONS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "dataflow.program/v1": ("dataflow.program/v2", _v1_to_v2),
}


class SchemaError(ValueError):
    """A document that is not a valid Program; ``problems`` holds one line per fault,
    each starting with the field path (``$.tasks[3].inputs[0]``)."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        listing = "\n".join(f"  - {line}" for line in problems)
        super().__init__(f"{source} is not a valid program:\n{listing}")


#: How a wrong value is shown in an error: a few items and levels of it, never all of a
#: large or deeply nested value.
def _short_repr() -> Callable[[Any], str]:
    shown = reprlib.Repr()  # Python 3.11's takes no arguments
    shown.maxlevel, shown.maxstring, shown.maxother = 2, 40, 40
    return shown.repr


_short = _short_repr()


def _strict(kind: type, accepts: tuple[type, ...], convert: Callable[[Any], Any]):
    def structure(value: Any, _: type) -> Any:
        if isinstance(value, bool) and bool not in accepts:
            raise TypeError(f"expected {kind.__name__}, got bool {value!r}")
        if not isinstance(value, accepts):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {_short(value)}")
        return convert(value)

    return structure


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, (int,), int))
    converter.register_structure_hook(float, _strict(float, (int, float), float))
    # Interned: an object id named by many tasks is then held once, not once per mention.
    converter.register_structure_hook(str, _strict(str, (str,), sys.intern))
    converter.register_structure_hook(bool, _strict(bool, (bool,), bool))
    # A StrEnum is a str too: without its own hook the str hook above would take it.
    converter.register_structure_hook(enum.StrEnum, _structure_str_enum)
    converter.register_structure_hook_func(lambda t: t == dict[str, Any], _structure_json_object)

    def unstructure_attrs(kind: type) -> Callable[[Any], dict[str, Any]]:
        omitted = {
            field.name: override(omit_if_default=True)
            for field in attrs.fields(kind)
            if field.metadata.get(_OMIT_KEY)
        }
        return make_dict_unstructure_fn(kind, converter, **omitted)

    converter.register_unstructure_hook_factory(attrs.has, unstructure_attrs)
    return converter


def _structure_str_enum(value: Any, kind: type[enum.StrEnum]) -> enum.StrEnum:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {_short(value)}")
    return kind(value)


def _structure_json_object(value: Any, _: type) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, got {type(value).__name__} {_short(value)}")
    too_deep = json_depth_problem(value)
    if too_deep is not None:
        raise ValueError(too_deep)
    return dict(value)


converter = _make_converter()


def _describe(exc: BaseException, path: str = "$") -> list[str]:
    def format_exception(inner: BaseException, type_: Any) -> str:
        if isinstance(inner, KeyError):
            return "required field missing"
        if isinstance(inner, ForbiddenExtraKeysError):
            return f"unknown field(s) {sorted(inner.extra_fields)}"
        if isinstance(inner, ValueError) and getattr(type_, "__members__", None):
            return f"{inner}; expected one of {[member.value for member in type_]}"
        return str(inner)

    if isinstance(exc, cattrs.BaseValidationError):
        lines = cattrs.transform_error(exc, path=path, format_exception=format_exception)
        return [f"{where}: {what}" for what, _, where in (line.rpartition(" @ ") for line in lines)]
    return [f"{path}: {exc}"]


def migrate(data: Mapping[str, Any], source: str = "program") -> dict[str, Any]:
    """Bring a program dict of any known schema version to the current one."""
    if not isinstance(data, Mapping):
        raise SchemaError(source, [f"$: expected a JSON object, got {type(data).__name__}"])
    body = dict(data)
    version = body.pop(SCHEMA_KEY, None)
    if version is None:
        raise SchemaError(source, [f"$.{SCHEMA_KEY}: required field missing"])
    while version != PROGRAM_SCHEMA:
        if version not in MIGRATIONS:
            known = sorted([PROGRAM_SCHEMA, *MIGRATIONS])
            raise SchemaError(
                source, [f"$.{SCHEMA_KEY}: unknown version {version!r}; known {known}"]
            )
        version, step = MIGRATIONS[version]
        body = step(body)
    return body


def program_from_dict(kind: type[P], data: Mapping[str, Any], source: str = "program") -> P:
    """``data`` as a ``kind``; ``SchemaError`` naming ``source`` and every fault. A program
    needs at least one task."""
    body = migrate(data, source)
    try:
        program = converter.structure(body, kind)
    except (ClassValidationError, ForbiddenExtraKeysError, ValueError, TypeError) as exc:
        raise SchemaError(source, _describe(exc)) from None
    if not body["tasks"]:
        raise SchemaError(source, ["$.tasks: empty; a program needs at least one task"])
    return program


def program_to_dict(program: Any) -> dict[str, Any]:
    return {SCHEMA_KEY: PROGRAM_SCHEMA, **converter.unstructure(program)}


def program_from_json(kind: type[P], text_or_path: str | Path) -> P:
    """A program from JSON text or from a path to a JSON file, read within the bounds of
    ``dataflow.schema.program_file``; ``SchemaError`` naming the file (or ``program``)."""
    text: str | bytes
    if isinstance(text_or_path, Path) or not str(text_or_path).lstrip().startswith(("{", "[")):
        source = str(text_or_path)
        try:
            text = read_program_bytes(text_or_path)
        except ProgramFileError as exc:
            raise SchemaError(source, [str(exc).removeprefix(f"{source}: ")]) from None
    else:
        text, source = str(text_or_path), "program"
    try:
        data = json_loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            source, [f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"]
        ) from None
    except ValueError as exc:  # not UTF-8, or nested too deep for the parser
        raise SchemaError(source, [f"not JSON: {exc}"]) from None
    del text  # the file's bytes: not held while the program is built from them
    return program_from_dict(kind, data, source)


def program_to_json(program: Any, *, indent: int | None = 1) -> str:
    return json.dumps(program_to_dict(program), indent=indent, sort_keys=False)
