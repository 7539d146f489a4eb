"""Every sentence of seeds/GradientsAccumulator.txt, on the numpy reference adapter."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest

from trainrec import (
    CorruptRecordError,
    DType,
    FloatDType,
    FullPrecisionSettings,
    GradientsAccumulator,
    GradientsParams,
    GradientsParamsRecord,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    TensorData,
)
from trainrec.adapters.numpy import MLP, NumpyBackend


def grads_of(model: MLP, value: float, dtype=np.float32) -> GradientsParams:
    return GradientsParams({k: np.full(v.shape, value, dtype) for k, v in model.params.items()})


def pending(acc: GradientsAccumulator) -> dict[str, np.ndarray]:
    return {k: t.array.copy() for k, t in acc.try_to_record().grads.items()}


@pytest.fixture
def model() -> MLP:
    return MLP([3, 4, 2], seed=0)


def test_new_and_default_are_empty():
    for acc in (GradientsAccumulator(), GradientsAccumulator.new()):
        assert acc.grads().is_empty()
        assert acc.try_to_record().grads == {}


def test_accumulate_sums_each_parameter_of_the_module(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0))
    acc.accumulate(model, grads_of(model, 2.5))
    g = acc.grads()
    assert g.len() == len(model.params)
    for k, v in model.params.items():
        np.testing.assert_array_equal(g.get(k), np.full(v.shape, 3.5, np.float32))


def test_accumulate_ignores_parameters_the_module_lacks(model):
    acc = GradientsAccumulator()
    g = grads_of(model, 1.0)
    g.register("not.a.param", np.ones(3, np.float32))
    acc.accumulate(model, g)
    assert "not.a.param" not in acc.grads()


def test_a_gradient_of_the_wrong_shape_changes_no_pending_tensor(model):
    """Checked before anything is added: the in-place path would otherwise have summed
    the earlier parameters when the last one fails."""
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0))
    before = pending(acc)
    bad = grads_of(model, 2.0)
    last = list(model.params)[-1]
    bad.register(last, np.ones((7,) + model.params[last].shape, np.float32))
    with pytest.raises(ValueError, match=f"{last!r} has shape"):
        acc.accumulate(model, bad)
    after = pending(acc)
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_adopt_replaces_pending_with_a_copy_and_validates_first(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0))
    before = pending(acc)
    with pytest.raises(ValueError, match="not parameters"):
        acc.adopt(model, GradientsParams({"nope": np.ones(3, np.float32)}))
    assert pending(acc).keys() == before.keys()
    mine = grads_of(model, 4.0)
    acc.adopt(model, mine)
    for v in mine.values():
        v += 1  # the caller's tensors, written after adopt
    for k, v in acc.grads().items():
        np.testing.assert_array_equal(v, np.full(model.params[k].shape, 4.0, np.float32))


def test_the_accumulator_never_writes_into_the_callers_tensors(model):
    acc = GradientsAccumulator()
    first = grads_of(model, 1.0)
    kept = {k: v.copy() for k, v in first.items()}
    acc.accumulate(model, first)
    acc.accumulate(model, grads_of(model, 1.0))
    for k, v in first.items():
        np.testing.assert_array_equal(v, kept[k])


def test_grads_returns_the_sum_and_resets(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 2.0))
    assert not acc.grads().is_empty()
    assert acc.grads().is_empty()
    acc.accumulate(model, grads_of(model, 1.0))
    np.testing.assert_array_equal(acc.grads().get("layers.0.bias"), np.ones(4, np.float32))


def test_try_to_record_snapshots_without_resetting(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0))
    snap = acc.try_to_record()
    acc.accumulate(model, grads_of(model, 1.0))
    assert all(np.all(t.array == 1.0) for t in snap.grads.values())  # unchanged by later work
    g = acc.grads()  # still returns everything
    assert all(np.all(v == 2.0) for _, v in g.items())


def test_to_record_async_equals_try_to_record_and_does_not_reset(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 0.25))
    sync = acc.try_to_record()
    asyn = asyncio.run(acc.to_record_async())
    assert sync.grads.keys() == asyn.grads.keys()
    assert all(sync.grads[k].bitwise_equal(asyn.grads[k]) for k in sync.grads)
    assert not acc.grads().is_empty()


def test_load_record_replaces_pending_on_the_device(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 5.0))
    rec = GradientsParamsRecord({"layers.0.bias": TensorData.from_array(np.arange(4, dtype=np.float32))})
    acc.load_record(rec, "cpu")
    assert list(pending(acc)) == ["layers.0.bias"]
    g = acc.grads().get("layers.0.bias")
    assert isinstance(g, np.ndarray) and g.flags.writeable
    np.testing.assert_array_equal(g, np.arange(4, dtype=np.float32))


def test_load_record_into_a_fresh_accumulator_needs_a_backend_for_a_string_device():
    rec = GradientsParamsRecord({"a": TensorData.from_array(np.ones(2, np.float32))})
    with pytest.raises(TypeError, match="backend"):
        GradientsAccumulator().load_record(rec, "cpu")
    acc = GradientsAccumulator(backend=NumpyBackend())
    acc.load_record(rec, "cpu")
    assert acc.pending_ids() == ["a"]


@pytest.mark.parametrize(
    "bad",
    [
        {"layers.0.bias": np.ones(4, np.float32)},  # not a TensorData
        {"layers.0.bias": TensorData.from_array(np.ones(4, np.int32))},  # not a float
        {"layers.0.bias": "a string"},
    ],
)
def test_a_rejected_record_leaves_the_accumulator_unchanged(model, bad):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 3.0))
    before = pending(acc)
    with pytest.raises(RecorderError):
        acc.load_record(GradientsParamsRecord(bad), "cpu")  # type: ignore[arg-type]
    after = pending(acc)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_wrong_record_type_and_wrong_device_are_rejected_unchanged(model):
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 3.0))
    before = pending(acc)
    with pytest.raises(RecordMismatchError):
        acc.load_record({"layers.0.bias": None}, "cpu")  # type: ignore[arg-type]
    with pytest.raises(RecordMismatchError, match="device"):
        acc.load_record(GradientsParamsRecord({}), "cuda:0")
    assert all(np.array_equal(before[k], v) for k, v in pending(acc).items())


@pytest.mark.parametrize(
    "item",
    [
        [1, 2],
        {"p": {"dtype": "f32"}},
        {"p": {"dtype": "f32", "value": [1.0, 2.0]}},  # shape that is not a tensor
        {"p": {"dtype": "c128", "value": TensorData.from_array(np.ones(1, np.float32))}},
        {"p": {"dtype": "i32", "value": TensorData.from_array(np.ones(1, np.int32))}},
    ],
)
def test_malformed_items_are_corrupt_record_errors(item):
    with pytest.raises(CorruptRecordError):
        GradientsParamsRecord.from_item(item)


def test_f32_accumulation_retains_small_additions_to_half_precision_gradients():
    model = MLP([1, 1], dtype=np.float16)
    plain, wide = GradientsAccumulator(), GradientsAccumulator()
    one = GradientsParams({"layers.0.bias": np.array([1.0], np.float16)})
    plain.accumulate(model, one)
    wide.accumulate_with_dtype(model, one, FloatDType.F32)
    for _ in range(100):
        tiny = GradientsParams({"layers.0.bias": np.array([1e-4], np.float16)})
        plain.accumulate(model, tiny)
        wide.accumulate_with_dtype(model, tiny, FloatDType.F32)
    f16_sum = float(plain.grads().get("layers.0.bias")[0])
    f32_sum = float(wide.grads().get("layers.0.bias")[0])
    # plain f16: every 1e-4 is lost against 1.0 (f16 spacing there is ~9.8e-4)
    assert f16_sum == 1.0
    assert f32_sum == pytest.approx(1.01, abs=1e-5)
    print(f"f16 accumulation: {f16_sum!r}, f32 accumulation: {f32_sum!r}")
    # parameter storage is unchanged
    assert model.params["layers.0.bias"].dtype == np.float16


def test_accumulate_with_dtype_performs_no_reset_and_the_dtype_survives_a_checkpoint():
    model = MLP([2, 2], dtype=np.float16)
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0, np.float16))
    acc.accumulate_with_dtype(model, grads_of(model, 0.5, np.float16), FloatDType.F32)
    rec = acc.try_to_record()
    assert all(t.dtype is DType.F32 and np.all(t.array == 1.5) for t in rec.grads.values())
    for settings in (FullPrecisionSettings(), NativePrecisionSettings()):
        r = NamedMpkBytesRecorder(settings)
        back = r.load(r.record(rec, None), "cpu", GradientsParamsRecord)
        assert all(t.dtype is DType.F32 for t in back.grads.values())
    # bf16 pending written with Full precision (f32 on disk) comes back as bf16
    acc2 = GradientsAccumulator()
    acc2.accumulate_with_dtype(model, grads_of(model, 0.5, np.float16), FloatDType.BF16)
    r = NamedMpkBytesRecorder(FullPrecisionSettings())
    back = r.load(r.record(acc2.try_to_record(), None), "cpu", GradientsParamsRecord)
    assert all(t.dtype is DType.BF16 for t in back.grads.values())
    restored = GradientsAccumulator(backend=NumpyBackend())
    restored.load_record(back, "cpu")
    assert all(v.dtype == ml_dtypes.bfloat16 for _, v in restored.grads().items())


def test_accumulate_casts_incoming_to_the_pending_dtype():
    model = MLP([2, 2], dtype=np.float32)
    acc = GradientsAccumulator()
    acc.accumulate_with_dtype(model, grads_of(model, 1.0), FloatDType.F64)
    acc.accumulate(model, grads_of(model, 1.0, np.float32))
    assert all(v.dtype == np.float64 and np.all(v == 2.0) for _, v in acc.grads().items())


def test_api_misuse(model):
    acc = GradientsAccumulator()
    with pytest.raises(TypeError):
        acc.accumulate(model, {"a": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        acc.accumulate_with_dtype(model, grads_of(model, 1.0), DType.I32)  # no float dtype
    with pytest.raises(TypeError):
        acc.accumulate(object(), grads_of(model, 1.0))


def test_the_accumulator_keeps_no_module_alive():
    """It remembers the last module only to skip re-checking it: weakly, so a model the
    caller dropped (after `grads()`, or mid-window) is freed with its parameters."""
    import gc
    import weakref

    model = MLP([3, 4, 2], seed=0)  # not the fixture, which pytest holds
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_of(model, 1.0))
    acc.accumulate(model, grads_of(model, 2.0))  # the same module: the remembered one
    ref = weakref.ref(model)
    other = MLP([3, 4, 2], seed=1)
    acc.grads()
    del model
    gc.collect()
    assert ref() is None
    acc.accumulate(other, grads_of(other, 1.0))  # a new module is checked as any other
    with pytest.raises(ValueError, match="shape"):
        acc.accumulate(other, GradientsParams({k: np.ones((7,), np.float32) for k in other.params}))
    assert all(np.array_equal(v, np.ones_like(v)) for v in pending(acc).values())
