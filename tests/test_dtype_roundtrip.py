"""A tensor comes back in the dtype it was saved with, under every recorder and every
precision setting; settings choose only the storage dtype of floats and signed ints."""

import importlib
import io
import zlib
from typing import Any

import numpy as np
import pytest

import trainrec
from trainrec import (
    CompactRecorder,
    DefaultRecorder,
    DType,
    LossyPrecisionError,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    Precision,
    TensorData,
)
from trainrec.precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
)

SETTINGS = {
    "full": FullPrecisionSettings(),
    "half": HalfPrecisionSettings(),
    "double": DoublePrecisionSettings(),
    "native": NativePrecisionSettings(),
    "bf16": Precision("bf16", DType.BF16, DType.I8),
}
RECORDERS = ["mpk", "gz", "bytes", "default", "compact", "torch", "flax"]


def _recorder(kind: str, settings: Any) -> Any:
    if kind == "mpk":
        return NamedMpkFileRecorder(settings)
    if kind == "gz":
        return NamedMpkGzFileRecorder(settings)
    if kind == "bytes":
        return NamedMpkBytesRecorder(settings)
    if kind == "torch":
        pytest.importorskip("torch")
        return importlib.import_module("trainrec.adapters.torch").TorchFileRecorder(settings)
    pytest.importorskip("jax")
    return importlib.import_module("trainrec.adapters.jax").FlaxMsgpackFileRecorder(settings)


def _save_load(kind: str, settings: Any, item: Any, tmp_path, **kw: Any) -> Any:
    if kind == "default":
        recorder: Any = DefaultRecorder()
    elif kind == "compact":
        recorder = CompactRecorder()
    else:
        recorder = _recorder(kind, settings)
    if kind == "bytes":
        return recorder.load_item(recorder.save_item(item, None, **kw))
    return recorder.load_item(recorder.save_item(item, tmp_path / f"x.{kind}", **kw))


def _settings_for(kind: str) -> list[str]:
    return ["full"] if kind == "default" else ["half"] if kind == "compact" else list(SETTINGS)


CASES = [(k, s) for k in RECORDERS for s in _settings_for(k)]


def _every_dtype() -> dict[str, TensorData]:
    """Values every storage dtype holds: small non-negative ints and halves, one 0-d."""
    vals = np.arange(12).reshape(3, 4) % 7
    item = {}
    for d in DType:
        arr = vals % 2 == 1 if d is DType.BOOL else (vals / 2 if d.is_float else vals)
        item[d.value] = TensorData.from_array(np.asarray(arr).astype(d.numpy))
    item["zero_d"] = TensorData.from_array(np.asarray(3, np.uint32))
    item["empty"] = TensorData.from_array(np.zeros((0, 2), np.int64))
    return item


@pytest.mark.parametrize(("kind", "settings"), CASES)
def test_every_dtype_comes_back_as_saved(kind, settings, tmp_path):
    item = _every_dtype()
    loaded = _save_load(kind, SETTINGS[settings], item, tmp_path)
    for name, t in item.items():
        back = loaded[name]
        assert back.dtype is t.dtype, f"{name} came back as {back.dtype.value}"
        assert back.bitwise_equal(t), name


@pytest.mark.parametrize(("kind", "settings"), CASES)
def test_bit_patterns_are_never_converted(kind, settings, tmp_path):
    # RNG states and keys: every bit counts, whatever the settings
    pattern = {
        "u8": TensorData.from_array(np.array([0, 255, 128], np.uint8)),
        "u16": TensorData.from_array(np.array([65535, 40000], np.uint16)),
        "u32": TensorData.from_array(np.array([3046000665, 2**32 - 1], np.uint32)),
        "u64": TensorData.from_array(np.array([2**64 - 1, 2**63], np.uint64)),
        "bool": TensorData.from_array(np.array([True, False, True])),
    }
    loaded = _save_load(kind, SETTINGS[settings], pattern, tmp_path)
    for name, t in pattern.items():
        assert loaded[name].bitwise_equal(t), name


