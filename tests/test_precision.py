"""Precision settings and lossiness detection."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trainrec import DType, Precision, TensorData, first_lossy, is_lossless
from trainrec.precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
    convert_item,
)


def td(values, dtype) -> TensorData:
    return TensorData.from_array(np.array(values, dtype=dtype))


def test_targets_follow_burn():
    full, half, double, native = (FullPrecisionSettings(), HalfPrecisionSettings(),
                                  DoublePrecisionSettings(), NativePrecisionSettings())
    assert full.target(DType.F64) is DType.F32 and full.target(DType.I64) is DType.I32
    assert half.target(DType.F32) is DType.F16 and half.target(DType.I32) is DType.I16
    assert double.target(DType.BF16) is DType.F64 and double.target(DType.U8) is DType.I64
    assert native.target(DType.BF16) is DType.BF16
    for s in (full, half, double, native):
        assert s.target(DType.BOOL) is DType.BOOL


def test_convert_item_leaves_scalars_and_bools():
    item = {"f": td([1.5], np.float64), "b": td([True], bool), "s": 2.5, "i": 7}
    out = convert_item(item, HalfPrecisionSettings())
    assert out["f"].dtype is DType.F16 and out["b"].dtype is DType.BOOL
    assert out["s"] == 2.5 and out["i"] == 7


@pytest.mark.parametrize(
    ("values", "src", "dst", "lossless"),
    [
        ([1.0, 0.5, -2.0], np.float32, DType.F16, True),
        ([1.0 + 2**-12], np.float32, DType.F16, False),  # rounds in f16
        ([70000.0], np.float32, DType.F16, False),  # overflows to inf
        ([1e-8], np.float32, DType.F16, False),  # underflows
        ([0.1], np.float64, DType.F32, False),
        ([0.5, np.nan, -np.inf, -0.0], np.float64, DType.F32, True),  # NaN stays NaN
        ([2**31 - 1, -(2**31)], np.int64, DType.I32, True),
        ([2**31], np.int64, DType.I32, False),
        ([40000], np.int32, DType.I16, False),
        ([1.0, 3.0], ml_dtypes.bfloat16, DType.F32, True),
        ([1.5, 2.0], np.float32, DType.BF16, True),
        ([1.0 + 2**-10], np.float32, DType.BF16, False),
        ([1e30], ml_dtypes.bfloat16, DType.F16, False),
        ([1, 2, 3], np.uint8, DType.I16, True),
    ],
)
def test_is_lossless(values, src, dst, lossless):
    assert is_lossless(td(values, src), dst) is lossless


def test_first_lossy_names_the_first_offending_path():
    item = {"a": td([1.0], np.float32), "b": {"c": [td([0.1], np.float32), td([0.2], np.float32)]}}
    assert first_lossy(item, HalfPrecisionSettings()) == "b.c.0"
    assert first_lossy(item, FullPrecisionSettings()) is None
    assert first_lossy(item, NativePrecisionSettings()) is None


def test_custom_settings_validate():
    bf16 = Precision("bf16", DType.BF16, None)
    assert bf16.target(DType.F32) is DType.BF16 and bf16.target(DType.I64) is DType.I64
    with pytest.raises(ValueError):
        Precision("bad", DType.I32, None)
    with pytest.raises(ValueError):
        Precision("bad", None, DType.F32)
