"""Runs from files: a bundle folder ``dataflow export`` (or ``dataflow train
--trace-steps``) wrote, and measured timelines on their own (``dataflow.bundle``,
``dataflow.timeline.wire``). Every error is a ``ViewerError`` naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from dataflow import (
    Bundle,
    BundleError,
    Timeline,
    TimelineFormatError,
    read_bundle,
    timeline_from_dict,
)
from dataflow_viewer.run import Run, ViewerError

PROGRAM_FILE = "program.json"


def bundle_folder(path: str | Path) -> Path:
    """The bundle in ``path``: the folder itself, or the one folder below it that holds a
    bundle (a training run's ``OUT`` holds its bundle in a subfolder)."""
    path = Path(path)
    if not path.exists():
        raise ViewerError(f"{path}: no such folder")
    if not path.is_dir():
        raise ViewerError(f"{path}: not a folder (give the folder `dataflow export` wrote)")
    if (path / PROGRAM_FILE).exists():
        return path
    below = sorted(p.parent for p in path.glob(f"*/{PROGRAM_FILE}"))
    if len(below) == 1:
        return below[0]
    if not below:
        raise ViewerError(
            f"{path}: no {PROGRAM_FILE} in it or in a folder below it; "
            "write a bundle with `dataflow export`"
        )
    raise ViewerError(f"{path}: several bundles below it ({', '.join(map(str, below))}); name one")


def read_run(path: str | Path) -> Run:
    """The run in a bundle folder (``bundle_folder``)."""
    folder = bundle_folder(path)
    try:
        bundle = read_bundle(folder)
    except BundleError as exc:
        raise ViewerError(str(exc)) from None
    return run_of_bundle(bundle, source=str(folder))


def run_of_bundle(bundle: Bundle, source: str = "") -> Run:
    plan = bundle.plan
    return Run(
        program=bundle.program,
        predicted=bundle.timeline,
        measured=bundle.measured,
        budget_bytes=plan.budget_bytes,
        planner=plan.planner,
        source=source or bundle.program.name,
        summary=bundle.summary,
    )


def timeline_from_json(text: str, source: str) -> Timeline:
    """The timeline in the JSON ``text`` (``source`` names it in errors)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ViewerError(f"{source}: not JSON ({exc})") from None
    try:
        return timeline_from_dict(data, source)
    except TimelineFormatError as exc:
        raise ViewerError(str(exc)) from None


def read_timeline_file(path: str | Path) -> Timeline:
    """The timeline in the JSON file ``path``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ViewerError(f"{path}: cannot be read ({exc.strerror})") from None
    return timeline_from_json(text, str(path))
