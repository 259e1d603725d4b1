"""Timelines as JSON: one cattrs converter, a versioned ``format`` key.

``{"format": "dataflow.timeline/v1", "name": ..., "tasks": [...], "transfers": [...],
"counters": [...], "instants": [...], "metadata": {...}}``: times in microseconds, sizes
in bytes; a counter's points as ``[time_us, value]`` pairs. Unknown keys are errors, and
an error names the field path (``$.tasks[3].start_us``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cattrs

from dataflow.timeline.records import Timeline

FORMAT_KEY = "format"
TIMELINE_FORMAT = "dataflow.timeline/v1"


class TimelineFormatError(ValueError):
    """A document that is not a timeline; the message names the source and the field."""


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook_func(
        lambda t: t == dict[str, Any], lambda value, _: _json_object(value)
    )
    return converter


def _json_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return dict(value)


CONVERTER = _converter()


def timeline_to_dict(timeline: Timeline) -> dict[str, Any]:
    return {FORMAT_KEY: TIMELINE_FORMAT, **CONVERTER.unstructure(timeline)}


def timeline_from_dict(data: Any, source: str = "timeline") -> Timeline:
    """The Timeline in ``data``; ``TimelineFormatError`` naming ``source`` and the field."""
    if not isinstance(data, Mapping):
        raise TimelineFormatError(f"{source}: expected a JSON object, got {type(data).__name__}")
    found = data.get(FORMAT_KEY)
    if found != TIMELINE_FORMAT:
        raise TimelineFormatError(
            f"{source}: format is {found!r}; this version reads {TIMELINE_FORMAT!r}"
        )
    body = {k: v for k, v in data.items() if k != FORMAT_KEY}
    try:
        return CONVERTER.structure(body, Timeline)
    except cattrs.BaseValidationError as exc:
        raise TimelineFormatError(f"{source}: {'; '.join(describe(exc))}") from None
    except (TypeError, ValueError) as exc:
        raise TimelineFormatError(f"{source}: {exc}") from None


def write_timeline(path: str | Path, timeline: Timeline) -> Path:
    """Write ``timeline`` as JSON to ``path``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline_to_dict(timeline), separators=(",", ":")))
    return path


def read_timeline(path: str | Path) -> Timeline:
    """The Timeline in the JSON file ``path`` (errors name the file)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise TimelineFormatError(f"{path}: cannot be read ({exc.strerror})") from None
    except ValueError as exc:
        raise TimelineFormatError(f"{path}: not JSON ({exc})") from None
    return timeline_from_dict(data, str(path))


def describe(exc: BaseException, path: str = "$") -> list[str]:
    """One line per fault of a cattrs validation error, each starting with its field path."""
    if isinstance(exc, cattrs.BaseValidationError):
        lines = cattrs.transform_error(exc, path=path)
        return [f"{where}: {what}" for what, _, where in (line.rpartition(" @ ") for line in lines)]
    return [f"{path}: {exc}"]
