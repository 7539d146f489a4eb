"""Element types of recorded tensors, independent of any framework.

Host arrays are numpy arrays; bfloat16 comes from `ml_dtypes`, imported the first time a
bfloat16 is needed (importing it costs more than the rest of trainrec: a run without bf16
never pays it). On disk every dtype is named by its short code (`"f32"`, `"bf16"`, ...),
always little-endian.
"""

from __future__ import annotations

import enum
import sys

import numpy as np

__all__ = ["DType", "FloatDType", "is_bfloat16"]


class DType(enum.Enum):
    """A tensor element type. The value is the code written in files."""

    F64 = "f64"
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I64 = "i64"
    I32 = "i32"
    I16 = "i16"
    I8 = "i8"
    U8 = "u8"
    U16 = "u16"
    U32 = "u32"
    U64 = "u64"
    BOOL = "bool"

    @property
    def numpy(self) -> np.dtype[np.generic]:
        """The little-endian numpy dtype holding this element type."""
        return _NUMPY[self] if self is not DType.BF16 else _bfloat16()

    @property
    def itemsize(self) -> int:
        return 2 if self is DType.BF16 else int(_NUMPY[self].itemsize)

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_signed_int(self) -> bool:
        """i8 to i64: the ints precision settings may store in another dtype (unsigned ints
        and bools are bit patterns, always kept)."""
        return self in _SIGNED_INTS

    @classmethod
    def from_code(cls, code: object) -> DType:
        """The dtype named by a file code; raises `ValueError` for anything else."""
        for member in cls:
            if member.value == code:
                return member
        raise ValueError(f"unknown dtype code {code!r}")

    @classmethod
    def from_numpy(cls, dtype: np.dtype[np.generic] | type) -> DType:
        """The dtype of a numpy array; raises `TypeError` for types trainrec cannot record."""
        nd = np.dtype(dtype)
        for member, candidate in _NUMPY.items():
            if nd == candidate or nd == candidate.newbyteorder(">"):
                return member
        if is_bfloat16(nd):
            return DType.BF16
        raise TypeError(
            f"numpy dtype {nd} cannot be recorded; supported: "
            + ", ".join(m.value for m in cls)
        )


class FloatDType(enum.Enum):
    """A floating-point element type, as taken by `accumulate_with_dtype`."""

    F64 = "f64"
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"

    @property
    def dtype(self) -> DType:
        return DType(self.value)

    @classmethod
    def of(cls, dtype: object) -> FloatDType:
        """The float dtype `dtype` names: a `FloatDType`, a float `DType`, a numpy or JAX
        float dtype or type (`np.float32`, `jnp.bfloat16`), a torch float dtype, or a name
        (`"float32"`, `"bfloat16"`, a file code such as `"f32"`). Raises `TypeError` for
        anything else, saying where `FloatDType` lives."""
        if isinstance(dtype, FloatDType):
            return dtype
        if isinstance(dtype, DType) and dtype.is_float:
            return cls(dtype.value)
        name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
        for member in cls:
            if name == member.value:
                return member
        found = None
        if name is not None and not isinstance(name, DType):  # np.dtype(None) is float64
            try:
                found = DType.from_numpy(np.dtype(name))  # type: ignore[call-overload]
            except (TypeError, ValueError):
                pass
        if found is None or not found.is_float:
            raise TypeError(
                f"dtype must be a float dtype (float64, float32, float16, bfloat16), got {dtype!r}: "
                "pass trainrec.FloatDType.F32 (from trainrec import FloatDType), a numpy or JAX float "
                "dtype (np.float32, jnp.bfloat16), a torch one (torch.float32) or a name ('float32')")
        return cls(found.value)


_NUMPY: dict[DType, np.dtype[np.generic]] = {
    DType.F64: np.dtype("<f8"),
    DType.F32: np.dtype("<f4"),
    DType.F16: np.dtype("<f2"),
    DType.I64: np.dtype("<i8"),
    DType.I32: np.dtype("<i4"),
    DType.I16: np.dtype("<i2"),
    DType.I8: np.dtype("i1"),
    DType.U8: np.dtype("u1"),
    DType.U16: np.dtype("<u2"),
    DType.U32: np.dtype("<u4"),
    DType.U64: np.dtype("<u8"),
    DType.BOOL: np.dtype("?"),
}
"""The numpy dtype of each DType but BF16 (`_bfloat16()`, imported when first needed)."""


def _bfloat16() -> np.dtype[np.generic]:
    import ml_dtypes

    bf16: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def is_bfloat16(dtype: np.dtype[np.generic] | type) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16 (without importing ml_dtypes when nothing
    has: then no array can have that dtype)."""
    if "ml_dtypes" not in sys.modules:
        return False
    nd = np.dtype(dtype)
    return bool(nd == _bfloat16() or nd == _bfloat16().newbyteorder(">"))


_FLOATS = frozenset({DType.F64, DType.F32, DType.F16, DType.BF16})
_SIGNED_INTS = frozenset({DType.I64, DType.I32, DType.I16, DType.I8})
_INTS = _SIGNED_INTS | {DType.U8, DType.U16, DType.U32, DType.U64}
