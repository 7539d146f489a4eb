"""Small checkpoints are cheap: the writer's fixed work per tensor is a handful of
operations, not one write and one checksum call per msgpack value."""

from __future__ import annotations

import io

import numpy as np

import trainrec.format as fmt
from trainrec import (
    FullPrecisionSettings,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    TensorData,
)

NATIVE = NativePrecisionSettings()


class _Sink:
    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.writes = 0

    def write(self, data: object) -> int:
        self.writes += 1
        return self.out.write(data)  # type: ignore[arg-type]


def test_each_tensor_costs_two_writes_whatever_its_fields():
    rng = np.random.default_rng(1)
    item: dict[str, object] = {f"layers.{i}.w": TensorData.from_array(rng.standard_normal(i + 1).astype(np.float32))
                               for i in range(100)}
    item["step"], item["lr"], item["tag"] = 3, 0.5, "x"
    sink = _Sink()
    fmt.write_document(sink, item, NATIVE, "Item")
    # one write of structure before each payload, the payload, and four for the header,
    # its checksum, the item's start and the trailer
    assert sink.writes <= 2 * 100 + 4
    doc = sink.out.getvalue()
    assert doc == NamedMpkBytesRecorder(NATIVE).save_item(item)
    assert fmt.document_size_bound(item, NATIVE, "Item") >= len(doc)
    start = np.frombuffer(doc, np.uint8).ctypes.data
    _, back = fmt.read_document(doc, "<bytes>")
    for k, t in item.items():
        if isinstance(t, TensorData):
            assert (back[k].array.ctypes.data - start) % fmt.ALIGNMENT == 0, k
            assert back[k].bitwise_equal(t)


def test_converted_and_empty_tensors_keep_their_dtype_and_shape():
    """The tensor header packed in one piece is the one written value by value: the
    stored dtype, the saved one, the shape."""
    item = {"f64": TensorData.from_array(np.arange(5, dtype=np.float64)),
            "empty": TensorData.from_array(np.zeros((0, 3), np.float32)),
            "scalar": TensorData.from_array(np.float32(2.5)),
            "i64": TensorData.from_array(np.arange(7, dtype=np.int64).reshape(7, 1))}
    _, back = fmt.read_document(NamedMpkBytesRecorder(FullPrecisionSettings()).save_item(item), "<bytes>")
    for k, t in item.items():
        assert back[k].bitwise_equal(t), k


def test_every_save_reserves_about_its_size_first_and_frees_the_rest(tmp_path, monkeypatch):
    """Small saves reserved nothing (the reservation was thought to cost as much as the
    writes); measured on ext4, replacing an older file without one costs a flush at the
    rename (auto_da_alloc): a 2 MB save took 1.5 ms with, 0.5 ms without. Now every save
    reserves about its size, and the file ends at its document (the rest is freed)."""
    from trainrec import NamedMpkFileRecorder
    from trainrec.storage import atomic as _atomic

    calls: list[int] = []
    real = _atomic._fallocate
    if real is None:
        import pytest

        pytest.skip("no fallocate here")
    monkeypatch.setattr(_atomic, "_fallocate", lambda fd, mode, off, n: calls.append(n) or real(fd, mode, off, n))
    rng = np.random.default_rng(0)
    small = {f"t{i}": TensorData.from_array(rng.standard_normal(5000).astype(np.float32)) for i in range(100)}
    for _ in range(2):  # the second replaces the first
        path = NamedMpkFileRecorder(durable=False).save_item(small, tmp_path / "s.mpk")
        assert path.stat().st_size <= calls[-1] <= path.stat().st_size * 1.01
        assert path.stat().st_blocks * 512 < path.stat().st_size + 64 * 1024  # the rest freed
    assert len(calls) == 2
    _, back = NamedMpkFileRecorder().read(path)
    assert all(back[k].bitwise_equal(t) and back[k].dtype == t.dtype for k, t in small.items())
    large = {"w": TensorData.from_array(np.ones((5, 1 << 20), np.float32)), "step": 7}
    path = NamedMpkFileRecorder(durable=False).save_item(large, tmp_path / "l.mpk")
    assert len(calls) == 3 and path.stat().st_size <= calls[-1] <= path.stat().st_size + 1024
    _, back = NamedMpkFileRecorder().read(path)
    assert back["w"].bitwise_equal(large["w"]) and back["step"] == 7


def test_the_size_estimate_is_close_to_the_document_for_every_kind_of_value(monkeypatch):
    # a tensor over one chunk, at the smallest chunk size writers may cut at: the writer and the
    # estimate read CHUNK_BYTES at use, so the same two-chunk path runs as at 2 GiB, on 1 MiB
    monkeypatch.setattr(fmt.limits, "CHUNK_BYTES", fmt.limits.MIN_CHUNK_BYTES)
    rng = np.random.default_rng(2)
    items = [
        {"w": TensorData.from_array(rng.standard_normal((3, 4)).astype(np.float64)), "s": "x" * 300,
         "b": b"\x01" * 999, "n": [1, 2.5, None, True, {"deep": [TensorData.from_array(np.zeros(0, np.int8))]}]},
        {f"layer{i}": TensorData.from_array(rng.standard_normal(i * 100 + 1).astype(np.float32)) for i in range(50)},
        {"big": TensorData.from_array(np.zeros(fmt.limits.CHUNK_BYTES // 4 + 10, np.float32))},
    ]
    for settings in (NATIVE, FullPrecisionSettings()):
        for item in items:
            size = len(NamedMpkBytesRecorder(settings).save_item(item, allow_lossy=True))
            estimate = fmt.document_size_estimate(item, settings)
            assert size <= estimate <= size + 1024 + 200 * len(item), (size, estimate)
    big = NamedMpkBytesRecorder(NATIVE).save_item(items[2])
    full_chunk = b"\xc6" + fmt.limits.CHUNK_BYTES.to_bytes(4, "big")  # bin32 of one whole chunk
    assert big.count(full_chunk) == 1, "the big tensor was not cut into two chunks"
