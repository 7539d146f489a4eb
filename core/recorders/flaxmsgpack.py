"""`FlaxMsgpackFileRecorder`: records in flax's msgpack convention, written and read
without jax or flax (pure msgpack; `trainrec.adapters.jax` re-exports it).

flax writes an ndarray as msgpack ext type 1 holding `packb((shape, dtype.name,
C-order bytes))`, a numpy scalar as ext type 3 holding the same for its 0-d array (read
back as a 0-d tensor), and an array above 2**30 bytes as
`{"__msgpack_chunked_array__": True, "shape": {"0": ...}, "chunks": {"0": ..., ...}}`.
Our files are a map `{"format": "trainrec.flax", "version": [2, 0], "trainrec", "settings",
"record", "item", "checksums": [crc32, ...], "dtypes": [saved dtype code | None, ...],
"crc": uint32}`, so `flax.serialization.msgpack_restore` reads them; the two tables have
one entry per tensor in tree order (`iter_tensors`), `dtypes` the saved dtype of each
tensor the settings stored in another one (else None); `crc`, the file's last four bytes, is the
CRC-32 of every byte before them (spec/ADAPTERS.md). A plain flax msgpack file (no header)
loads as an item, unchecked. Loading is bounded by the file size (core's msgpack reader and
its limits, tensors as views of the file's bytes) and never imports anything.
"""

from __future__ import annotations

import math
import mmap as _mmap
import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..errors import CorruptRecordError, RecorderError, reading
from ..format.envelope import (
    FILE_CRC_BYTES,
    CrcWriter,
    TensorTables,
    check_file_crc,
    header_fields,
    parse_header,
    reserve_bytes,
    restore_dtypes,
    verify_checksums,
)
from ..format.header import Header
from ..format.limits import Limits, check_limits
from ..format.parser import Ext, decode_msgpack
from ..items.checksum import crc32
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, check_item, join_key, walk
from ..precision import NativePrecisionSettings, store_tensor
from ..storage.files import open_regular
from ..storage.location import location, output
from .namedmpk import RecorderBase
from .sniff import HEAD_BYTES, format_of, reader_of

__all__ = ["FlaxMsgpackFileRecorder", "MAX_CHUNK_SIZE"]

FORMAT = "trainrec.flax"
VERSION = (2, 0)
MAX_CHUNK_SIZE = 2**30
_CHUNKED = "__msgpack_chunked_array__"
_NAMES = {("bfloat16" if d is DType.BF16 else d.numpy.name): d for d in DType}  # "float32", "bfloat16", ...
# (bfloat16 by its name: its numpy dtype imports ml_dtypes, needed only for a bf16 array)


def _ext(arr: np.ndarray[Any, Any]) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes("C")),
                                            use_bin_type=True))


_STREAM_BYTES = 1 << 16
"""From this size on, an array's ext32 and bin32 headers are written by hand and its bytes
straight from its buffer (the same bytes `msgpack.packb` gives, without three copies)."""


