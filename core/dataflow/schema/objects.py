"""Objects: the named byte ranges a Program's tasks read, change and create."""

from __future__ import annotations

import enum
import math

import attrs


class Role(enum.StrEnum):
    """What an object is for; planners may treat roles differently."""

    PARAM = "param"
    OPT_STATE = "opt_state"
    GRAD = "grad"
    ACTIVATION = "activation"
    AUX_TEMP = "aux_temp"
    AUX = "aux"
    DATA = "data"
    SCRATCH = "scratch"
    OUTPUT = "output"


class Location(enum.StrEnum):
    """Where an object lives: fast (device) or slow (pinned host) memory."""

    FAST = "fast"
    SLOW = "slow"


#: Bytes per element of every dtype a TensorMeta may name.
DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}


def _check_dtype(instance: TensorMeta, attribute: attrs.Attribute, value: str) -> None:
    if value not in DTYPE_BYTES:
        raise ValueError(f"dtype {value!r} is not one of {sorted(DTYPE_BYTES)}")


def _check_shape(instance: TensorMeta, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if any(dim < 0 for dim in value):
        raise ValueError(f"shape {value} has a negative dimension")


@attrs.frozen
class TensorMeta:
    """dtype and shape of the tensor an object holds; its bytes must equal ``Obj.size_bytes``."""

    dtype: str = attrs.field(validator=_check_dtype)
    shape: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@attrs.frozen
class Obj:
    """A named object of exact size. ``location`` is where it starts (objects a task
    creates start nowhere and are born in fast memory; their ``location`` is ignored)."""

    id: str
    size_bytes: int
    role: Role = attrs.field(converter=Role)
    location: Location = attrs.field(default=Location.SLOW, converter=Location)
    tensor: TensorMeta | None = None
