"""`trainrec.ArrayApiBackend`: one backend for any array-API library (spec/ADAPTERS.md,
"Writing an adapter for an array-API library"). The numpy reference backend and the
array-api-strict third-party adapter are it; torch and JAX arrays work through it too."""

from __future__ import annotations

import asyncio
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trainrec
from trainrec import (
    ArrayApiAdapter,
    ArrayApiBackend,
    DType,
    FloatDType,
    GradientsAccumulator,
    GradientsParams,
    StateRecord,
    TensorData,
)
from trainrec.adapters.numpy import ADAPTER, NumpyBackend


def sample(dtype: DType) -> np.ndarray:
    """Values that catch a lossy or reinterpreting transfer: the extremes of ints, signed
    zeros, infinities, NaN and subnormals of floats."""
    nd = dtype.numpy
    if dtype is DType.BOOL:
        return np.array([[True, False, True], [False, False, True]])
    if dtype.is_int:
        info = np.iinfo(nd)
        return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=nd)
    info = ml_dtypes.finfo(nd)
    return np.array([[-0.0, np.inf, -np.inf], [np.nan, info.smallest_subnormal, info.max]], dtype=nd)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def strict() -> Any:
    return pytest.importorskip("array_api_strict")


def backend_for_library(library: str) -> ArrayApiBackend:
    if library == "numpy":
        return NumpyBackend()
    if library == "array_api_strict":
        return ArrayApiBackend(strict())
    if library == "torch":
        return ArrayApiBackend(pytest.importorskip("torch"))
    jnp = pytest.importorskip("jax.numpy")
    return ArrayApiBackend(jnp)


# -- the reference and the third-party adapter are the generic backend ---------------------


def test_numpy_reference_backend_is_the_generic_backend_bound_to_numpy():
    b = NumpyBackend()
    assert isinstance(b, ArrayApiBackend) and isinstance(b, trainrec.AutodiffBackend)
    assert b.name == "numpy" and b == NumpyBackend() and hash(b) == hash(NumpyBackend())
    assert isinstance(ADAPTER, ArrayApiAdapter) and ADAPTER.name == "numpy"
    assert set(b.dtypes()) == set(DType)  # bf16 through ml_dtypes


def test_third_party_adapter_uses_the_generic_backend():
    pytest.importorskip("trainrec_arraystrict")
    xp = strict()
    from trainrec_arraystrict import ADAPTER as STRICT
    from trainrec_arraystrict import StrictBackend

    b = trainrec.adapt(xp.asarray([1.0]))
    assert isinstance(b, StrictBackend) and isinstance(b, ArrayApiBackend) and b.name == "array_api_strict"
    assert isinstance(STRICT, ArrayApiAdapter)
    assert trainrec.adapt(type(xp.asarray([1.0]))) is b and trainrec.adapt(xp.Device("device1")) is b


@pytest.mark.parametrize(("library", "name"), [("numpy", "numpy"), ("array_api_strict", "array_api_strict"),
                                               ("torch", "torch"), ("jax", "jax")])
def test_name_is_the_library_package(library, name):
    assert backend_for_library(library).name == name


def test_a_backend_is_made_from_a_namespace_or_an_array():
    xp = strict()
    assert ArrayApiBackend(xp) == ArrayApiBackend(xp.asarray([1, 2]))
    assert ArrayApiBackend(np) == ArrayApiBackend(np.zeros(2)) == NumpyBackend()
    assert ArrayApiBackend(np) != ArrayApiBackend(xp)
    import json

    for not_a_library in (json, object(), [1.0]):
        with pytest.raises(TypeError, match="array"):
            ArrayApiBackend(not_a_library)


# -- every DType round-trips, values and dtype ----------------------------------------------


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch", "jax"])
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
def test_every_dtype_the_library_has_round_trips_exactly(library, dtype):
    b = backend_for_library(library)
    if dtype not in b.dtypes():
        with pytest.raises(TypeError, match=f"{b.name} has no {dtype.value}"):
            b.from_host(sample(dtype), "cpu")
        return
    host = sample(dtype)
    t = b.from_host(host, "cpu")
    assert b.is_tensor(t) and b.dtype_of(t) is dtype and b.shape_of(t) == (2, 3)
    assert b.device_of(t) == b.device("cpu")
    back = b.to_host(t)
    assert same(back, host), (back, host)
    assert back.flags.c_contiguous and back.flags.writeable
    assert same(asyncio.run(b.to_host_async(t)), host)
    data = b.to_tensor_data(t)
    assert data.dtype is dtype and same(b.to_host(b.from_tensor_data(data, "cpu")), host)