def _write_array(f: Any, packer: msgpack.Packer, arr: np.ndarray[Any, Any]) -> None:
    n = arr.nbytes
    if n < _STREAM_BYTES:
        f.write(packer.pack(_ext(arr)))
        return
    inner = (packer.pack_array_header(3) + packer.pack(list(arr.shape)) + packer.pack(arr.dtype.name)
             + b"\xc6" + n.to_bytes(4, "big"))
    f.write(b"\xc9" + (len(inner) + n).to_bytes(4, "big") + b"\x01" + inner)
    f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def _write_tensor(f: Any, packer: msgpack.Packer, t: TensorData) -> None:
    arr = t.array
    if arr.nbytes <= MAX_CHUNK_SIZE:
        _write_array(f, packer, arr)
        return
    flat = arr.reshape(-1)
    size = max(1, MAX_CHUNK_SIZE // arr.dtype.itemsize)
    starts = range(0, flat.size, size)
    f.write(packer.pack_map_header(3) + packer.pack(_CHUNKED) + packer.pack(True) + packer.pack("shape")
            + packer.pack({str(i): d for i, d in enumerate(arr.shape)}) + packer.pack("chunks")
            + packer.pack_map_header(len(starts)))
    for i, at in enumerate(starts):
        f.write(packer.pack(str(i)))
        _write_array(f, packer, flat[at : at + size])


class FlaxMsgpackFileRecorder(RecorderBase):
    """Records in a `.msgpack` file readable by `flax.serialization.msgpack_restore`
    (args: a path; output: the `Path`)."""

    suffix = ".msgpack"

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path | str:
        check_item(item)
        path = location(args)
        # the reader's bounds, at its depths: the item under the envelope map, a tensor an ext leaf
        check_limits(item, depth=2, tensor_depth=0, source=str(path))
        _check_no_chunk_marker(item, "", str(path))
        tables = TensorTables()
        packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        s = self.settings
        header = header_fields(FORMAT, VERSION, s, record_type)

        def write(f: Any, node: Item, key: str) -> None:
            if isinstance(node, TensorData):
                t = store_tensor(node, s, key=key, allow_lossy=allow_lossy,
                                 recorder=self.native_name())
                tables.add(node, t)
                _write_tensor(f, packer, t)
            elif isinstance(node, dict):
                f.write(packer.pack_map_header(len(node)))
                for k, v in node.items():
                    f.write(packer.pack(k))
                    write(f, v, join_key(key, k))
            elif isinstance(node, list):
                f.write(packer.pack_array_header(len(node)))
                for i, v in enumerate(node):
                    write(f, v, join_key(key, i))
            else:
                f.write(packer.pack(node))

        with output(path, size_hint=reserve_bytes(item, s)) as out:
            f = CrcWriter(out)
            f.write(packer.pack_map_header(len(header) + 4))  # item, checksums, dtypes, crc
            for k, v in header.items():
                f.write(packer.pack(k))
                f.write(packer.pack(v))
            f.write(packer.pack("item"))
            write(f, item, "")
            f.write(packer.pack("checksums"))
            f.write(packer.pack(tables.checksums))
            f.write(packer.pack("dtypes"))
            f.write(packer.pack(tables.dtypes))
            f.write(packer.pack("crc") + b"\xce")  # uint32: the crc is the file's last 4 bytes
            out.write(f.crc.to_bytes(FILE_CRC_BYTES, "big"))
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        """Header and item; `mmap=True` maps the file (tensors view the map) instead of
        reading it into memory. The structure is checked before the file is read."""
        path = location(args)
        if isinstance(path, str):  # through a local copy (remote.py)
            from .remote import read_url

            return read_url(path, mmap, only="trainrec.flax")
        source = str(path)
        with reading(source):
            with open_regular(path, source) as f:
                size = os.fstat(f.fileno()).st_size
                _check_start(os.pread(f.fileno(), max(64, HEAD_BYTES), 0), source)
                data: Any = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
                if not mmap:
                    # the structure first, on the map: a large file that is not a record is
                    # refused having read only what it took to tell
                    decode_msgpack(data, source)
                    del data
                    try:
                        data = np.empty(size, np.uint8)  # not zero-filled: read into at once
                    except MemoryError:
                        raise RecorderError(f"a file of {size} bytes does not fit in memory",
                                            source=source) from None
                    view, got = data.data, 0
                    while got < size and (n := f.readinto(view[got:])):
                        got += n
                    if got != size or f.read(1):
                        raise CorruptRecordError("file changed size while reading", source=source)
        return parse(data, source)


def _check_no_chunk_marker(item: Item, key: str, source: str) -> None:
    """Refuse a map holding the key flax reserves for chunked arrays: readers (flax's and
    ours) would take the map for an array."""
    for path, node, _ in walk(item, key):
        if isinstance(node, dict) and _CHUNKED in node:
            raise CorruptRecordError(
                f"the key {_CHUNKED!r} is reserved for flax's chunked arrays: it would save but "
                "never load (NamedMpkFileRecorder stores it)", source=source, key=path)


def _check_start(prefix: bytes, source: str) -> None:
    """Refuse a file that cannot be a msgpack map with str keys from its first bytes."""
    if not prefix:
        raise CorruptRecordError("empty file", source=source)
    found = format_of(prefix[:HEAD_BYTES])
    if found is not None and found != FORMAT:
        raise CorruptRecordError("not a flax msgpack file (wrong magic)"
                                 + reader_of(prefix[:HEAD_BYTES], not_=FORMAT), source=source)
    b = prefix[0]
    if not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF)):
        raise CorruptRecordError("neither a trainrec record nor a flax state dict (a map)",
                                 source=source)
    at = 1 if b <= 0x8F else 3 if b == 0xDE else 5
    if b != 0x80 and len(prefix) > at and not (0xA0 <= prefix[at] <= 0xBF or 0xD9 <= prefix[at] <= 0xDB):
        raise CorruptRecordError("map keys must be strings", source=source)


_ENVELOPE_KEYS = ("trainrec", "checksums", "crc")
"""Keys only our header has: a map holding one is a damaged record, not a plain flax file."""


