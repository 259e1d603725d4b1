"""Program files are read within bounds (docs/program_schema.md, "Limits"): anything but a
regular file is refused before it is opened, a file over the size limit before it is
read, free JSON nested past the depth limit and an empty task list as schema errors. Each
refusal is one line that names the file, through the CLI and through the reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dataflow.bundle import BundleError, read_bundle
from dataflow.schema import Program, SchemaError
from dataflow.schema.program_file import MAX_PROGRAM_BYTES, MAX_PROGRAM_BYTES_ENV, MAX_PROGRAM_DEPTH
from dataflow.testing.cli import FAILURE_EXIT, USAGE_EXIT, assert_one_line_error, invoke
from dataflow.testing.programs import tiny_chain

#: A FIFO or a device must be refused at once; a reader that blocks or reads forever
#: would run into this.
PROMPT_S = 60
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")


def _document(**changes) -> dict:
    return {**tiny_chain().to_dict(), **changes}


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``args`` in a fresh interpreter that must finish within ``PROMPT_S``."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=PROMPT_S,
        env={**os.environ, **(env or {})},
    )


def _assert_one_line(found: subprocess.CompletedProcess, code: int, *culprits: str) -> None:
    """``assert_one_line_error`` of a finished process."""
    output = found.stdout + found.stderr
    result = SimpleNamespace(output=output, exit_code=found.returncode, stderr=found.stderr)
    assert_one_line_error(result, code, *culprits)


# -- not a regular file ------------------------------------------------------------------
@needs_fifo
@pytest.mark.parametrize("command", ["validate", "simulate", "plan"])
def test_a_fifo_is_refused_without_blocking(tmp_path, command: str) -> None:
    fifo = tmp_path / "program.json"
    os.mkfifo(fifo)
    budget = ["--budget", "1GiB"] if command != "validate" else []
    found = _run("-m", "dataflow", command, str(fifo), *budget)
    _assert_one_line(found, USAGE_EXIT, str(fifo), "a FIFO (named pipe), not a regular file")


@needs_fifo
def test_the_reader_refuses_a_fifo_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "program.json"
    os.mkfifo(fifo)
    script = "from dataflow.schema import Program; import sys; Program.from_json(sys.argv[1])"
    found = _run("-c", script, str(fifo))
    assert found.returncode == 1
    assert f"SchemaError: {fifo} is not a valid program" in found.stderr
    assert "a FIFO (named pipe), not a regular file" in found.stderr


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_dev_zero_is_refused_before_it_is_read() -> None:
    found = _run("-m", "dataflow", "validate", "/dev/zero")
    _assert_one_line(found, USAGE_EXIT, "/dev/zero", "a character device, not a regular file")
    with pytest.raises(SchemaError, match="(?s)/dev/zero is not a valid program.*character device"):
        Program.from_json(Path("/dev/zero"))


def test_a_directory_is_refused(tmp_path) -> None:
    assert_one_line_error(invoke("validate", tmp_path), USAGE_EXIT, str(tmp_path), "directory")
    with pytest.raises(SchemaError, match="a directory, not a regular file"):
        Program.from_json(tmp_path)


def test_a_bundle_whose_program_is_not_a_file_names_it(tmp_path) -> None:
    (tmp_path / "program.json").mkdir()
    with pytest.raises(BundleError, match=r"program.json: not a valid program: a directory"):
        read_bundle(tmp_path)


# -- size --------------------------------------------------------------------------------
def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as file:  # sparse: one byte past the limit, nothing written
        file.truncate(MAX_PROGRAM_BYTES + 1)
    line = assert_one_line_error(invoke("validate", big), FAILURE_EXIT, str(big))
    assert f"{MAX_PROGRAM_BYTES + 1:,} bytes, over the limit of {MAX_PROGRAM_BYTES:,}" in line
    assert MAX_PROGRAM_BYTES_ENV in line


def test_the_size_limit_can_be_set(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(tiny_chain().to_json())
    monkeypatch.setenv(MAX_PROGRAM_BYTES_ENV, str(path.stat().st_size - 1))
    assert_one_line_error(invoke("validate", path), FAILURE_EXIT, str(path), "over the limit")
    monkeypatch.setenv(MAX_PROGRAM_BYTES_ENV, str(path.stat().st_size))
    assert invoke("validate", path).exit_code == 0
    monkeypatch.setenv(MAX_PROGRAM_BYTES_ENV, "lots")
    assert_one_line_error(invoke("validate", path), FAILURE_EXIT, str(path), "'lots'")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_a_file_larger_than_its_stat_says_is_read_no_further_than_the_limit(monkeypatch) -> None:
    """/proc files are regular files of size 0 that hold more: the limit holds on the
    bytes read, not only on the size the file claims."""
    monkeypatch.setenv(MAX_PROGRAM_BYTES_ENV, "100")
    with pytest.raises(SchemaError, match="more than 100 bytes once read, over the limit"):
        Program.from_json(Path("/proc/self/status"))


# -- depth -------------------------------------------------------------------------------
def test_free_json_nested_past_the_limit_is_refused(tmp_path) -> None:
    document = _document()
    document["tasks"][0]["params"] = {"deep": _nested(MAX_PROGRAM_DEPTH)}
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(document))
    assert_one_line_error(
        invoke("validate", path),
        FAILURE_EXIT,
        str(path),
        f"$.tasks[0].params: nested deeper than the limit of {MAX_PROGRAM_DEPTH} levels",
    )
    document["tasks"][0]["params"] = {"deep": _nested(MAX_PROGRAM_DEPTH - 1)}
    path.write_text(json.dumps(document))
    assert invoke("validate", path).exit_code == 0  # the limit itself is fine


def test_nesting_too_deep_for_the_parser_is_refused_naming_the_file(tmp_path) -> None:
    path = tmp_path / "deeper.json"
    levels = 100_000
    path.write_text(
        '{"schema": "dataflow.program/v2", "metadata": ' + "[" * levels + "]" * levels + "}"
    )
    assert_one_line_error(
        invoke("validate", path),
        FAILURE_EXIT,
        str(path),
        f"nested deeper than the limit of {MAX_PROGRAM_DEPTH} levels",
    )


def test_a_deep_value_in_a_typed_field_is_a_short_type_error(tmp_path) -> None:
    document = _document()
    document["tasks"][0]["inputs"] = [_nested(500)]
    path = tmp_path / "typed.json"
    path.write_text(json.dumps(document))
    line = assert_one_line_error(
        invoke("validate", path), FAILURE_EXIT, str(path), "$.tasks[0].inputs[0]: expected str"
    )
    assert len(line) < 300  # the value is shown in part, not all 500 levels of it


# -- content -----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["validate", "simulate"])
def test_an_empty_task_list_is_a_validation_error(tmp_path, command: str) -> None:
    """(``plan`` reads through the same ``load_program``; it is left out as it loads the
    plugins, torch with them, before it reads the program.)"""
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(_document(tasks=[])))
    assert_one_line_error(
        invoke(command, path),
        FAILURE_EXIT,
        str(path),
        "$.tasks: empty; a program needs at least one task",
    )
    with pytest.raises(SchemaError, match=r"\$.tasks: empty"):
        Program.from_json(path)


def test_a_file_that_is_not_utf8_names_the_file(tmp_path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    assert_one_line_error(invoke("validate", path), FAILURE_EXIT, str(path), "not JSON")