@pytest.mark.parametrize("library", ["numpy", "array_api_strict"])
def test_every_dtype_of_the_reference_libraries(library):
    """The two adapters that use the generic backend have the dtypes they should."""
    b = backend_for_library(library)
    standard = set(DType) - {DType.F16, DType.BF16}
    assert set(b.dtypes()) == (set(DType) if library == "numpy" else standard)


class _CountedReads(dict):
    """`dtypes=` that counts the reads of its values."""

    reads = 0

    def __getitem__(self, key: Any) -> Any:
        type(self).reads += 1
        return super().__getitem__(key)


def test_an_adapters_dtypes_are_read_only_when_that_dtype_is_first_needed():
    given = _CountedReads({DType.BF16: np.dtype(ml_dtypes.bfloat16)})
    _CountedReads.reads = 0
    b = ArrayApiBackend(np, dtypes=given)
    f32 = b.from_host(np.arange(3, dtype=np.float32), "cpu")
    assert DType.BF16 in b.dtypes() and b.dtype_of(f32) is DType.F32
    assert b.dtype_of(b.cast(f32, DType.I32)) is DType.I32
    assert _CountedReads.reads == 0, "a dtype nothing asked for was read"
    half = b.cast(f32, DType.BF16)
    assert b.dtype_of(half) is DType.BF16 and half.dtype == np.dtype(ml_dtypes.bfloat16)
    assert _CountedReads.reads == 1
    assert b.dtype_of(b.cast(half, DType.BF16)) is DType.BF16 and _CountedReads.reads == 1
    # a bf16 array met before any bf16 was asked for is still named
    fresh = ArrayApiBackend(np, dtypes=_CountedReads(given))
    assert fresh.dtype_of(np.ones(2, ml_dtypes.bfloat16)) is DType.BF16


def test_a_plain_dtypes_dict_changed_later_does_not_change_the_backend():
    given = {DType.BF16: np.dtype(ml_dtypes.bfloat16)}
    b = ArrayApiBackend(np, dtypes=given)
    given[DType.BF16] = np.dtype(np.float16)
    given[DType.F64] = np.dtype(np.float32)
    half = b.cast(b.from_host(np.arange(3, dtype=np.float32), "cpu"), DType.BF16)
    assert half.dtype == np.dtype(ml_dtypes.bfloat16) and b.dtype_of(half) is DType.BF16
    assert b.dtype_of(b.cast(half, DType.F64)) is DType.F64


