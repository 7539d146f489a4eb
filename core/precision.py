"""Precision settings: which dtype float and signed int tensors are stored in.

As in Burn, `Full` stores f32/i32, `Half` f16/i16 and `Double` f64/i64; `Native` keeps
every tensor's own dtype. Settings choose the *storage* dtype only: a recorder records
each tensor's own dtype next to it and a load gives it back in that dtype. Unsigned ints
and bools are bit patterns (RNG states and keys, masks) and scalars are not tensors:
no setting converts them.

A recorder stores a tensor with `store_tensor`, which checks by value, in the same pass
as the cast, that the stored dtype holds every element (`LossyPrecisionError`
otherwise), and loads it with `restore_tensor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .errors import LossyPrecisionError
from .items.dtypes import DType
from .items.tensor import TensorData
from .items.tree import Item, iter_tensors, map_tensors

__all__ = [
    "PrecisionSettings",
    "Precision",
    "FullPrecisionSettings",
    "HalfPrecisionSettings",
    "DoublePrecisionSettings",
    "NativePrecisionSettings",
    "BF16PrecisionSettings",
    "settings_by_name",
    "convert_tensor",
    "convert_item",
    "store_tensor",
    "restore_tensor",
    "is_lossless",
    "first_lossy",
]


@runtime_checkable
class PrecisionSettings(Protocol):
    """Which dtype float and signed int tensors are stored in (`None`: keep their own).

    `target(dtype)` gives the stored dtype of a tensor of `dtype`; unsigned int and bool
    tensors (bit patterns) and scalars are never converted. `name` identifies the
    settings in file headers.
    """

    @property
    def name(self) -> str: ...
    @property
    def float_dtype(self) -> DType | None: ...
    @property
    def int_dtype(self) -> DType | None: ...
    def target(self, dtype: DType) -> DType: ...


@dataclass(frozen=True)
class Precision:
    """Concrete `PrecisionSettings`: storage dtypes for float and signed int tensors
    (`None`: keep).

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
        """The dtype a tensor of `dtype` is stored in under these settings (unsigned ints
        and bools: always their own)."""
        if dtype.is_float and self.float_dtype is not None:
            return self.float_dtype
        if dtype.is_signed_int and self.int_dtype is not None:
            return self.int_dtype
        return dtype


@dataclass(frozen=True)
class FullPrecisionSettings(Precision):
    """Floats as f32, signed ints as i32."""

    name: str = "full"
    float_dtype: DType | None = DType.F32
    int_dtype: DType | None = DType.I32


@dataclass(frozen=True)
class HalfPrecisionSettings(Precision):
    """Floats as f16, signed ints as i16."""

    name: str = "half"
    float_dtype: DType | None = DType.F16
    int_dtype: DType | None = DType.I16


@dataclass(frozen=True)
class DoublePrecisionSettings(Precision):
    """Floats as f64, signed ints as i64."""

    name: str = "double"
    float_dtype: DType | None = DType.F64
    int_dtype: DType | None = DType.I64


@dataclass(frozen=True)
class NativePrecisionSettings(Precision):
    """Every tensor keeps its own dtype."""

    name: str = "native"
    float_dtype: DType | None = None
    int_dtype: DType | None = None


@dataclass(frozen=True)
class BF16PrecisionSettings(Precision):
    """Floats as bf16, signed ints kept (`trainrec.adapters.torch` re-exports it)."""

    name: str = "bf16"
    float_dtype: DType | None = DType.BF16
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
    """`t` in its storage dtype under `settings`, unchecked (see `store_tensor`)."""
    return t.cast(settings.target(t.dtype))


def convert_item(item: Item, settings: PrecisionSettings) -> Item:
    """A tree with every float and signed int tensor converted as `settings` say."""
    return map_tensors(item, lambda _, t: convert_tensor(t, settings))


_CHUNK = 1 << 20
"""Elements cast and checked at a time: the check's temporaries stay small."""


def store_tensor(
    t: TensorData, settings: PrecisionSettings, *, key: str = "", allow_lossy: bool = False,
    recorder: str = "NamedMpkFileRecorder",
) -> TensorData:
    """`t` in the dtype `settings` store it in (`t` itself when that is its own).

    Every element is checked by value while it is cast (one pass over `t`): raises
    `LossyPrecisionError` naming `key`, the first element that would change and the
    recorder (`recorder` with `NativePrecisionSettings()`) that keeps it. `allow_lossy=True`
    accepts rounded floats only: an integer tensor (a counter, a step) that would change
    raises all the same, since a wrapped integer is never what a caller meant.
    """
    target = settings.target(t.dtype)
    if target is t.dtype:
        return t
    src = t.read().reshape(-1)
    out = np.empty(src.shape, target.numpy)
    with np.errstate(all="ignore"):  # overflow is what the check detects
        for at in range(0, src.size, _CHUNK):
            piece = src[at : at + _CHUNK]
            out[at : at + _CHUNK] = piece.astype(target.numpy)
            if allow_lossy and t.dtype.is_float:
                continue
            bad = np.flatnonzero(_changed(piece, out[at : at + _CHUNK], t.dtype, target))
            if bad.size:
                i = at + int(bad[0])
                raise _lossy(t, target, settings, i, src[i], out[i], key, recorder)
    return TensorData.from_array(out.reshape(t.shape), copy=False)