@pytest.mark.parametrize(("kind", "settings"), [c for c in CASES if c[1] not in ("native", "double")])
def test_lossy_floats_keep_their_dtype_with_allow_lossy(kind, settings, tmp_path):
    t = TensorData.from_array(np.array([0.1, 1 / 3], np.float64))
    loaded = _save_load(kind, SETTINGS[settings], {"w": t}, tmp_path, allow_lossy=True)["w"]
    assert loaded.dtype is DType.F64
    stored = SETTINGS[settings].target(DType.F64).numpy
    assert np.array_equal(loaded.array, t.array.astype(stored).astype(np.float64))


@pytest.mark.parametrize("kind", ["mpk", "gz", "bytes", "torch", "flax"])
def test_allow_lossy_never_wraps_an_integer(kind, tmp_path):
    """`allow_lossy=True` accepts rounded floats, never a changed integer: a BatchNorm
    `num_batches_tracked` of 40000 or an optax count of 50000 stored as i16 would wrap."""
    for value, dtype in [(40000, np.int64), (50000, np.int32), (-40000, np.int64)]:
        with pytest.raises(LossyPrecisionError) as e:
            _save_load(kind, HalfPrecisionSettings(), {"count": TensorData.from_array(
                np.array(value, dtype))}, tmp_path, allow_lossy=True)
        assert e.value.key == "count" and "allow_lossy" not in str(e.value)
    # a float beside a fitting integer: the float is rounded, the integer kept
    loaded = _save_load(kind, HalfPrecisionSettings(), {
        "count": TensorData.from_array(np.array(30000, np.int64)),
        "w": TensorData.from_array(np.array([0.1], np.float32))}, tmp_path, allow_lossy=True)
    assert loaded["count"].dtype is DType.I64 and int(loaded["count"].array) == 30000
    assert loaded["w"].array.tolist() == [float(np.float32(np.float16(0.1)))]


@pytest.mark.parametrize("kind", ["mpk", "gz", "bytes", "torch", "flax"])
def test_lossy_values_are_refused_naming_the_tensor_and_a_recorder_that_keeps_them(kind, tmp_path):
    with pytest.raises(LossyPrecisionError, match=r"NativePrecisionSettings\(\)") as e:
        _save_load(kind, HalfPrecisionSettings(), {"a": {"w": TensorData.from_array(
            np.array([1.0, 70000.0], np.float32))}}, tmp_path)
    assert e.value.key == "a.w" and "inf" in str(e.value) and "allow_lossy=True" in str(e.value)
    with pytest.raises(LossyPrecisionError) as e:
        _save_load(kind, FullPrecisionSettings(), {"step": TensorData.from_array(
            np.array([2**40], np.int64))}, tmp_path)
    assert e.value.key == "step" and "allow_lossy" not in str(e.value)
    assert "1099511627776" in str(e.value)
    assert not list(tmp_path.iterdir()), "a refused save leaves no file"


def test_default_recorder_names_the_file_recorder_that_keeps_every_dtype(tmp_path):
    with pytest.raises(LossyPrecisionError, match=r"NamedMpkFileRecorder\(NativePrecisionSettings\(\)\)"):
        DefaultRecorder().save_item({"x": TensorData.from_array(np.array([0.1]))}, tmp_path / "x.mpk")


def test_record_refuses_lossy_precision_like_save():
    @trainrec.record
    class State:
        w: np.ndarray

    r = NamedMpkBytesRecorder(HalfPrecisionSettings())
    with pytest.raises(LossyPrecisionError) as e:
        r.record(State(np.array([70000.0], np.float32)), None)
    assert e.value.key == "w"
    data = r.record(State(np.array([70000.0], np.float32)), None, allow_lossy=True)
    assert np.isinf(r.load(data, None, State).w).all()