def test_the_numpy_adapter_imports_ml_dtypes_at_its_first_bf16_only():
    """ml_dtypes' import costs about a second of CPU in every process: a numpy run without
    bf16 does not pay it (a fresh process: JAX, imported in this one, imports ml_dtypes)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import numpy as np\n"
        "from trainrec import DType\n"
        "from trainrec.adapters.numpy import ADAPTER, NumpyBackend\n"
        "b = NumpyBackend()\n"
        "t = b.from_host(np.arange(4, dtype=np.float32), 'cpu')\n"
        "import trainrec.adapters.numpy.demo\n"
        "assert DType.BF16 in b.dtypes() and b.dtype_of(t) is DType.F32\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported before any bf16'\n"
        "h = b.cast(t, DType.BF16)\n"
        "assert 'ml_dtypes' in sys.modules and b.dtype_of(h) is DType.BF16\n"
        "assert b.to_host(h).tobytes() == np.arange(4, dtype=np.float32).astype(h.dtype).tobytes()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_dtype_the_library_lacks_is_a_clear_type_error():
    xp = strict()
    b = ArrayApiBackend(xp)
    t = b.from_host(np.ones(3, np.float32), "cpu")
    with pytest.raises(TypeError, match=r"array_api_strict has no bf16 \(bfloat16\); it has f64, f32"):
        b.cast(t, DType.BF16)
    with pytest.raises(TypeError, match="has no f16"):
        b.from_tensor_data(TensorData.from_array(np.ones(2, np.float16)), "cpu")


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch", "jax"])
def test_cast_converts_and_keeps_a_tensor_of_that_dtype(library):
    b = backend_for_library(library)
    t = b.from_host(np.array([1.5, -2.25, 3.0], np.float32), "cpu")
    assert b.cast(t, DType.F32) is t
    as_int = b.cast(t, DType.I32)
    assert b.dtype_of(as_int) is DType.I32 and same(b.to_host(as_int), np.array([1, -2, 3], np.int32))
    half = b.cast(t, DType.BF16) if DType.BF16 in b.dtypes() else None
    if half is not None:
        assert same(b.to_host(half), np.array([1.5, -2.25, 3.0], ml_dtypes.bfloat16))


# -- no aliasing ------------------------------------------------------------------------------


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch"])
def test_host_transfers_copy(library):
    b = backend_for_library(library)
    host = np.arange(6, dtype=np.float32)
    t = b.from_host(host, "cpu")
    host[0] = 100.0
    back = b.to_host(t)
    back[1] = 200.0
    assert same(b.to_host(t), np.arange(6, dtype=np.float32))
    c = b.clone(t)
    b.add(c, b.from_host(np.ones(6, np.float32), "cpu"))
    assert same(b.to_host(t), np.arange(6, dtype=np.float32))


# -- devices ----------------------------------------------------------------------------------


def test_numpy_has_one_device_named_cpu():
    b = NumpyBackend()
    assert b.device(None) == b.device("cpu") == b.device("cpu:0") == "cpu"
    for spec in ("cpu:1", "cpu:4096", "gpu", "cuda:0", object(), 0):
        with pytest.raises(ValueError, match=r"not a device of numpy; it has 'cpu' or 'cpu:0'"):
            b.device(spec)


def test_array_api_strict_devices_by_object_and_by_name():
    xp = strict()
    b = ArrayApiBackend(xp)
    cpu, other = xp.Device("CPU_DEVICE"), xp.Device("device1")
    assert b.device(None) == b.device("cpu") == b.device("cpu:0") == b.device(cpu) == cpu
    assert b.device(other) == other and b.is_device(other) and not b.is_device("cpu")
    # all its devices are DLPack's cpu:0: the name goes to the default device only
    for spec in ("cpu:1", "gpu:0", "cuda:4096", "device1", object()):
        with pytest.raises(ValueError, match=r"not a device of array_api_strict; it has .*'cpu'"):
            b.device(spec)


def test_array_api_strict_arrays_live_on_and_come_back_from_another_device():
    xp = strict()
    b = ArrayApiBackend(xp)
    other = xp.Device("device1")
    t = b.from_host(sample(DType.F64), other)
    assert b.device_of(t) == other and same(b.to_host(t), sample(DType.F64))
    assert b.device_of(b.clone(t)) == other
    with pytest.raises(RuntimeError):
        np.asarray(t)  # array-api-strict refuses __array__ off its CPU device: DLPack reads it


def test_a_device_without_a_dtype_refuses_it_and_says_which():
    xp = strict()
    b = ArrayApiBackend(xp)
    no64 = xp.Device("no_float64")
    assert DType.F64 not in b.dtypes(no64) and DType.F32 in b.dtypes(no64)
    with pytest.raises(TypeError, match=r"has no f64 \(float64\) on device .*no_float64"):
        b.from_host(np.ones(2), no64)
    # a record in f64 restores into an f32 tensor there: converted on host first
    t = b.from_tensor_data(TensorData.from_array(np.array([0.5, 2.0])), no64, DType.F32)
    assert b.dtype_of(t) is DType.F32 and b.device_of(t) == no64


# -- other libraries' arrays are refused ---------------------------------------------------------


def foreign_arrays() -> list[Any]:
    out: list[Any] = [np.ones(3, np.float32)]
    try:
        import array_api_strict as xp
    except ImportError:
        pass
    else:
        out.append(xp.ones(3, dtype=xp.float32))
    try:
        import torch
    except ImportError:
        pass
    else:
        out.append(torch.ones(3))
    return out


@pytest.mark.parametrize("library", ["numpy", "array_api_strict"])
def test_arrays_of_another_library_are_refused_with_a_clear_error(library):
    b = backend_for_library(library)
    own = b.from_host(np.ones(3, np.float32), "cpu")
    foreign = [a for a in foreign_arrays() if not b.is_tensor(a)]
    assert foreign
    for a in foreign:
        assert not b.is_tensor(a) and ArrayApiAdapter(b).adapt(a) is None
        says = rf"the {b.name} backend's \w+ got a .*, not an array of {b.name}"
        for call in (b.to_host, b.dtype_of, b.shape_of, b.device_of, b.clone,
                     lambda x: b.cast(x, DType.F64), lambda x: b.add(own, x), lambda x: b.add(x, own)):
            with pytest.raises(TypeError, match=says):
                call(a)


def test_the_numpy_backend_refuses_torch_tensors():
    """It used to read them back through __array__, so a torch gradient given to a numpy
    model was recorded as if it were the model's."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"numpy backend's to_host got a torch\.Tensor"):
        NumpyBackend().to_host(torch.ones(2))


def test_add_refuses_shapes_that_would_broadcast():
    b = NumpyBackend()
    with pytest.raises(ValueError, match=r"shape \(1,\) to one of shape \(3,\)"):
        b.add(np.zeros(3, np.float32), np.ones(1, np.float32))


# -- the accumulator over the generic backend -------------------------------------------------------


