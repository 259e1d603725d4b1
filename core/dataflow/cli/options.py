"""Option types every command shares; each checks its value before any work is done.

- ``BUDGET`` / ``Size``: ``4GiB``, ``300MB``, ``1024`` into bytes; a budget is > 0.
- ``PROGRAM_BUDGET``: a budget, or ``none`` (``UNBOUNDED``), where the default is the
  program's own; ``with_budgets`` hands a program and its budgets on.
- ``COUNT``: a whole number >= 1 (steps, rounds, batch, ...).
- ``OutputFile``: a file to write; its folder exists or can be made (``write_to`` makes it).
- ``Device``: ``cpu``, ``cuda`` or ``cuda:N``, and the device must exist here.
- ``lookup``: a name from a plugin registry, or a usage error listing the known names.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import click

from dataflow.units import format_size, parse_size

if TYPE_CHECKING:
    from dataflow.schema import Program

#: A count of steps, rounds, sequences, tokens...: at least 1.
COUNT = click.IntRange(min=1)


class Size(click.ParamType):
    """A byte size as people write it; at least ``minimum_bytes``."""

    name = "size"

    def __init__(self, minimum_bytes: int = 1) -> None:
        self.minimum_bytes = minimum_bytes

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            size_bytes = value
        else:
            try:
                size_bytes = parse_size(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if size_bytes < self.minimum_bytes:
            self.fail(
                f"{value!r} is {size_bytes} bytes; give at least "
                f"{format_size(self.minimum_bytes)}, e.g. 300MiB",
                param,
                ctx,
            )
        return size_bytes


#: A memory budget: more than 0 bytes (0 would hold nothing, not mean "unbounded").
BUDGET = Size(minimum_bytes=1)


class Limit(enum.Enum):
    #: ``--budget none``: no limit, not even the program's own
    UNBOUNDED = "none"


UNBOUNDED = Limit.UNBOUNDED


class ProgramBudget(Size):
    """A budget whose default is the program's own: a size, or ``none`` for no limit at
    all (``UNBOUNDED``)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is UNBOUNDED or (isinstance(value, str) and value.strip().lower() == "none"):
            return UNBOUNDED
        return super().convert(value, param, ctx)


PROGRAM_BUDGET = ProgramBudget(minimum_bytes=1)


def with_budgets(
    program: Program, fast: int | Limit | None, slow: int | Limit | None
) -> tuple[Program, int | None, int | None]:
    """``(program, fast, slow)`` to hand the simulator or a planner for ``--budget`` and
    ``--slow-budget``: a size overrides the program's budget, None keeps it, and
    ``UNBOUNDED`` lifts its limit (the program goes on without its own budget, the other
    limit as it was)."""
    if UNBOUNDED not in (fast, slow):
        return program, fast, slow
    own = program.budget
    if fast is None and own is not None:
        fast = own.fast_bytes
    if slow is None and own is not None:
        slow = own.slow_bytes
    unbounded = (None if fast is UNBOUNDED else fast, None if slow is UNBOUNDED else slow)
    return attrs.evolve(program, budget=None), *unbounded


def size_callback(ctx: click.Context, param: click.Parameter, value: Any) -> int | None:
    """A click callback form of ``BUDGET`` (None stays None)."""
    return None if value is None else BUDGET.convert(value, param, ctx)


class OutputFile(click.ParamType):
    """A file the command will write: not a folder, and inside a folder that exists or can
    be made (the command makes it only when it writes, after the work succeeded)."""

    name = "file"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        path = Path(value)
        if path.is_dir():
            self.fail(
                f"{value!r} is a folder; name a file in it, e.g. {path / 'out.json'}", param, ctx
            )
        ancestor = path.absolute().parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            self.fail(
                f"cannot make folder {str(path.parent)!r}: {str(ancestor)!r} is a file", param, ctx
            )
        writable = path if path.exists() else ancestor
        if not os.access(writable, os.W_OK):
            self.fail(f"cannot write {str(writable)!r}: permission denied", param, ctx)
        return str(value)


def write_to(path: str) -> Path:
    """``path`` as a Path whose folder exists (made now, if ``OutputFile`` let it through)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


class Device(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA must be built into torch and the device present."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        if text == "cpu":
            return text
        kind, _, index = text.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            self.fail(f"{value!r} is not a device; use cpu, cuda or cuda:N", param, ctx)
        problem = cuda_problem(int(index) if index else 0)
        if problem:
            self.fail(f"{value!r}: {problem}; use --device cpu", param, ctx)
        return text


def cuda_problem(index: int = 0) -> str | None:
    """Why CUDA device ``index`` cannot be used here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "torch sees no CUDA device on this machine"
    if index >= count:
        return f"there are only {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def lookup(registry: Any, name: str, option: str) -> Any:
    """``registry.get(name)``, or a usage error naming ``option`` and the known names."""
    from dataflow.registry import UnknownNameError

    try:
        return registry.get(name)
    except UnknownNameError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


def parse_value(text: str) -> bool | int | float | str:
    """A per-run value as typed on the command line: ``true``/``false`` (any case) a bool,
    then an int, then a float, else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class RunValue(click.ParamType):
    """``NAME=VALUE``: one per-run value (``parse_value`` types it)."""

    name = "NAME=VALUE"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        name, eq, text = str(value).partition("=")
        if not eq or not name.strip():
            self.fail(f"{value!r} is not NAME=VALUE (e.g. lr=1e-3)", param, ctx)
        return name.strip(), parse_value(text.strip())


def value_options(command: Any) -> Any:
    """``--value NAME=VALUE`` (repeatable) and ``--values FILE.json`` on ``command``: the
    per-run values ``run_values`` collects."""
    command = click.option(
        "--values",
        "values_file",
        default=None,
        type=click.Path(dir_okay=False),
        metavar="FILE.json",
        help="per-run values from a JSON object of names to numbers, bools or strings "
        "(--value wins where both name one)",
    )(command)
    return click.option(
        "--value",
        "value_pairs",
        multiple=True,
        type=RunValue(),
        help="a per-run value the tasks read as ctx.values[NAME], e.g. lr=1e-3 (repeatable; "
        "typed: int, float, true/false, else a string)",
    )(command)


def run_values(pairs: tuple[tuple[str, Any], ...], values_file: str | None) -> dict[str, Any]:
    """The per-run values of ``--values FILE.json`` and then ``--value`` pairs; a file that
    cannot be read or is not an object of scalars is a usage error naming it."""
    import json

    values: dict[str, Any] = {}
    if values_file is not None:
        try:
            loaded = json.loads(Path(values_file).read_text())
        except OSError as exc:
            raise click.BadParameter(
                f"cannot read {values_file}: {exc.strerror}", param_hint="--values"
            ) from None
        except ValueError as exc:
            raise click.BadParameter(
                f"{values_file} is not JSON: {exc}", param_hint="--values"
            ) from None
        if not isinstance(loaded, dict):
            raise click.BadParameter(
                f"{values_file} holds a {type(loaded).__name__}, not an object of names to values",
                param_hint="--values",
            )
        for name, value in loaded.items():
            if not isinstance(value, (bool, int, float, str)):
                raise click.BadParameter(
                    f"{values_file}: value {name!r} is a {type(value).__name__}, not a "
                    "number, bool or string",
                    param_hint="--values",
                )
            values[name] = value
    values.update(dict(pairs))
    if "step" in values:
        raise click.BadParameter(
            "'step' is set by the engine (the global step index); name the value otherwise",
            param_hint="--value",
        )
    return values