def test_a_1_0_file_without_saved_dtypes_loads_as_stored():
    from trainrec.conformance.vectors import vector_dir

    header, item = NamedMpkFileRecorder().read(vector_dir() / "precision-half-1.0.mpk")
    assert header.version == (1, 0)
    assert item["f64"].dtype is DType.F16 and item["u8"].dtype is DType.I16  # as 1.0 stored them
    assert item["f64"].array.tolist() == [0.5, 1.25, -3.0]


def test_a_tensor_map_restoring_to_another_kind_is_corrupt():
    r = NamedMpkBytesRecorder(FullPrecisionSettings())
    data = r.save_item({"w": TensorData.from_array(np.array([1, 2], np.int64))})
    bad = data.replace(b"\xa5dtype\xa3i64", b"\xa5dtype\xa3u64")
    with pytest.raises(trainrec.CorruptRecordError, match="never stored as i32"):
        r.load_item(bad)


def test_torch_rng_state_in_default_recorder_restores(tmp_path):
    torch = pytest.importorskip("torch")

    @trainrec.record
    class State:
        rng: torch.Tensor

    torch.manual_seed(3)
    path = DefaultRecorder().record(State(torch.get_rng_state()), tmp_path / "s.mpk")
    expected = torch.rand(4)
    back = DefaultRecorder().load(path, None, State)
    assert back.rng.dtype == torch.uint8
    torch.set_rng_state(back.rng)
    assert torch.equal(torch.rand(4), expected)


def test_jax_key_in_default_recorder_restores(tmp_path):
    jax = pytest.importorskip("jax")

    @trainrec.record
    class State:
        key: jax.Array

    key = jax.random.PRNGKey(3046000665)
    assert key.dtype == np.uint32 and int(np.asarray(key).max()) > 2**31
    path = DefaultRecorder().record(State(key), tmp_path / "s.mpk")
    back = DefaultRecorder().load(path, None, State)
    assert back.key.dtype == np.uint32
    assert np.array_equal(np.asarray(jax.random.split(back.key)), np.asarray(jax.random.split(key)))


def test_save_checks_each_tensor_in_the_writers_cast_reading_it_once():
    reads = []

    def loader():
        reads.append(1)
        return np.array([0.5, 1.5, 2.0], np.float64)

    lazy = TensorData(DType.F64, (3,), loader)
    rec = trainrec.TrainingRecord.from_item(
        [{"kind": "m", "state": {"w": lazy}}, {"kind": "o", "state": {}}, None, {}, None])
    data = rec.save(NamedMpkBytesRecorder(FullPrecisionSettings()))
    assert len(reads) == 1 and not lazy.is_loaded  # no separate pass that loads and keeps it
    back = NamedMpkBytesRecorder().load_item(data)[0]["state"]["w"]
    assert back.dtype is DType.F64 and back.array.tolist() == [0.5, 1.5, 2.0]


def test_mmap_loads_restore_the_saved_dtype_lazily_and_still_verify(tmp_path):
    w = TensorData.from_array(np.arange(64, dtype=np.float64) / 4)
    path = NamedMpkFileRecorder(HalfPrecisionSettings()).save_item({"w": w}, tmp_path / "m.mpk")
    back = NamedMpkFileRecorder().load_item(path, mmap=True)["w"]
    assert back.dtype is DType.F64 and not back.is_loaded
    assert back.bitwise_equal(w)
    raw = bytearray(path.read_bytes())
    raw[raw.index(np.float16(15.75).tobytes())] ^= 1  # one stored payload byte
    path.write_bytes(bytes(raw))
    damaged = NamedMpkFileRecorder().load_item(path, mmap=True)["w"]
    with pytest.raises(trainrec.ChecksumError):
        damaged.array  # noqa: B018