def parse(data: Any, source: str) -> tuple[Header, Item]:
    """Header and item of a flax-convention msgpack payload (ours or plain flax); tensors
    view `data`."""
    decoded = decode_msgpack(data, source)
    doc: dict[str, Any] = decoded if isinstance(decoded, dict) else {}
    ours = isinstance(decoded, dict) and doc.get("format") == FORMAT
    if ours:
        header = parse_header(doc, FORMAT, VERSION[0], source)
        view = memoryview(data)
        if list(doc)[-1] != "crc" or bytes(view[-FILE_CRC_BYTES - 5 : -FILE_CRC_BYTES]) != b"\xa3crc\xce":
            raise CorruptRecordError("the file checksum is missing", source=source, key="crc")
        check_file_crc(crc32(view[:-FILE_CRC_BYTES]),
                       int.from_bytes(view[-FILE_CRC_BYTES:], "big"), source)
        body, checksums = doc.get("item"), doc.get("checksums")
    elif isinstance(decoded, dict):  # a plain flax file: a state dict, no header, no checksums
        if any(k in doc for k in _ENVELOPE_KEYS) or str(doc.get("format", "")).startswith("trainrec"):
            raise CorruptRecordError("a trainrec flax record with a damaged header", source=source)
        header = Header("flax.msgpack", (0, 0), "", NativePrecisionSettings(), "Item")
        body, checksums = doc, None
    else:
        raise CorruptRecordError("neither a trainrec record nor a flax state dict (a map)",
                                 source=source)
    item = _convert(body, "", source, 0)
    if ours:
        # every byte is covered by the file checksum, tensors' included: the table is
        # only matched against the tensors, not recomputed
        verify_checksums(item, checksums, source, recompute=False)
        item = restore_dtypes(item, doc.get("dtypes"), source)
    return header, item


_PAYLOAD_LIMITS = Limits(max_depth=3, max_str_bytes=64, object_bytes=1 << 14, object_bytes_per_byte=0)


def _decode_array(ext: Ext, source: str, key: str) -> np.ndarray[Any, Any]:
    def fail(msg: str) -> CorruptRecordError:
        return CorruptRecordError(msg, source=source, key=key)

    if ext.code not in (1, 3):
        raise fail(f"msgpack ext type {ext.code} is not supported")
    try:
        tpl = decode_msgpack(ext.data, source, limits=_PAYLOAD_LIMITS)
    except CorruptRecordError as e:
        raise fail(f"malformed array payload: {e}") from None
    # flax packs a numpy scalar (ext 3) as the 0-d array `np.asarray(x)`: the same
    # (shape, dtype name, bytes) payload as an ndarray (ext 1), with shape ()
    if not (isinstance(tpl, list) and len(tpl) == 3):
        raise fail("malformed numpy scalar" if ext.code == 3 else "malformed array payload")
    shape, name, raw = tpl
    if ext.code == 3 and shape != []:
        raise fail(f"malformed numpy scalar (shape {shape!r}, not ())")
    if not isinstance(name, str) or name not in _NAMES:
        raise fail(f"unsupported dtype {name!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape) \
            or not isinstance(raw, memoryview) or len(shape) > 32:
        raise fail("malformed array shape or data")
    dtype = _NAMES[name]
    count = math.prod(shape)
    if count * dtype.itemsize != raw.nbytes:
        raise fail(f"{name} array of shape {shape} needs {count * dtype.itemsize} bytes, has {raw.nbytes}")
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
        raise fail(f"shape {shape} is larger than any array can be")
    return np.frombuffer(raw, dtype=dtype.numpy).reshape(shape)


def _convert(node: Any, key: str, source: str, depth: int) -> Item:
    if depth > 64:
        raise CorruptRecordError("nesting deeper than 64", source=source, key=key)
    if isinstance(node, Ext):
        return TensorData.from_array(_decode_array(node, source, key), copy=False)
    if isinstance(node, dict):
        if node.get(_CHUNKED) is True:
            return TensorData.from_array(_unchunk(node, source, key), copy=False)
        if not all(isinstance(k, str) for k in node):
            raise CorruptRecordError("map keys must be strings", source=source, key=key)
        return {k: _convert(v, join_key(key, k), source, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [_convert(v, join_key(key, i), source, depth + 1) for i, v in enumerate(node)]
    if isinstance(node, memoryview):
        return node.tobytes()
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise CorruptRecordError(f"{type(node).__name__} is not an item", source=source, key=key)


def _unchunk(node: dict[str, Any], source: str, key: str) -> np.ndarray[Any, Any]:
    shape_d, chunks_d = node.get("shape"), node.get("chunks")
    if not isinstance(shape_d, dict) or not isinstance(chunks_d, dict):
        raise CorruptRecordError("malformed chunked array", source=source, key=key)
    try:
        shape = [shape_d[str(i)] for i in range(len(shape_d))]
        chunks = [chunks_d[str(i)] for i in range(len(chunks_d))]
    except KeyError:
        raise CorruptRecordError("malformed chunked array", source=source, key=key) from None
    if not all(isinstance(c, Ext) for c in chunks) or not chunks:
        raise CorruptRecordError("malformed chunked array", source=source, key=key)
    flat = np.concatenate([_decode_array(c, source, key).reshape(-1) for c in chunks])
    try:
        return flat.reshape(shape)
    except (ValueError, TypeError):
        raise CorruptRecordError("chunked array does not fit its shape", source=source, key=key) from None
