"""The hardware table of the roofline cost model: one entry per device, kept as data.

The table ships in ``data/hardware.toml`` (an ``h200`` entry, every figure with its
source). Users add devices, or override a shipped one, with TOML files of the same shape:
named by ``DATAFLOW_HARDWARE`` (paths separated by ``os.pathsep``) or passed to
``load_table(extra=...)`` (``dataflow predict --hw-file``). A later file's entry replaces
an earlier one of the same name.

An entry prices a lowered step (``entry.roofline(dtype)`` -> ``RooflineCost``) and gives
its links (``entry.links()`` -> ``Links``)::

    hw = hardware("h200")
    lower(family, preset, train, cost=hw.roofline(train.dtype.param), links=hw.links())
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from dataflow import Link, Links
from dataflow_training.step.costs import RooflineCost

#: Names the files of user entries (``os.pathsep``-separated paths).
HARDWARE_ENV = "DATAFLOW_HARDWARE"

_REQUIRED = (
    "flops_per_us",
    "hbm_bytes_per_us",
    "h2d_bytes_per_us",
    "d2h_bytes_per_us",
)
_OPTIONAL = {
    "description": "",
    "duplex_bytes_per_us": None,
    "h2d_latency_us": 0.0,
    "d2h_latency_us": 0.0,
    "launch_us": 0.0,
    "dispatch_us": 0.0,
    "allreduce_busbw_bytes_per_us": {},
    "allreduce_latency_us": {},
    "host_memory_bytes": None,
    "sources": {},
}

#: Where a fleet's all-reduce runs: every rank on one host, or ranks on several hosts.
COLLECTIVE_SCOPES = ("nvlink", "network")


class HardwareError(ValueError):
    """A hardware table is malformed or names no such device; the message names the file,
    entry and field."""


@attrs.frozen
class HardwareEntry:
    """One device: rates in FLOP/us and bytes/us, times in us (see data/hardware.toml).

    ``flops_per_us`` maps a storage dtype (``bfloat16``, ``float32``) to the dense matrix
    rate; ``duplex_bytes_per_us`` is the two directions' total when both copy at once
    (None: not measured); ``sources`` names where each figure comes from.
    """

    name: str
    flops_per_us: Mapping[str, float] = attrs.field(converter=dict, hash=False)
    hbm_bytes_per_us: float
    h2d_bytes_per_us: float
    d2h_bytes_per_us: float
    description: str = ""
    duplex_bytes_per_us: float | None = None
    h2d_latency_us: float = 0.0
    d2h_latency_us: float = 0.0
    launch_us: float = 0.0
    dispatch_us: float = 0.0
    #: per scope (``COLLECTIVE_SCOPES``): NCCL-tests bus bandwidth and small-message latency
    allreduce_busbw_bytes_per_us: Mapping[str, float] = attrs.field(
        factory=dict, converter=dict, hash=False
    )
    allreduce_latency_us: Mapping[str, float] = attrs.field(
        factory=dict, converter=dict, hash=False
    )
    #: the host memory beside the device (None: not stated): what a plan's pinned pool and
    #: host copies may hold when a step is searched for this entry (``dataflow predict``)
    host_memory_bytes: int | None = None
    sources: Mapping[str, str] = attrs.field(factory=dict, converter=dict, hash=False)
    origin: str = ""

    def roofline(self, dtype: str = "bfloat16") -> RooflineCost:
        """The cost model of tasks whose compute runs in ``dtype``."""
        if dtype not in self.flops_per_us:
            raise HardwareError(
                f"hardware {self.name!r} ({self.origin}) has no flops_per_us.{dtype}; it has "
                f"{', '.join(sorted(self.flops_per_us))}"
            )
        return RooflineCost(
            self.flops_per_us[dtype], self.hbm_bytes_per_us, self.launch_us, self.dispatch_us
        )

    def links(self, ranks: int | None = None, scope: str = "nvlink") -> Links:
        """The links to pinned host memory (each direction alone, and both at once:
        ``duplex_bytes_per_us``); with ``ranks``, also the collective link of a fleet of
        that many ranks (``collective_link``)."""
        return Links(
            h2d=Link(self.h2d_bytes_per_us, self.h2d_latency_us),
            d2h=Link(self.d2h_bytes_per_us, self.d2h_latency_us),
            collective=None if ranks is None else self.collective_link(ranks, scope),
            duplex_bytes_per_us=self.duplex_bytes_per_us,
        )

    def collective_link(self, ranks: int, scope: str = "nvlink") -> Link:
        """The all-reduce of a fleet of ``ranks`` members on ``scope``: a ring moves
        ``2 (n - 1) / n`` of the bytes over each rank's link, so the bandwidth per byte
        reduced (algbw) is ``busbw x n / (2 (n - 1))``. One rank reduces with itself: a
        copy within device memory (read and written)."""
        if scope not in self.allreduce_busbw_bytes_per_us:
            raise HardwareError(
                f"hardware {self.name!r} ({self.origin}) has no "
                f"allreduce_busbw_bytes_per_us.{scope}; it has "
                f"{', '.join(sorted(self.allreduce_busbw_bytes_per_us)) or 'none'}"
            )
        if ranks < 1:
            raise ValueError(f"a fleet has at least one rank, got {ranks}")
        latency = self.allreduce_latency_us.get(scope, 0.0)
        if ranks == 1:
            return Link(self.hbm_bytes_per_us / 2, latency)
        busbw = self.allreduce_busbw_bytes_per_us[scope]
        return Link(busbw * ranks / (2 * (ranks - 1)), latency)


def _entry(name: str, fields: Any, origin: str) -> HardwareEntry:
    where = f"{origin} [{name}]"
    if not isinstance(fields, dict):
        raise HardwareError(f"{where}: an entry is a table of fields")
    missing = [key for key in _REQUIRED if key not in fields]
    if missing:
        raise HardwareError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(fields) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise HardwareError(f"{where}: unknown field(s) {', '.join(unknown)}")
    values = {**_OPTIONAL, **fields}
    rates = values["flops_per_us"]
    if not isinstance(rates, dict) or not rates:
        raise HardwareError(f"{where}: flops_per_us is a table of dtype = FLOP per us")
    for key in ("hbm_bytes_per_us", "h2d_bytes_per_us", "d2h_bytes_per_us"):
        _positive(where, key, values[key])
    for dtype, rate in rates.items():
        _positive(where, f"flops_per_us.{dtype}", rate)
    for key in ("duplex_bytes_per_us", "host_memory_bytes"):
        if values[key] is not None:
            _positive(where, key, values[key])
    for key in ("h2d_latency_us", "d2h_latency_us", "launch_us", "dispatch_us"):
        if not isinstance(values[key], int | float) or values[key] < 0:
            raise HardwareError(f"{where}: {key} must be a number >= 0, got {values[key]!r}")
    for key in ("allreduce_busbw_bytes_per_us", "allreduce_latency_us"):
        table = values[key]
        if not isinstance(table, dict):
            raise HardwareError(f"{where}: {key} is a table of scope = number")
        for scope, value in table.items():
            if scope not in COLLECTIVE_SCOPES:
                raise HardwareError(
                    f"{where}: {key}.{scope}: unknown scope; known: {', '.join(COLLECTIVE_SCOPES)}"
                )
            if key.endswith("latency_us"):
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise HardwareError(f"{where}: {key}.{scope} must be a number >= 0")
            else:
                _positive(where, f"{key}.{scope}", value)
    return HardwareEntry(name=name, origin=origin, **values)


def _positive(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise HardwareError(f"{where}: {key} must be a number > 0, got {value!r}")


def _read(path: Path) -> dict[str, HardwareEntry]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HardwareError(f"hardware file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise HardwareError(f"hardware file {path}: {exc}") from None
    return {name: _entry(name, fields, str(path)) for name, fields in data.items()}


def builtin_path() -> Path:
    return Path(str(resources.files("dataflow_training") / "data" / "hardware.toml"))


def load_table(extra: Iterable[str | Path] = ()) -> dict[str, HardwareEntry]:
    """Every entry: the shipped table, then the files ``DATAFLOW_HARDWARE`` names, then
    ``extra``; a later entry replaces an earlier one of its name."""
    paths = [builtin_path()]
    paths += [Path(p) for p in os.environ.get(HARDWARE_ENV, "").split(os.pathsep) if p]
    paths += [Path(p) for p in extra]
    table: dict[str, HardwareEntry] = {}
    for path in paths:
        table.update(_read(path))
    return table


def hardware(name: str, extra: Iterable[str | Path] = ()) -> HardwareEntry:
    """The entry named ``name`` (see ``load_table``)."""
    table = load_table(extra)
    if name not in table:
        raise HardwareError(
            f"no hardware entry {name!r}; known: {', '.join(sorted(table))} (add one in a "
            f"TOML file named by {HARDWARE_ENV} or --hw-file)"
        )
    return table[name]
