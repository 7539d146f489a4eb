"""Damaged and hostile Burn files (`trainrec.recorders.burn`): truncations, bit flips and crafted
headers of Burnpack, Burn NamedMpk (plain and gzip) and Bin files get a `RecorderError`
(or read, where Burn's format cannot tell: it keeps no checksum), never another exception,
and each refusal stays within a second of CPU time and the file's size in memory (measured
in a forked child by `bounded_runner.py`, through `trainrec verify`)."""

from __future__ import annotations

import gzip
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

import trainrec
import trainrec.cli.commands
from trainrec import RecorderError, TensorData, UnsupportedVersionError, read_file
from trainrec.format import cbor
from trainrec.recorders.burn import BurnNamedMpkRecorder, BurnpackRecorder, param_id_text

HERE = Path(__file__).parent
CPU_S = 1.0
SLACK_MIB = 48


def _bpk_item():
    rng = np.random.default_rng(0)
    return {"tensors": {"fc.weight": TensorData.from_array(rng.normal(size=(6, 4)).astype(np.float32)),
                        "fc.bias": TensorData.from_array(np.arange(4, dtype=np.float32)),
                        "norm.gamma": TensorData.from_array(np.ones(3, np.float16))},
            "param_ids": {"fc.weight": 1, "fc.bias": 2, "norm.gamma": 2**64 - 1},
            "metadata": {"producer": "test"}, "scalars": {"x": {"UInt": 3}}, "dtypes": {}}


@pytest.fixture
def files(tmp_path):
    """A small Burnpack, Burn NamedMpk, its gzip and a Bin, all from the writers here (the
    Bin by hand: bincode of the same record)."""
    bpk, mpk, gz = tmp_path / "m.bpk", tmp_path / "m.mpk", tmp_path / "m.mpk.gz"
    BurnpackRecorder().save_item(_bpk_item(), bpk)
    _, item = read_file(bpk)
    BurnNamedMpkRecorder().save_item(item, mpk)
    BurnNamedMpkRecorder(compress=True).save_item(item, gz)
    return {"bpk": bpk, "mpk": mpk, "gz": gz, "bin": _bin(tmp_path / "m.bin", item)}


def _varint(n: int) -> bytes:
    if n < 251:
        return bytes([n])
    for tag, size in ((251, 2), (252, 4), (253, 8)):
        if n < 1 << (8 * size):
            return bytes([tag]) + n.to_bytes(size, "little")
    raise ValueError(n)


def _text(s: str) -> bytes:
    raw = s.encode()
    return _varint(len(raw)) + raw


_META = ["f32", "i32", "burn_core::record::file::BinFileRecorder<burn_core::record::settings::"
         "FullPrecisionSettings>", "0.21.0", "FullPrecisionSettings"]


def _bin(path: Path, item) -> Path:
    """A Bin file as Burn 0.21 writes `{fc: Linear {weight, bias: Some}, norm: {gamma, eps: ()}}`."""
    out = b"".join(_text(s) for s in _META)
    index = {trainrec.DType.F32: 1, trainrec.DType.F16: 3}
    for name, t in item["tensors"].items():
        out += b"\x01" if name == "fc.bias" else b""
        out += _text(param_id_text(item["param_ids"][name])) + _varint(t.nbytes) + t.to_bytes()
        out += _varint(len(t.shape)) + b"".join(_varint(d) for d in t.shape) + _varint(index[t.dtype])
    path.write_bytes(out + b"\x00")
    return path


def test_the_small_files_read_back_as_written(files):
    item = _bpk_item()
    for name in ("bpk", "mpk", "gz"):
        _, got = read_file(files[name])
        tensors = got["tensors"] if name == "bpk" else {
            k: v for k, v in trainrec.items.tree.iter_tensors(got["item"])}
        assert all(tensors[k].bitwise_equal(v) for k, v in item["tensors"].items()), name
    header, b = read_file(files["bin"], template=files["bpk"])
    assert b["item"]["fc"]["weight"].bitwise_equal(item["tensors"]["fc.weight"])
    assert b["param_ids"]["norm.gamma"] == param_id_text(2**64 - 1)


