"""Registry records: frozen, validated at construction, keyed by name."""

from __future__ import annotations

import attrs
import pytest

from dataflow.registry import (
    FamilySpec,
    FeedSpec,
    KernelVariant,
    PlannerSpec,
    ResolverSpec,
    check_name,
)


def _load() -> str:
    return "loaded"


@pytest.mark.parametrize(
    "record",
    [
        FamilySpec("gpt2", "GPT-2", _load),
        ResolverSpec("eager", _load),
        KernelVariant("matmul", "reference", _load),
        FeedSpec("shards", _load),
        PlannerSpec("pressurefit", _load),
    ],
)
def test_records_are_frozen_attrs(record: object) -> None:
    assert attrs.has(type(record))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        record.description = "changed"  # type: ignore[misc]


@pytest.mark.parametrize("name", ["", "two words", "tab\there", " lead", "line\nbreak", 3, None])
def test_invalid_names_are_refused_naming_the_field(name: object) -> None:
    with pytest.raises((ValueError, TypeError)) as failure:
        PlannerSpec(name, _load)  # type: ignore[arg-type]
    assert "PlannerSpec.name" in str(failure.value)


def test_check_name_returns_a_valid_name() -> None:
    assert check_name("planner", "keep-all") == "keep-all"
    with pytest.raises(ValueError, match="planner 'keep all' is not a valid name"):
        check_name("planner", "keep all")


def test_the_callables_must_be_callable() -> None:
    with pytest.raises(TypeError, match="'load' must be callable"):
        FamilySpec("gpt2", "GPT-2", "dataflow_family_gpt2:load")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'plan' must be callable"):
        PlannerSpec("p", None)  # type: ignore[arg-type]


def test_kernel_variants_are_keyed_by_op_and_name() -> None:
    variant = KernelVariant("matmul", "triton", _load, devices=["cuda"], priority=3)
    assert variant.key == "matmul/triton"
    assert variant.devices == ("cuda",)
    assert (variant.deterministic, variant.priority) == (True, 3)


def test_kernel_devices_must_be_a_collection_of_names() -> None:
    with pytest.raises(TypeError, match=r"got the string 'cuda'; write \('cuda',\)"):
        KernelVariant("matmul", "triton", _load, devices="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one device"):
        KernelVariant("matmul", "triton", _load, devices=())
    with pytest.raises(ValueError, match="KernelVariant device 'cu da'"):
        KernelVariant("matmul", "triton", _load, devices=("cu da",))
    with pytest.raises(TypeError, match="'priority' must be <class 'int'>"):
        KernelVariant("matmul", "triton", _load, priority=1.5)  # type: ignore[arg-type]


def test_a_feed_scheme_has_no_colon() -> None:
    assert FeedSpec("shards", _load).key == "shards"
    with pytest.raises(ValueError, match="FeedSpec.scheme 'shards:v2' must not contain ':'"):
        FeedSpec("shards:v2", _load)


def test_keys_are_names() -> None:
    assert FamilySpec("gpt2", "", _load).key == "gpt2"
    assert ResolverSpec("eager", _load).key == "eager"
    assert PlannerSpec("keep-all", _load).key == "keep-all"
