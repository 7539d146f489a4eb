"""Precision settings: which dtype float and int tensors are stored in.

As in Burn, `Full` stores f32/i32, `Half` f16/i16 and `Double` f64/i64; `Native` keeps
every tensor's own dtype. Scalars and bool tensors are never converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import DType
from .items import Item, iter_tensors, map_tensors
from .protocols import PrecisionSettings
from .tensor import TensorData

__all__ = [
    "Precision",
    "FullPrecisionSettings",
    "HalfPrecisionSettings",
    "DoublePrecisionSettings",
    "NativePrecisionSettings",
    "settings_by_name",
    "convert_tensor",
    "convert_item",
    "is_lossless",
    "first_lossy",
]


@dataclass(frozen=True)
class Precision:
    """Concrete `PrecisionSettings`: target dtypes for float and int tensors (`None`: keep).

    Adapters may define their own instances (e.g. bf16 floats); `name` identifies the
    settings in file headers.
    """

    name: str
    float_dtype: DType | None
    int_dtype: DType | None

    def __post_init__(self) -> None:
        if self.float_dtype is not None and not self.float_dtype.is_float:
            raise ValueError(f"float_dtype must be a float dtype, got {self.float_dtype}")
        if self.int_dtype is not None and not self.int_dtype.is_int:
            raise ValueError(f"int_dtype must be an int dtype, got {self.int_dtype}")

    def target(self, dtype: DType) -> DType:
        """The dtype a tensor of `dtype` is stored in under these settings."""
        if dtype.is_float and self.float_dtype is not None:
            return self.float_dtype
        if dtype.is_int and self.int_dtype is not None:
            return self.int_dtype
        return dtype


@dataclass(frozen=True)
class FullPrecisionSettings(Precision):
    """Floats as f32, ints as i32."""

    name: str = "full"
    float_dtype: DType | None = DType.F32
    int_dtype: DType | None = DType.I32


@dataclass(frozen=True)
class HalfPrecisionSettings(Precision):
    """Floats as f16, ints as i16."""

    name: str = "half"
    float_dtype: DType | None = DType.F16
    int_dtype: DType | None = DType.I16


@dataclass(frozen=True)
class DoublePrecisionSettings(Precision):
    """Floats as f64, ints as i64."""

    name: str = "double"
    float_dtype: DType | None = DType.F64
    int_dtype: DType | None = DType.I64


@dataclass(frozen=True)
class NativePrecisionSettings(Precision):
    """Every tensor keeps its own dtype."""

    name: str = "native"
    float_dtype: DType | None = None
    int_dtype: DType | None = None


_BUILTIN: tuple[Precision, ...] = (
    FullPrecisionSettings(),
    HalfPrecisionSettings(),
    DoublePrecisionSettings(),
    NativePrecisionSettings(),
)


def settings_by_name(name: str, float_code: str | None, int_code: str | None) -> Precision:
    """The settings a file header describes."""
    f = None if float_code is None else DType.from_code(float_code)
    i = None if int_code is None else DType.from_code(int_code)
    for builtin in _BUILTIN:
        if (builtin.name, builtin.float_dtype, builtin.int_dtype) == (name, f, i):
            return builtin
    return Precision(name, f, i)


def convert_tensor(t: TensorData, settings: PrecisionSettings) -> TensorData:
    return t.cast(settings.target(t.dtype))


def convert_item(item: Item, settings: PrecisionSettings) -> Item:
    """A tree with every float and int tensor converted as `settings` say."""
    return map_tensors(item, lambda _, t: convert_tensor(t, settings))


def is_lossless(t: TensorData, target: DType) -> bool:
    """True when storing `t` as `target` and reading it back gives the same values.

    Float rounding, overflow to inf, int overflow and float->int truncation all count as
    lossy; NaN payloads do not (a NaN stays a NaN). Signed zeros are preserved by casts.
    """
    if target is t.dtype:
        return True
    src = t.array
    with np.errstate(all="ignore"):  # overflow is what we are detecting
        back = src.astype(target.numpy).astype(src.dtype)
    if t.dtype.is_float:
        same = (back == src) | (np.isnan(back) & np.isnan(src))
    else:
        same = back == src
    return bool(np.all(same))


def first_lossy(item: Item, settings: PrecisionSettings) -> str | None:
    """The key path of the first tensor whose values `settings` would change, or None."""
    for path, t in iter_tensors(item):
        if not is_lossless(t, settings.target(t.dtype)):
            return path
    return None