@pytest.mark.parametrize("kind", ["torch", "flax"])
def test_an_envelope_dtype_table_that_does_not_fit_is_corrupt(kind, tmp_path):
    recorder = _recorder(kind, FullPrecisionSettings())
    path = recorder.save_item({"w": TensorData.from_array(np.array([1.5], np.float64))},
                              tmp_path / "e")
    for table, match in [({"w": "f64"}, "does not match"), (["f64", None], "does not match"),
                         (["u64"], "never stored")]:
        if kind == "torch":
            import torch

            doc = torch.load(path, weights_only=True)
            assert doc["dtypes"] == ["f64"]
            buf = io.BytesIO()
            torch.save({**doc, "dtypes": table}, buf)
            zipped = buf.getvalue()  # sealed with a file checksum: the table itself is refused
            body = zipped[:-2] + (19).to_bytes(2, "little") + b"trainrec.crc32:"
            (tmp_path / "bad").write_bytes(body + zlib.crc32(body).to_bytes(4, "big"))
        else:
            import msgpack

            doc = msgpack.unpackb(path.read_bytes())
            assert doc["dtypes"] == ["f64"]
            doc = {**doc, "dtypes": table}
            doc["crc"] = doc.pop("crc") and 0  # last, as a positive fixint to widen to uint32
            body = msgpack.packb(doc)[:-1] + b"\xce"
            (tmp_path / "bad").write_bytes(body + zlib.crc32(body).to_bytes(4, "big"))
        with pytest.raises(trainrec.CorruptRecordError, match=match):
            recorder.load_item(tmp_path / "bad")


def _envelope_doc(kind: str, path) -> Any:
    if kind == "torch":
        import torch

        return torch.load(path, weights_only=True)
    import msgpack

    return msgpack.unpackb(path.read_bytes())


@pytest.mark.parametrize("kind", ["torch", "flax"])
@pytest.mark.parametrize("inner", [np.int32, np.float32, np.float64, np.uint8])
def test_tensors_whose_dotted_paths_collide_each_keep_their_dtype_and_checksum(kind, inner, tmp_path):
    # "a.b" and a -> b both join to the path "a.b": the envelope tables are by position
    recorder = _recorder(kind, FullPrecisionSettings())
    item = {"a.b": TensorData.from_array(np.array([1.0], np.float64)),
            "a": {"b": TensorData.from_array(np.array([2], inner))}}
    path = recorder.save_item(item, tmp_path / "e")
    back = recorder.load_item(path)
    assert back["a.b"].dtype is DType.F64 and back["a.b"].read().tolist() == [1.0]
    assert back["a"]["b"].dtype is DType.from_numpy(inner) and back["a"]["b"].read().tolist() == [2]
    doc = _envelope_doc(kind, path)
    assert len(doc["checksums"]) == 2 and len(doc["dtypes"]) == 2  # both tensors verified


def test_flax_refuses_at_save_the_chunked_array_key_it_could_not_load(tmp_path):
    recorder = _recorder("flax", FullPrecisionSettings())
    item = {"state": {"__msgpack_chunked_array__": True, "shape": {}, "chunks": {}}}
    target = tmp_path / "e.msgpack"
    target.write_bytes(b"old")
    with pytest.raises(trainrec.CorruptRecordError, match="reserved") as e:
        recorder.save_item(item, target)
    assert e.value.key == "state" and target.read_bytes() == b"old"
    # NamedMpk stores it
    assert NamedMpkFileRecorder().load_item(NamedMpkFileRecorder().save_item(item, tmp_path / "n")) == item


@pytest.mark.parametrize("kind", ["torch", "flax"])
def test_a_key_at_the_string_limit_over_a_tensor_loads(kind, tmp_path):
    # the tables used to repeat the key path: at the limit the path no longer loaded
    from trainrec.format.limits import Limits

    recorder = _recorder(kind, FullPrecisionSettings())
    key = "k" * Limits().max_str_bytes
    path = recorder.save_item({key: TensorData.from_array(np.zeros(1, np.float32))}, tmp_path / "e")
    back = recorder.load_item(path)
    assert list(back) == [key] and back[key].dtype is DType.F32
    with pytest.raises(trainrec.CorruptRecordError, match="never load"):
        recorder.save_item({key + "k": TensorData.from_array(np.zeros(1, np.float32))}, tmp_path / "f")
