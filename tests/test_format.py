"""The NamedMpk format: round trips, determinism, alignment, checksums, hardening."""

from __future__ import annotations

import io
import os
import zlib
from pathlib import Path

import ml_dtypes
import msgpack
import numpy as np
import pytest

import trainrec
import trainrec.format as fmt
from trainrec import (
    ChecksumError,
    CorruptRecordError,
    DType,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    RecorderError,
    TensorData,
    UnsupportedVersionError,
)
from trainrec.precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
)

SETTINGS = [FullPrecisionSettings(), HalfPrecisionSettings(), DoublePrecisionSettings(),
            NativePrecisionSettings()]
ALL_DTYPES = list(DType)


def sample(dtype: DType, shape: tuple[int, ...] = (3, 5), seed: int = 0) -> np.ndarray:
    """Values every precision represents exactly (small ints, halves), so round trips
    under any settings compare equal."""
    rng = np.random.default_rng(seed)
    if dtype is DType.BOOL:
        return rng.random(shape) > 0.5
    vals = rng.integers(0, 100, size=shape)
    if dtype.is_float:
        return (vals / 2).astype(dtype.numpy)
    return vals.astype(dtype.numpy)


def item_with_all() -> dict:
    item: dict = {f"t_{d.value}": TensorData.from_array(sample(d)) for d in ALL_DTYPES}
    item["zero_d"] = TensorData.from_array(np.array(2.5, np.float32))
    item["empty"] = TensorData.from_array(np.zeros((0, 7), np.float32))
    item["noncontig"] = TensorData.from_array(np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2])
    item["nested"] = {"list": [1, -2, 2**63, 1.5, None, True, "s", b"\x00\xff"], "deep": {"a": {"b": []}}}
    return item


def roundtrip(recorder, item, tmp_path: Path):
    if isinstance(recorder, NamedMpkBytesRecorder):
        return recorder.load_item(recorder.save_item(item))
    path = tmp_path / "x.mpk"
    recorder.save_item(item, path)
    return recorder.load_item(path)


RECORDERS = [NamedMpkFileRecorder, NamedMpkGzFileRecorder, NamedMpkBytesRecorder]


@pytest.mark.parametrize("recorder_cls", RECORDERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.name)
def test_roundtrip_every_dtype_precision_recorder(recorder_cls, settings, tmp_path):
    item = item_with_all()
    back = roundtrip(recorder_cls(settings), item, tmp_path)
    assert back["nested"] == item["nested"]
    for key, t in item.items():
        if not isinstance(t, TensorData):
            continue
        got = back[key]
        assert isinstance(got, TensorData)
        assert got.shape == t.shape
        assert got.dtype is t.dtype, key  # the settings chose only the storage dtype
        assert got.bitwise_equal(t), key


def test_bf16_native_roundtrip_is_bitwise(tmp_path):
    arr = np.array([1.0, -0.0, np.inf, np.nan, 3.140625], dtype=ml_dtypes.bfloat16)
    t = TensorData.from_array(arr)
    back = roundtrip(NamedMpkFileRecorder(NativePrecisionSettings()), {"b": t}, tmp_path)["b"]
    assert back.dtype is DType.BF16 and back.bitwise_equal(t)


