"""A malformed document gets errors that name the exact field path, all at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.schema import Program, SchemaError

GOLDEN = Path(__file__).parent / "golden" / "two_layer_chain.json"


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _problems(document: dict) -> list[str]:
    with pytest.raises(SchemaError) as caught:
        Program.from_dict(document)
    return caught.value.problems


def test_every_fault_is_reported_with_its_path() -> None:
    document = _golden()
    document["objects"][0]["role"] = "weights"
    document["objects"][1]["sizze"] = 1
    document["objects"][2]["size_bytes"] = "512"
    document["tasks"][1]["inputs"][1] = 7
    del document["tasks"][0]["compute_key"]
    document["links"]["d2h"]["latency_us"] = True
    document["final_locations"]["y_1"] = "disk"
    problems = _problems(document)
    assert problems[0].startswith("$.objects[0].role: 'weights' is not a valid Role")
    assert "$.objects[1]: unknown field(s) ['sizze']" in problems
    assert "$.objects[2].size_bytes: expected int, got str '512'" in problems
    assert "$.tasks[1].inputs[1]: expected str, got int 7" in problems
    assert "$.tasks[0].compute_key: required field missing" in problems
    assert "$.links.d2h.latency_us: expected float, got bool True" in problems
    assert any(line.startswith("$.final_locations['y_1']: 'disk'") for line in problems)
    assert len(problems) == 7


def test_unknown_top_level_key() -> None:
    document = _golden()
    document["comment"] = "hi"
    assert _problems(document) == ["$: unknown field(s) ['comment']"]


def test_missing_and_unknown_schema_version() -> None:
    document = _golden()
    del document["schema"]
    assert _problems(document) == ["$.schema: required field missing"]
    document["schema"] = "dataflow.program/v9"
    (line,) = _problems(document)
    assert line.startswith("$.schema: unknown version 'dataflow.program/v9'")


def test_tensor_dtype_is_checked() -> None:
    document = _golden()
    document["objects"][0]["tensor"]["dtype"] = "float33"
    (line,) = _problems(document)
    assert line.startswith("$.objects[0].tensor: dtype 'float33' is not one of")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text('{"schema": ')
    with pytest.raises(SchemaError, match="broken.json is not a valid program") as caught:
        Program.from_json(bad)
    assert caught.value.problems[0].startswith("not JSON:")
    with pytest.raises(SchemaError, match="missing.json"):
        Program.from_json(tmp_path / "missing.json")


def test_not_an_object() -> None:
    with pytest.raises(SchemaError) as caught:
        Program.from_json("[1, 2]")
    assert caught.value.problems == ["$: expected a JSON object, got list"]
    with pytest.raises(SchemaError) as caught:
        Program.from_json(str(GOLDEN.parent / "nope.json"))
    assert "cannot read the file" in caught.value.problems[0]


def test_migration_steps_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataflow.schema import converter

    def v0_to_v1(body: dict) -> dict:
        body = dict(body)
        body["name"] = body.pop("title")
        return body

    monkeypatch.setitem(
        converter.MIGRATIONS, "dataflow.program/v0", ("dataflow.program/v1", v0_to_v1)
    )
    document = _golden()
    document["schema"] = "dataflow.program/v0"
    document["title"] = document.pop("name")
    assert Program.from_dict(document).name == "two-layer-chain"