def restore_tensor(t: TensorData, saved: DType) -> TensorData:
    """A stored tensor back in the dtype it was saved with. Raises `ValueError` when no
    precision setting stores a `saved` tensor as `t.dtype` (floats stay floats, signed ints
    ints; unsigned ints and bools are never converted)."""
    if not restorable(t.dtype, saved):
        raise ValueError(f"a {saved.value} tensor is never stored as {t.dtype.value}")
    return t.cast(saved)


def restorable(stored: DType, saved: DType) -> bool:
    """Whether precision settings may store a tensor of dtype `saved` as `stored`."""
    if stored is saved:
        return True
    return (saved.is_float and stored.is_float) or (saved.is_signed_int and stored.is_int)


def is_lossless(t: TensorData, target: DType) -> bool:
    """True when storing `t` as `target` keeps every value, compared by value (not after
    a cast back, which hides int wrap-around): float rounding, overflow to inf,
    underflow, ints out of range and non-integral floats stored as ints all count as
    lossy; NaN payloads do not (a NaN stays a NaN). Signed zeros are preserved by casts.
    """
    if target is t.dtype:
        return True
    src = t.read().reshape(-1)
    with np.errstate(all="ignore"):
        for at in range(0, src.size, _CHUNK):
            piece = src[at : at + _CHUNK]
            if _changed(piece, piece.astype(target.numpy), t.dtype, target).any():
                return False
    return True


def first_lossy(item: Item, settings: PrecisionSettings) -> str | None:
    """The key path of the first tensor whose values `settings` would change, or None."""
    for path, t in iter_tensors(item):
        if not is_lossless(t, settings.target(t.dtype)):
            return path
    return None


def _bounds(d: DType) -> tuple[int, int]:
    if d is DType.BOOL:
        return 0, 1
    info = np.iinfo(d.numpy)  # type: ignore[type-var]  # an int dtype here
    return int(info.min), int(info.max)


_Array = np.ndarray[Any, Any]


def _changed(src: _Array, out: _Array, s: DType, d: DType) -> _Array:
    """Mask of the elements of `src` (dtype `s`) whose value `out` (`src` cast to `d`)
    does not hold. Every comparison is exact: f16, bf16 and f32 widen to f64 exactly, and
    ints are compared as ints."""
    changed: _Array
    if s is DType.BOOL:  # 0 and 1 fit every dtype
        changed = np.zeros(src.shape, bool)
    elif s.is_float and d.is_float:
        a, b = src.astype(np.float64), out.astype(np.float64)
        changed = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    elif s.is_float:  # to an int or bool: finite, integral and in range
        a = src.astype(np.float64)
        lo, hi = _bounds(d)
        changed = ~(np.isfinite(a) & (a == np.floor(a)) & (a >= float(lo)) & (a < float(hi + 1)))
    elif not d.is_float:  # int to int or bool: in range, checked before any wrap-around
        lo, hi = max(_bounds(d)[0], _bounds(s)[0]), min(_bounds(d)[1], _bounds(s)[1])
        kind = src.dtype.type
        changed = (src < kind(lo)) | (src > kind(hi))
    else:  # int to float: the float is that very integer (the bounds are exact floats)
        slo, shi = _bounds(s)
        f = out.astype(np.float64)
        ok = np.isfinite(f) & (f >= float(slo)) & (f < float(shi + 1))
        back = np.where(ok, f, 0.0).astype(src.dtype)
        changed = ~(ok & (back == src))
    return changed


def _lossy(
    t: TensorData, target: DType, settings: PrecisionSettings, index: int, value: Any,
    stored: Any, key: str, recorder: str,
) -> LossyPrecisionError:
    at = [int(i) for i in np.unravel_index(index, t.shape)] if t.shape else []
    as_number = float if t.dtype.is_float else int
    becomes = float(stored) if target.is_float else int(stored)
    message = (
        f"{settings.name} precision stores this {t.dtype.value} tensor as {target.value}, "
        f"which changes its values: element {at} is {as_number(value)!r} and would be stored "
        f"as {becomes!r}; {recorder}(NativePrecisionSettings()) keeps every dtype"
    )
    if t.dtype.is_float and target.is_float:
        message += ", or allow_lossy=True stores the rounded values"
    return LossyPrecisionError(message, key=key)