def test_same_record_gives_identical_bytes(tmp_path):
    r = NamedMpkFileRecorder()
    r.save_item(item_with_all(), tmp_path / "a")
    r.save_item(item_with_all(), tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    gz = NamedMpkGzFileRecorder()
    gz.save_item(item_with_all(), tmp_path / "a.gz")
    gz.save_item(item_with_all(), tmp_path / "b.gz")
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()


def test_plain_msgpack_reads_a_file_following_the_spec(tmp_path):
    """spec/FORMAT.md is enough to read a file with msgpack and numpy alone."""
    item = {"w": TensorData.from_array(sample(DType.F32)), "meta": {"step": 3}}
    path = NamedMpkFileRecorder(NativePrecisionSettings()).save_item(item, tmp_path / "s.mpk", "Demo")
    doc = msgpack.unpackb(path.read_bytes())
    assert list(doc) == ["format", "version", "trainrec", "settings", "record", "header_crc",
                         "item", "item_crc"]
    assert doc["format"] == "trainrec.namedmpk" and doc["version"] == [1, 1]
    assert doc["record"] == "Demo"
    t = doc["item"]["w"]
    assert t["__tensor__"] == "f32"
    arr = np.frombuffer(t["data"], "<f4").reshape(t["shape"])
    assert zlib.crc32(t["data"]) == t["crc"]
    np.testing.assert_array_equal(arr, item["w"].array)
    assert doc["item"]["meta"] == {"step": 3}
    raw = path.read_bytes()
    assert zlib.crc32(raw[: raw.index(b"\xaaheader_crc")]) == doc["header_crc"]


def test_plain_msgpack_reads_the_saved_dtype_following_the_spec(tmp_path):
    """Since 1.1 a tensor the settings stored in another dtype names its saved dtype."""
    item = {"w": TensorData.from_array(sample(DType.F64)), "u": TensorData.from_array(sample(DType.U32)),
            "f": TensorData.from_array(sample(DType.F32))}
    path = NamedMpkFileRecorder(FullPrecisionSettings()).save_item(item, tmp_path / "s.mpk")
    doc = msgpack.unpackb(path.read_bytes())
    w = doc["item"]["w"]
    assert list(w) == ["__tensor__", "dtype", "shape", "pad", "data", "crc"]
    assert (w["__tensor__"], w["dtype"]) == ("f32", "f64")
    restored = np.frombuffer(w["data"], "<f4").reshape(w["shape"]).astype("<f8")
    np.testing.assert_array_equal(restored, item["w"].array)
    assert "dtype" not in doc["item"]["u"] and doc["item"]["u"]["__tensor__"] == "u32"
    assert "dtype" not in doc["item"]["f"]  # stored as it was saved


def test_payloads_are_64_byte_aligned_and_mmap_is_zero_copy(tmp_path):
    item = {f"t{i}": TensorData.from_array(np.arange(i + 1, dtype=np.float32)) for i in range(20)}
    path = NamedMpkFileRecorder().save_item(item, tmp_path / "a.mpk")
    back = NamedMpkFileRecorder().load_item(path, mmap=True)
    for t in back.values():
        assert not t.is_loaded
        arr = t.array
        assert arr.ctypes.data % 64 == 0
        assert not arr.flags.owndata and not arr.flags.writeable
    eager = NamedMpkFileRecorder().load_item(path)
    assert all(t.array.ctypes.data % 64 == 0 for t in eager.values())


def test_large_tensors_are_chunked(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt.limits, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(fmt.limits, "MIN_CHUNK_BYTES", 1000)  # readers refuse shorter chunks but the last
    t = TensorData.from_array(np.arange(1001, dtype=np.float64))
    path = NamedMpkFileRecorder().save_item({"big": t}, tmp_path / "c.mpk")
    doc = msgpack.unpackb(path.read_bytes())
    assert isinstance(doc["item"]["big"]["data"], list) and len(doc["item"]["big"]["data"]) == 5  # 4004 B of f32
    back = NamedMpkFileRecorder(NativePrecisionSettings()).load_item(path)["big"]
    np.testing.assert_array_equal(back.array, t.array.astype(np.float32))


def _doc(item=None) -> bytes:
    out = io.BytesIO()
    fmt.write_document(out, item, NativePrecisionSettings(), "Item")
    return out.getvalue()


def _with_raw_item(raw_item: bytes) -> bytes:
    """A document whose header is valid and whose item is `raw_item` (structure crc valid)."""
    base = _doc(None)
    cut = base.index(b"\xa4item") + 5
    return base[:cut] + raw_item + msgpack.packb("item_crc") + msgpack.packb(zlib.crc32(raw_item))


def _load(data: bytes):
    return NamedMpkBytesRecorder().load_item(data)


def test_every_truncation_is_a_recorder_error():
    data = _doc(item_with_all())
    for n in range(len(data)):
        with pytest.raises(CorruptRecordError):
            _load(data[:n])


def test_every_single_bit_flip_is_detected():
    data = bytearray(_doc({"w": TensorData.from_array(sample(DType.F32, (4,))), "n": [1, "x"]}))
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 1 << (i % 8)
        with pytest.raises(RecorderError):
            _load(bytes(flipped))


def test_random_bytes_and_wrong_magic():
    rng = np.random.default_rng(1)
    for n in (1, 2, 10, 1000):
        with pytest.raises(CorruptRecordError):
            _load(rng.bytes(n))
    with pytest.raises(CorruptRecordError, match="wrong magic"):
        _load(msgpack.packb({"format": "safetensors", "version": [1, 0]}))
    with pytest.raises(CorruptRecordError, match="wrong magic"):
        _load(b"PK\x03\x04" + bytes(100))


def test_unknown_major_version_names_both(monkeypatch):
    monkeypatch.setattr(fmt.header, "FORMAT_VERSION", (7, 3))
    data = _doc({"a": 1})
    monkeypatch.undo()
    with pytest.raises(UnsupportedVersionError, match=r"7\.3.*1\.x"):
        _load(data)


def test_newer_minor_version_with_extra_header_key_is_read():
    base = _doc({"a": 1})
    cut = base.index(b"\xaaheader_crc")
    head = b"\x89" + base[1:cut].replace(msgpack.packb([1, 0]), msgpack.packb([1, 4]))
    head += msgpack.packb("future") + msgpack.packb({"x": 1})
    rest = base[base.index(b"\xa4item"):]
    data = head + msgpack.packb("header_crc") + msgpack.packb(zlib.crc32(head)) + rest
    assert _load(data) == {"a": 1}


def test_declared_lengths_beyond_the_file_are_refused_before_allocating():
    tensor_hdr = (b"\x85" + msgpack.packb("__tensor__") + msgpack.packb("u8")
                  + msgpack.packb("shape") + msgpack.packb([3 * 2**30]) + msgpack.packb("pad")
                  + b"\xc4\x00" + msgpack.packb("data") + b"\xc6" + (3 * 2**30).to_bytes(4, "big"))
    with pytest.raises(CorruptRecordError, match="truncated"):
        _load(_with_raw_item(tensor_hdr + b"\x00" * 64))
    with pytest.raises(CorruptRecordError, match="entries"):
        _load(_with_raw_item(b"\xdd\xff\xff\xff\xff"))
    with pytest.raises(CorruptRecordError):
        _load(_with_raw_item(b"\xdb\xff\xff\xff\xf0" + b"a" * 10))


def test_shape_product_overflow_is_refused():
    data = b"\x00" * 8
    raw = (b"\x85" + msgpack.packb("__tensor__") + msgpack.packb("f64") + msgpack.packb("shape")
           + msgpack.packb([2**40, 2**40, 2**40]) + msgpack.packb("pad") + b"\xc4\x00"
           + msgpack.packb("data") + b"\xc6" + len(data).to_bytes(4, "big") + data
           + msgpack.packb("crc") + msgpack.packb(zlib.crc32(data)))
    # the payload is outside the structure checksum, so build it by hand
    base = _doc(None)
    cut = base.index(b"\xa4item") + 5
    struct = raw[: raw.index(data)] + raw[raw.index(data) + len(data):]
    doc = base[:cut] + raw + msgpack.packb("item_crc") + msgpack.packb(zlib.crc32(struct))
    with pytest.raises(CorruptRecordError, match="needs"):
        _load(doc)


def test_deep_nesting_is_refused_quickly():
    with pytest.raises(CorruptRecordError, match="nesting"):
        _load(_with_raw_item(b"\x91" * 1_000_000 + b"\xc0"))


def test_unknown_dtype_and_wrong_types_where_tensors_belong():
    raw = (b"\x85" + msgpack.packb("__tensor__") + msgpack.packb("c64") + msgpack.packb("shape")
           + msgpack.packb([1]) + msgpack.packb("pad") + b"\xc4\x00" + msgpack.packb("data")
           + msgpack.packb("not bytes") + msgpack.packb("crc") + msgpack.packb(0))
    with pytest.raises(CorruptRecordError, match="unknown dtype"):
        _load(_with_raw_item(raw))
    raw2 = raw.replace(msgpack.packb("c64"), msgpack.packb("f32"))
    with pytest.raises(CorruptRecordError, match="not bin"):
        _load(_with_raw_item(raw2))


def test_mmap_verifies_each_tensor_when_first_read(tmp_path):
    a = TensorData.from_array(np.ones(100, np.float32))
    b = TensorData.from_array(np.zeros(100, np.float32))
    path = NamedMpkFileRecorder().save_item({"a": a, "b": b}, tmp_path / "m.mpk")
    raw = bytearray(path.read_bytes())
    raw[raw.index(np.ones(100, np.float32).tobytes()) + 7] ^= 0x10
    path.write_bytes(bytes(raw))
    lazy = NamedMpkFileRecorder().load_item(path, mmap=True)
    np.testing.assert_array_equal(lazy["b"].array, b.array)
    with pytest.raises(ChecksumError, match="key 'item.a'"):
        _ = lazy["a"].array
    with pytest.raises(ChecksumError):
        NamedMpkFileRecorder().load_item(path)


def test_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.mpk"
    with pytest.raises(trainrec.FileMissingError, match="nope.mpk"):
        NamedMpkFileRecorder().load_item(missing)
    bad = tmp_path / "bad.mpk"
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(CorruptRecordError, match="bad.mpk"):
        NamedMpkFileRecorder().load_item(bad)
    bad.write_bytes(b"")
    with pytest.raises(CorruptRecordError, match="empty"):
        NamedMpkFileRecorder().load_item(bad, mmap=True)
    gz = tmp_path / "bad.mpk.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(CorruptRecordError, match="bad.mpk.gz"):
        NamedMpkGzFileRecorder().load_item(gz)


def test_gzip_bomb_is_refused(tmp_path):
    path = NamedMpkGzFileRecorder(max_bytes=1 << 30).save_item(
        {"z": TensorData.from_array(np.zeros(1 << 20, np.uint8))}, tmp_path / "z.gz")
    with pytest.raises(CorruptRecordError, match="max_bytes"):
        NamedMpkGzFileRecorder(max_bytes=1 << 16).load_item(path)


def test_failed_save_leaves_the_existing_file_and_no_temp(tmp_path):
    path = tmp_path / "keep.mpk"
    NamedMpkFileRecorder().save_item({"v": 1}, path)
    before = path.read_bytes()

    def lost():
        raise RuntimeError("device lost mid-save")

    bad = TensorData(DType.F32, (3,), lost)
    with pytest.raises(RuntimeError, match="device lost"):
        NamedMpkFileRecorder().save_item({"a": TensorData.from_array(np.ones(9)), "b": bad}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.mpk"]


def test_malformed_items_are_refused_before_writing(tmp_path):
    path = tmp_path / "x.mpk"
    for item in ({"__tensor__": 1}, {1: 2}, {"a": object()}, {"a": 2**64}, {"t": (1, 2)}):
        with pytest.raises(CorruptRecordError):
            NamedMpkFileRecorder().save_item(item, path)
    assert not path.exists()


def test_api_misuse_is_type_error(tmp_path):
    with pytest.raises(TypeError):
        NamedMpkFileRecorder().save_item({}, 42)
    with pytest.raises(TypeError):
        NamedMpkBytesRecorder().save_item({}, tmp_path / "x")
    with pytest.raises(TypeError):
        NamedMpkBytesRecorder().load_item("not bytes")
    with pytest.raises(TypeError):
        NamedMpkFileRecorder(settings="full")


def test_header_reports_settings_and_record(tmp_path):
    path = trainrec.CompactRecorder().save_item({"x": 1}, tmp_path / "h.mpk", "Thing")
    header, item = trainrec.read_file(path)
    assert header.settings == HalfPrecisionSettings()
    assert header.record_type == "Thing" and header.version == (1, 1) and item == {"x": 1}


def test_from_array_never_changes_the_callers_array():
    arr = np.arange(4, dtype=np.float32)
    view = TensorData.from_array(arr, copy=False)
    assert arr.flags.writeable and not view.array.flags.writeable
    copied = TensorData.from_array(arr)
    arr[0] = 9
    assert copied.array[0] == 0 and view.array[0] == 9


def test_mmap_verify_checks_every_tensor_now_and_durable_false_still_replaces_atomically(tmp_path):
    path = tmp_path / "v.mpk"
    fast = NamedMpkFileRecorder(durable=False)
    fast.save_item({"a": TensorData.from_array(np.arange(64, dtype=np.float32))}, path)
    item = fast.load_item(path, mmap=True, verify=True)
    assert item["a"].is_loaded and item["a"].array.ctypes.data % 64 == 0
    raw = bytearray(path.read_bytes())
    raw[raw.index(np.float32(5).tobytes())] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):
        fast.load_item(path, mmap=True, verify=True)
    assert [p.name for p in tmp_path.iterdir()] == ["v.mpk"]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("chunk", [fmt.limits.CHUNK_BYTES, 1000])
def test_size_bound_is_an_upper_bound_within_the_checksum_encodings(settings, chunk, monkeypatch):
    monkeypatch.setattr(fmt.limits, "CHUNK_BYTES", chunk)
    rng = np.random.default_rng(5)
    item = item_with_all()
    item["big"] = TensorData.from_array(rng.standard_normal(1001))
    item["many"] = [TensorData.from_array(rng.standard_normal(i)) for i in range(40)]
    n_tensors = sum(1 for _ in trainrec.items.tree.iter_tensors(item))
    out = io.BytesIO()
    fmt.write_document(out, item, settings, "Item", allow_lossy=True)
    bound = fmt.document_size_bound(item, settings, "Item")
    # each tensor's crc and the two structure crcs are counted at 5 bytes
    assert len(out.getvalue()) <= bound <= len(out.getvalue()) + 4 * (n_tensors + 2)


def test_size_bound_reads_no_tensor():
    def never() -> np.ndarray:
        raise AssertionError("read")

    lazy = TensorData(DType.F32, (1000, 1000), never)
    bound = fmt.document_size_bound({"w": lazy}, FullPrecisionSettings(), "Item")
    assert 4_000_000 < bound < 4_000_400  # the header (~200 B), the pad (< 64 B), the tensor framing