def _cases(files, tmp_path) -> list[tuple[str, Path]]:
    """(id, path) of every damaged and crafted file."""
    out: list[tuple[str, Path]] = []
    rng = random.Random(0)

    def add(name: str, data: bytes, suffix: str) -> None:
        p = tmp_path / f"{name}{suffix}"
        p.write_bytes(data)
        out.append((name, p))

    for kind, suffix in (("bpk", ".bpk"), ("mpk", ".mpk"), ("gz", ".mpk.gz"), ("bin", ".bin")):
        raw = files[kind].read_bytes()
        for cut in sorted({1, 4, 9, 10, 11, 20, len(raw) // 3, len(raw) // 2, len(raw) - 1}):
            add(f"{kind}-cut{cut}", raw[:cut], suffix)
        for i in range(12):
            data = bytearray(raw)
            at = rng.randrange(min(len(raw), 700 if kind == "bpk" else len(raw)))
            data[at] ^= 1 << rng.randrange(8)
            add(f"{kind}-flip{i}-at{at}", bytes(data), suffix)
    head = files["bpk"].read_bytes()
    meta_len = struct.unpack_from("<I", head, 6)[0]
    doc = cbor.decode(head[10 : 10 + meta_len], "")

    def bpk(name: str, metadata: bytes, data: bytes = b"", version: int = 1, size: int | None = None) -> None:
        blob = b"NRUB" + struct.pack("<HI", version, len(metadata) if size is None else size) + metadata
        add(name, blob + bytes(-len(blob) % 256) + data, ".bpk")

    def with_tensor(**desc) -> bytes:
        d = {**doc["tensors"]["fc.bias"], **desc}
        return cbor.encode({"tensors": {"t": d}})

    bpk("bpk-version-2", cbor.encode(doc), version=2)
    bpk("bpk-metadata-4GiB", b"", size=0xFFFFFFFF)
    bpk("bpk-metadata-past-the-end", cbor.encode(doc), size=99 << 20)
    bpk("bpk-cbor-deep", b"\x81" * 200 + b"\x00")
    bpk("bpk-cbor-array-of-2**32", b"\xa1\x67tensors\x9a\xff\xff\xff\xff")
    bpk("bpk-cbor-map-of-2**60", b"\xbb" + (2**60).to_bytes(8, "big"))
    bpk("bpk-cbor-string-of-2**40", b"\xa1\x7b" + (2**40).to_bytes(8, "big"))
    bpk("bpk-cbor-indefinite", b"\xbf\xff")
    bpk("bpk-cbor-tag", b"\xc1\x00")
    bpk("bpk-cbor-duplicate-key", b"\xa2\x61a\x00\x61a\x00")
    bpk("bpk-cbor-trailing", cbor.encode(doc) + b"\x00")
    bpk("bpk-unknown-key", cbor.encode({**doc, "extra": 1}))
    bpk("bpk-dtype-unknown", with_tensor(dtype="F8"))
    bpk("bpk-dtype-qfloat", with_tensor(dtype={"QFloat": {"value": "Q8S"}}))
    bpk("bpk-shape-huge", with_tensor(shape=[2**40, 2**40]))
    bpk("bpk-shape-negative", with_tensor(shape=[-1]))
    bpk("bpk-shape-deep", with_tensor(shape=[1] * 40))
    bpk("bpk-bytes-too-few", with_tensor(data_offsets=[0, 8]), bytes(16))
    bpk("bpk-offsets-past-the-end", with_tensor(data_offsets=[1 << 40, (1 << 40) + 16]), bytes(16))
    bpk("bpk-offsets-reversed", with_tensor(data_offsets=[16, 0]), bytes(16))
    bpk("bpk-param-id-negative", with_tensor(param_id=-1), bytes(16))
    bpk("bpk-param-id-float", with_tensor(param_id=1.5), bytes(16))
    bpk("bpk-not-a-map", cbor.encode([1, 2]))
    bpk("bpk-scalar-bad", cbor.encode({"tensors": {}, "scalars": {"x": {"UInt": -1}}}))
    two = {"a": {**doc["tensors"]["fc.bias"], "data_offsets": [0, 16]},
           "b": {**doc["tensors"]["fc.bias"], "data_offsets": [8, 24]}}
    bpk("bpk-overlap", cbor.encode({"tensors": two}), bytes(32))
    add("bpk-empty", b"", ".bpk")
    add("bpk-wrong-magic", b"BURN" + head[4:], ".bpk")

    def mpk(name: str, record) -> None:
        meta = {"float": "f32", "int": "i32", "format": "x", "version": "0.21.0", "settings": "S"}
        add(name, msgpack.packb({"metadata": meta, "item": record, "_b": []}, use_bin_type=True), ".mpk")

    def param(**p):
        return {"id": "0000000000000", "param": {"bytes": b"\0" * 16, "shape": [4], "dtype": "F32", **p}}

    mpk("mpk-bytes-too-few", {"w": param(bytes=b"\0" * 8)})
    mpk("mpk-dtype-unknown", {"w": param(dtype="F8")})
    mpk("mpk-dtype-qfloat", {"w": param(dtype={"QFloat": {}})})
    mpk("mpk-shape-huge", {"w": param(shape=[2**62, 2**62])})
    mpk("mpk-shape-strings", {"w": param(shape=["4"])})
    mpk("mpk-id-not-a-string", {"w": {"id": 7, "param": param()["param"]}})
    deep: object = 1
    for _ in range(80):
        deep = [deep]
    mpk("mpk-deep", {"w": deep})
    add("mpk-array-of-2**32", b"\x83\xa8metadata\x85\xa5float\xdd\xff\xff\xff\xff", ".mpk")
    add("mpk-no-metadata-fields", msgpack.packb({"metadata": {"float": "f32"}, "item": None}), ".mpk")
    add("mpk-ext", msgpack.packb({"metadata": {"float": "f32", "int": "i32", "format": "x", "version": "1",
                                               "settings": "S"}, "item": msgpack.ExtType(1, b"x"), "_b": []}), ".mpk")
    add("gz-not-burn-inside", gzip.compress(b"\x83\xa8metadata\x85\xa5floatXX" + bytes(100)), ".mpk.gz")
    add("gz-trailing", files["gz"].read_bytes() + b"junk", ".mpk.gz")
    binhead = b"".join(_text(s) for s in _META)
    for name, body in (("len-2**60", _text("0" * 13) + b"\xfd" + (2**60).to_bytes(8, "little")),
                       ("varint-u128", _text("0" * 13) + b"\xfe" + bytes(16)),
                       ("dtype-99", _text("0" * 13) + b"\x04" + bytes(4) + b"\x01\x01" + b"\x63"),
                       ("ndim-200", _text("0" * 13) + b"\x04" + bytes(4) + b"\xc8"),
                       ("qfloat", _text("0" * 13) + b"\x04" + bytes(4) + b"\x01\x01\x0e"),
                       ("id-not-base32", _text("!" * 13) + b"\x00"),
                       ("bytes-mismatch", _text("0" * 13) + b"\x08" + bytes(8) + b"\x01\x01\x01")):
        add(f"bin-{name}", binhead + body, ".bin")
    return out


def _bounded(cases, tmp_path):
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([{"id": i, "kind": "cli", "argv": ["verify", str(p)]} for i, p in cases]))
    done = subprocess.run([sys.executable, str(HERE / "bounded_runner.py"), str(spec)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_damaged_and_crafted_burn_files_are_refused_or_read_bounded_in_time_and_memory(files, tmp_path):
    cases = _cases(files, tmp_path)
    results = {r["id"]: r for r in _bounded(cases, tmp_path)}
    assert len(results) == len(cases)
    sizes = {i: p.stat().st_size for i, p in cases}
    for i, _ in cases:
        r = results[i]
        assert r["outcome"] in ("exit 0", "exit 1", "exit 3"), (i, r["outcome"])
        assert r["cpu_s"] < CPU_S, (i, r)
        assert r["rss_mib"] < sizes[i] / (1 << 20) * 2 + SLACK_MIB, (i, r)
        # a flipped bit in tensor bytes reads (Burn's files have no checksum), and so does a Bin
        # file cut after one of its parameters, read without a template (which knows how many)
        if "-flip" not in i and not i.startswith("bin-cut"):
            assert r["outcome"] != "exit 0", (i, r["outcome"])


def test_a_truncated_bin_file_is_refused_with_a_template(files, tmp_path):
    size = files["bin"].stat().st_size
    for i, path in _cases(files, tmp_path):
        # the last byte is the record's last constant (None): the tensors are all there, and the
        # template (a Burnpack's, which lists tensors only) does not say how many constants follow
        if i.startswith("bin-cut") and i != f"bin-cut{size - 1}":
            with pytest.raises(RecorderError):
                read_file(path, template=files["bpk"])


def test_every_crafted_refusal_is_a_recorder_error_naming_the_file(files, tmp_path):
    for i, path in _cases(files, tmp_path):
        try:
            read_file(path)
        except RecorderError as e:
            assert str(path) in str(e), (i, e)
            if i == "bpk-version-2":
                assert isinstance(e, UnsupportedVersionError)
        else:
            assert "-flip" in i or i.startswith("bin-cut"), f"{i} read"


def test_a_flipped_bit_in_a_tensor_reads_and_verify_says_it_cannot_tell(files, tmp_path, capsys):
    raw = bytearray(files["bpk"].read_bytes())
    raw[-1] ^= 0x40  # inside the last tensor's bytes
    p = tmp_path / "flipped.bpk"
    p.write_bytes(bytes(raw))
    assert trainrec.cli.commands.main(["verify", str(p)]) == 0
    assert "cannot be told" in capsys.readouterr().out


def test_a_bin_file_and_a_template_of_another_module_are_refused(files, tmp_path):
    item = _bpk_item()
    item["tensors"]["fc.weight"] = TensorData.from_array(np.zeros((4, 6), np.float32))
    BurnpackRecorder().save_item(item, tmp_path / "other.bpk")
    with pytest.raises(trainrec.RecordMismatchError, match="another module"):
        read_file(files["bin"], template=tmp_path / "other.bpk")
    del item["tensors"]["norm.gamma"]
    BurnpackRecorder().save_item({**item, "tensors": {**_bpk_item()["tensors"]}, "param_ids": {}},
                                 tmp_path / "same.bpk")
    read_file(files["bin"], template=tmp_path / "same.bpk")
    two = _bpk_item()
    del two["tensors"]["norm.gamma"]
    BurnpackRecorder().save_item(two, tmp_path / "fewer.bpk")
    with pytest.raises(trainrec.CorruptRecordError, match="after the last parameter"):
        read_file(files["bin"], template=tmp_path / "fewer.bpk")


def test_a_failed_burn_save_leaves_the_existing_file_as_it_was(files, tmp_path):
    before = files["bpk"].read_bytes()
    bad = _bpk_item()
    bad["metadata"] = {"k": 1}  # not a string
    with pytest.raises(RecorderError):
        BurnpackRecorder().save_item(bad, files["bpk"])
    lossy = _bpk_item()
    with pytest.raises(trainrec.LossyPrecisionError):
        BurnpackRecorder(trainrec.HalfPrecisionSettings()).save_item(lossy, files["bpk"])
    assert files["bpk"].read_bytes() == before
    with pytest.raises(RecorderError):
        BurnNamedMpkRecorder().save_item({"tensors": "x", "param_ids": {}}, files["mpk"])


def test_a_burn_file_named_as_another_format_is_refused_naming_both(files, tmp_path):
    p = tmp_path / "state.msgpack"
    p.write_bytes(files["mpk"].read_bytes())
    with pytest.raises(trainrec.CorruptRecordError, match="Burn NamedMpk"):
        read_file(p)
    p = tmp_path / "model.pt"
    p.write_bytes(files["bpk"].read_bytes())
    with pytest.raises(trainrec.CorruptRecordError, match="Burnpack"):
        read_file(p)


def test_a_gzip_stream_that_grows_past_its_cap_is_refused(files, tmp_path, monkeypatch):
    import trainrec.recorders.burn_namedmpk as burn_namedmpk

    monkeypatch.setattr(burn_namedmpk, "_GZ_BYTES", 100)
    monkeypatch.setattr(burn_namedmpk, "_GZ_RATIO", 1)
    with pytest.raises(trainrec.CorruptRecordError, match="decompresses to more than"):
        read_file(files["gz"])
