"""Precision settings and lossiness detection."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trainrec import DType, LossyPrecisionError, Precision, TensorData, first_lossy, is_lossless
from trainrec.precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
    convert_item,
    restore_tensor,
    store_tensor,
)


def td(values, dtype) -> TensorData:
    return TensorData.from_array(np.array(values, dtype=dtype))


def test_targets_follow_burn():
    full, half, double, native = (FullPrecisionSettings(), HalfPrecisionSettings(),
                                  DoublePrecisionSettings(), NativePrecisionSettings())
    assert full.target(DType.F64) is DType.F32 and full.target(DType.I64) is DType.I32
    assert half.target(DType.F32) is DType.F16 and half.target(DType.I32) is DType.I16
    assert double.target(DType.BF16) is DType.F64 and full.target(DType.I8) is DType.I32
    assert native.target(DType.BF16) is DType.BF16
    for s in (full, half, double, native):  # bit patterns (RNG states, keys, masks) are kept
        for d in (DType.BOOL, DType.U8, DType.U16, DType.U32, DType.U64):
            assert s.target(d) is d


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
        # compared by value, not after a cast back that wraps around
        ([3046000665], np.uint32, DType.I32, False),
        ([2**31 - 1], np.uint32, DType.I32, True),
        ([2**63], np.uint64, DType.I64, False),
        ([2**64 - 1], np.uint64, DType.U32, False),
        ([-(2**31) - 1], np.int64, DType.I32, False),
        ([-1], np.int64, DType.U64, False),
        ([2**-24], np.float32, DType.F16, True),  # the smallest f16 subnormal
        ([6e-8], np.float32, DType.F16, False),  # rounds to a subnormal
        ([np.finfo(np.float32).max], np.float32, DType.F16, False),
        ([2**-18 * (1 + 2**-7)], ml_dtypes.bfloat16, DType.F16, False),  # f16 subnormal grid
        ([2**53 + 1], np.int64, DType.F64, False),
        ([2**63 - 1], np.int64, DType.F64, False),  # 2**63 as a float: not that int
        ([2.5], np.float32, DType.I32, False),
        ([2.0**31], np.float64, DType.I32, False),
        ([np.nan], np.float32, DType.I64, False),
        ([2], np.int32, DType.BOOL, False),
        ([True, False], bool, DType.F16, True),
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


def test_store_tensor_checks_in_its_cast_and_names_tensor_and_recorder():
    with pytest.raises(LossyPrecisionError) as e:
        store_tensor(td([1.0, 70000.0], np.float32), HalfPrecisionSettings(), key="m.w",
                     recorder="TorchFileRecorder")
    msg = str(e.value)
    assert e.value.key == "m.w" and "element [1] is 70000.0" in msg and "inf" in msg
    assert "TorchFileRecorder(NativePrecisionSettings())" in msg and "allow_lossy=True" in msg
    with pytest.raises(LossyPrecisionError) as e:
        store_tensor(td([[0, 2**40]], np.int64), FullPrecisionSettings(), key="step")
    msg = str(e.value)
    assert "element [0, 1] is 1099511627776" in msg and "allow_lossy" not in msg
    assert "NamedMpkFileRecorder(NativePrecisionSettings())" in msg
    stored = store_tensor(td([0.1], np.float64), FullPrecisionSettings(), allow_lossy=True)
    assert stored.dtype is DType.F32 and stored.array[0] == np.float32(0.1)
    u = td([3046000665], np.uint32)
    assert store_tensor(u, FullPrecisionSettings()) is u


def test_store_tensor_checks_every_chunk(monkeypatch):
    import trainrec.precision as precision

    monkeypatch.setattr(precision, "_CHUNK", 4)
    values = np.zeros(10, np.float32)
    values[9] = 0.1
    with pytest.raises(LossyPrecisionError, match=r"element \[9\]"):
        store_tensor(td(values, np.float32), HalfPrecisionSettings())
    assert np.array_equal(store_tensor(td(values[:9], np.float32), HalfPrecisionSettings()).array,
                          values[:9].astype(np.float16))


def test_restore_tensor_refuses_another_kind():
    assert restore_tensor(td([1.5], np.float32), DType.F64).dtype is DType.F64
    with pytest.raises(ValueError, match="never stored"):
        restore_tensor(td([1], np.int32), DType.U32)
    with pytest.raises(ValueError, match="never stored"):
        restore_tensor(td([1], np.int32), DType.F32)
