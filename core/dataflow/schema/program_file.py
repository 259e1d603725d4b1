"""Reading a program file within bounds: a regular file, at most ``MAX_PROGRAM_BYTES``.

The file is looked at before it is read: anything but a regular file (a directory, a
device such as ``/dev/zero``, a FIFO, a socket) is refused from its ``stat``, so that a
FIFO never blocks the reader and a device never feeds it forever. The file is opened
without blocking and checked again on the open descriptor (it may have been swapped
since), and at most ``MAX_PROGRAM_BYTES + 1`` bytes are read: a file that grows past the
limit while it is read is refused too, not read to its end.

``MAX_PROGRAM_DEPTH`` bounds the nesting of the free JSON fields (a task's ``params``,
the program's ``metadata``); the converter applies it (``json_depth_problem``) with no
recursion of its own. Every other field has a fixed shape, so a document nested deeper
than the limit is refused either there, as a type error of the field that holds the
nesting, or by the JSON parser itself (``json_loads``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dataflow.units import format_size

#: The largest program file read, in bytes (1 GiB). A chain program takes about 550 bytes
#: of JSON a task and about 4 KiB of memory a task once read (docs/program_schema.md,
#: "Limits"), so the limit is about two million tasks, some 8 GiB of memory.
MAX_PROGRAM_BYTES = 2**30
#: Environment variable that raises (or lowers) ``MAX_PROGRAM_BYTES``, in bytes.
MAX_PROGRAM_BYTES_ENV = "DATAFLOW_MAX_PROGRAM_BYTES"
#: How deep the free JSON of a program (``params``, ``metadata``) may nest: a lowered
#: training step nests 9 levels in all; Python's parser gives up near 1000.
MAX_PROGRAM_DEPTH = 100

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


class ProgramFileError(ValueError):
    """A program file that cannot be read within bounds; the message names the file."""


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (``a FIFO (named pipe)``, ``a directory``)."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def not_regular(path: str | Path) -> str | None:
    """Why ``path`` cannot be a program file without reading it (it is a directory, a
    device, a FIFO or a socket), or None when it is a regular file. ``OSError`` when it
    cannot be looked at."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return f"{file_kind(mode)}, not a regular file; a program is a JSON file"


def max_program_bytes() -> int:
    """``MAX_PROGRAM_BYTES``, or the environment's ``DATAFLOW_MAX_PROGRAM_BYTES``."""
    value = os.environ.get(MAX_PROGRAM_BYTES_ENV)
    if value is None:
        return MAX_PROGRAM_BYTES
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ProgramFileError(
            f"{MAX_PROGRAM_BYTES_ENV}={value!r} is not a size in bytes; give a whole "
            f"number >= 1, e.g. {MAX_PROGRAM_BYTES}"
        )
    return limit


def read_program_bytes(path: str | Path) -> bytes:
    """The bytes of the program file ``path``; ``ProgramFileError`` naming it when it is
    not a regular file, is larger than the limit or cannot be read."""
    limit = max_program_bytes()
    try:
        problem = not_regular(path)
        if problem is not None:
            raise ProgramFileError(f"{path}: {problem}")
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ProgramFileError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    with os.fdopen(descriptor, "rb") as file:
        found = os.fstat(file.fileno())
        if not stat.S_ISREG(found.st_mode):  # swapped for something else since the stat
            raise ProgramFileError(f"{path}: {file_kind(found.st_mode)}, not a regular file")
        if found.st_size > limit:
            raise ProgramFileError(_too_large(path, f"{found.st_size:,} bytes", limit))
        try:
            data = file.read(limit + 1)
        except OSError as exc:
            raise ProgramFileError(f"{path}: cannot read the file: {exc.strerror}") from None
    if len(data) > limit:
        raise ProgramFileError(_too_large(path, f"more than {limit:,} bytes once read", limit))
    return data


def _too_large(path: str | Path, size: str, limit: int) -> str:
    return (
        f"{path}: {size}, over the limit of {limit:,} bytes ({format_size(limit)}) for a "
        f"program file; set {MAX_PROGRAM_BYTES_ENV} to a larger number of bytes to read it"
    )


def json_loads(data: str | bytes) -> Any:
    """``json.loads``; a document nested too deep for the parser is a ``ValueError``
    stating the limit, not a ``RecursionError``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"nested deeper than the limit of {MAX_PROGRAM_DEPTH} levels") from None


def json_depth_problem(value: Any, limit: int = MAX_PROGRAM_DEPTH) -> str | None:
    """Why the JSON value ``value`` nests too deep (more than ``limit`` levels of objects
    and arrays below it), or None. Walks with a stack of its own, never recursing."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return f"nested deeper than the limit of {limit} levels"
                pending.append((child, depth + 1))
    return None