class Params:
    """A minimal AutodiffModule whose parameters are arrays of any array-API library."""

    kind = "test.Params"

    def __init__(self, backend: ArrayApiBackend, shapes: dict[str, tuple[int, ...]]) -> None:
        self._backend = backend
        self.params = {k: backend.from_host(np.zeros(s, np.float32), "cpu") for k, s in shapes.items()}

    @property
    def backend(self) -> ArrayApiBackend:
        return self._backend

    def param_ids(self) -> list[str]:
        return list(self.params)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self._backend.shape_of(v) for k, v in self.params.items()}

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {k: self._backend.to_tensor_data(v) for k, v in self.params.items()})

    def check_record(self, record: Any) -> None: ...

    def load_record(self, record: Any, device: Any) -> None: ...


SHAPES = {"w": (2, 3), "b": (3,)}


def grads(b: ArrayApiBackend, values: dict[str, np.ndarray]) -> GradientsParams:
    return GradientsParams({k: b.from_host(v, "cpu") for k, v in values.items()})


def host_grads(seed: int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch", "jax"])
def test_accumulator_sums_in_the_pending_dtype_and_never_writes_into_grads(library):
    b = backend_for_library(library)
    model = Params(b, SHAPES)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    given = [host_grads(i) for i in range(3)]
    sent = [grads(b, g) for g in given]
    for g in sent:
        acc.accumulate(model, g)
    rec = acc.try_to_record()
    for k in SHAPES:
        expected = (given[0][k] + given[1][k]) + given[2][k]
        assert rec.grads[k].dtype is DType.F32 and same(rec.grads[k].array, expected)
        for g, h in zip(sent, given):
            assert same(b.to_host(g[k]), h[k])  # the accumulator owns its pending tensors
    # an incoming gradient is cast to the pending dtype
    if DType.F64 in b.dtypes():
        extra = host_grads(9, np.float64)
        acc.accumulate(model, grads(b, extra))
        out = acc.grads()
        for k in SHAPES:
            assert b.dtype_of(out.get(k)) is DType.F32 and b.is_tensor(out.get(k))
            expected = rec.grads[k].array + extra[k].astype(np.float32)
            assert same(b.to_host(out.get(k)), expected)
    else:
        assert same(b.to_host(acc.grads().get("w")), rec.grads["w"].array)
    assert acc.grads().is_empty()


@pytest.mark.parametrize("library", ["numpy", "array_api_strict"])
def test_accumulate_with_dtype_casts_pending_and_incoming(library):
    b = backend_for_library(library)
    model = Params(b, SHAPES)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    first, second = host_grads(1), host_grads(2)
    acc.accumulate(model, grads(b, first))
    acc.accumulate_with_dtype(model, grads(b, second), FloatDType.F64)
    rec = acc.try_to_record()
    for k in SHAPES:
        expected = first[k].astype(np.float64) + second[k].astype(np.float64)
        assert rec.grads[k].dtype is DType.F64 and same(rec.grads[k].array, expected)


def test_half_precision_additions_survive_f32_accumulation_on_numpy():
    b = NumpyBackend()
    model = Params(b, {"w": (4,)})
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    acc.accumulate_with_dtype(model, GradientsParams({"w": np.full(4, 1.0, np.float16)}), FloatDType.F32)
    for _ in range(8):
        acc.accumulate_with_dtype(model, GradientsParams({"w": np.full(4, 1e-4, np.float16)}), FloatDType.F32)
    got = acc.grads().get("w")
    assert got.dtype == np.float32 and float(got[0]) > 1.0007


def test_accumulating_in_a_dtype_the_library_lacks_is_refused_clearly():
    b = ArrayApiBackend(strict())
    model = Params(b, SHAPES)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    with pytest.raises(TypeError, match=r"array_api_strict has no bf16"):
        acc.accumulate_with_dtype(model, grads(b, host_grads(0)), FloatDType.BF16)
    assert acc.pending_ids() == []


def test_pending_gradients_restore_onto_any_device_of_the_library():
    xp = strict()
    b = ArrayApiBackend(xp)
    model = Params(b, SHAPES)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    acc.accumulate(model, grads(b, host_grads(3)))
    rec = acc.try_to_record()
    for device in ("cpu", xp.Device("device1")):
        fresh: GradientsAccumulator[Any] = GradientsAccumulator(backend=b)
        fresh.load_record(rec, device)
        out = fresh.grads()
        for k in SHAPES:
            assert b.device_of(out.get(k)) == b.device(device)
            assert same(b.to_host(out.get(k)), rec.grads[k].array)


def test_the_accumulator_refuses_gradients_of_another_library():
    xp = strict()
    model = Params(ArrayApiBackend(xp), SHAPES)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    with pytest.raises(TypeError, match=r"array_api_strict backend's (dtype|shape)_of got a numpy\.ndarray"):
        acc.accumulate(model, GradientsParams(host_grads(0)))
