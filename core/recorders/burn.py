"""Burn's own record files, read and written with core alone (no Rust, no framework).

Burn (the Rust framework whose `GradientsAccumulator` and `TrainingRecord` trainrec follows)
saves records in four ways (spec/FORMAT.md, "Burn's files", says what each holds):

- **Burnpack** (`.bpk`, Burn >= 0.22): a 10-byte header (`NRUB`, version 1, metadata
  length), CBOR metadata (`trainrec.format.cbor`) describing each tensor's dtype, shape, byte
  range and ParamId, then the tensors, each on a 256-byte boundary;
- **NamedMpk** (`.mpk`, Burn <= 0.21): one msgpack map `{"metadata", "item", "_b"}` with
  the module record under `item`, each parameter `{"id": <ParamId, base32>, "param":
  {"bytes", "shape", "dtype"}}`; **NamedMpk.gz** the same, gzipped;
- **Bin** (`.bin`, Burn <= 0.21): the same record in bincode 2 (`config::standard()`): no
  names, so a template must say the module's structure.

Items (what `trainrec.read_file` returns), every tensor keyed by its module path:

- Burnpack: `{"tensors": {name: tensor}, "param_ids": {name: u64}, "metadata": {str: str},
  "scalars": {name: {"Int"|"UInt"|"Float"|"Bool": value}}, "dtypes": {name: Burn dtype}}`,
  the tensors in the file's data order (Burn's module order); `dtypes` only where the
  Burn dtype is not the plain one of the tensor (`Flex32`, a `Bool` stored as u32);
- NamedMpk, NamedMpk.gz and Bin: `{"metadata": {float, int, format, version, settings},
  "item": <the module record as a tree: structs as maps in field order, Vec as lists,
  constants and None as None, each tensor where its map was>, "param_ids": {module path:
  id text}, "dtypes": {...}}`.

Header: format `burn.burnpack`, `burn.namedmpk`, `burn.namedmpk.gz` or `burn.bin`;
`trainrec_version` is `"burn X.Y.Z"` (Burn's version where the file says it); record type
`burn.Module`, or for a Burnpack `burn.Optimizer` (tensors `"{param_id}.{field}"`,
scalars `"{param_id}.__rank"`) or `burn.Scheduler` (scalars only).

Burn keeps no checksum: a read checks the framing (header, metadata, every declared length,
dtype and byte range against the file) but cannot tell a flipped bit inside a tensor's
bytes; `trainrec verify` says so. Every read is bounded by the file's size (spec/SECURITY.md).
"""

from __future__ import annotations

import base64
import gzip
import math
import mmap as _mmap
import os
import re
import secrets
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .._version import __version__
from ..errors import (
    CorruptRecordError,
    RecorderError,
    RecordMismatchError,
    UnsupportedVersionError,
    reading,
)
from ..format import cbor
from ..format.header import Header
from ..format.limits import Limits
from ..format.parser import Ext, decode_msgpack
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors, join_key
from ..precision import NativePrecisionSettings, Precision, settings_by_name, store_tensor
from .namedmpk import RecorderBase

__all__ = [
    "BURNPACK", "NAMEDMPK", "NAMEDMPK_GZ", "BIN", "MODULE", "OPTIMIZER", "SCHEDULER",
    "BurnpackRecorder", "BurnNamedMpkRecorder", "read_burnpack", "read_namedmpk",
    "read_namedmpk_gz", "read_bin", "param_id_text", "param_id_value", "new_param_id",
    "is_burn_item", "module_tensors", "sniff_burnpack", "sniff_namedmpk", "sniff_bin",
    "sniff_namedmpk_gz", "gz_is_burn", "split_training_item", "register_template_layout",
]

BURNPACK, NAMEDMPK, NAMEDMPK_GZ, BIN = "burn.burnpack", "burn.namedmpk", "burn.namedmpk.gz", "burn.bin"
MODULE, OPTIMIZER, SCHEDULER = "burn.Module", "burn.Optimizer", "burn.Scheduler"

MAGIC = b"NRUB"  # u32 0x4255524E little-endian
BURNPACK_VERSION = 1
HEADER_SIZE = 10
ALIGNMENT = 256
MAX_METADATA = 100 << 20  # Burn's limits (burn_pack::base)
MAX_TENSORS = 100_000
MAX_DIMS = 32
_RANK = "__rank"

# -- dtypes -------------------------------------------------------------------------------------

_PLAIN = {"F64": DType.F64, "F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16,
          "I64": DType.I64, "I32": DType.I32, "I16": DType.I16, "I8": DType.I8,
          "U64": DType.U64, "U32": DType.U32, "U16": DType.U16, "U8": DType.U8}
_NAMES = {d: n for n, d in _PLAIN.items()}
_BIN_DTYPES = ("F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32",
               "U16", "U8", "Bool", "QFloat")
_BOOL_STORES = ("Native", "U8", "U32")


def _dtype(value: Any, key: str, source: str) -> DType:
    """The trainrec dtype of a Burn dtype as serde writes it (`"F32"`, `"Bool"`,
    `{"Bool": "Native"}`); `Flex32` is f32 bytes, a bool stored as u32 a u32 tensor."""
    if isinstance(value, str):
        if value in _PLAIN:
            return _PLAIN[value]
        if value == "Flex32":
            return DType.F32
        if value == "Bool":
            return DType.BOOL
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "Bool" and inner in ("Native", "U8"):
            return DType.BOOL
        if tag == "Bool" and inner == "U32":
            return DType.U32
        if tag == "QFloat":
            raise CorruptRecordError("a quantized (QFloat) tensor: trainrec does not read Burn's "
                                     "quantized layouts", source=source, key=key)
    raise CorruptRecordError(f"unknown Burn dtype {value!r:.80}", source=source, key=key)


def _burn_dtype(d: DType, bool_style: Any) -> Any:
    return bool_style if d is DType.BOOL else _NAMES[d]


def _bool_style(version: str) -> Any:
    """How Burn of `version` names a bool dtype: a unit variant before 0.21, then
    `Bool(BoolStore)`."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < (0, 21):
        return "Bool"
    return {"Bool": "Native"}


# -- ParamIds -------------------------------------------------------------------------------------


def param_id_text(value: int) -> str:
    """A ParamId as Burn <= 0.21 writes it: BASE32_DNSSEC of its 8 little-endian bytes."""
    return base64.b32hexencode(int(value).to_bytes(8, "little")).decode("ascii").rstrip("=").lower()


def param_id_value(text: str) -> int | None:
    """The u64 of a ParamId written as base32 (as Burn's `ParamId::deserialize` reads it:
    up to 8 bytes, little-endian, zero-padded); None for anything else (Burn's legacy UUID
    ids, which it hashes with ahash)."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-v]{2,13}", text):
        return None
    try:
        raw = base64.b32hexdecode(text.upper() + "=" * (-len(text) % 8))
    except (ValueError, TypeError):
        return None
    if len(raw) > 8 or base64.b32hexencode(raw).decode().rstrip("=").lower() != text:
        return None
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


def new_param_id() -> int:
    """A ParamId made as Burn makes one: 64 random bits."""
    return secrets.randbits(64)


# -- sniffing -------------------------------------------------------------------------------------


def sniff_burnpack(head: bytes) -> bool:
    return head[:4] == MAGIC


def sniff_namedmpk(head: bytes) -> bool:
    """rmp_serde's `write_named` of a BurnRecord: a map whose first key is `metadata`,
    itself a map whose first key is `float`."""
    return (len(head) > 17 and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))
            and head[1:10] == b"\xa8metadata" and head[11:17] == b"\xa5float")


def sniff_bin(head: bytes) -> bool:
    """bincode of a BurnRecord: the metadata's float and int type names (short strings
    such as `f32`, `half::binary16::f16`), then a format naming one of Burn's Bin recorders."""
    at = 0
    for _ in range(2):
        n = head[at] if at < len(head) else 0
        name = head[at + 1 : at + 1 + n]
        if not 1 <= n <= 40 or len(name) < n or not re.fullmatch(rb"[a-z0-9_:]+", name):
            return False
        at += 1 + n
    if at >= len(head) or head[at] >= 251:
        return False
    want = b"burn_core::record::file::Bin"
    got = head[at + 1 : at + 1 + len(want)]
    return len(got) >= 12 and want.startswith(got)


def gz_is_burn(head: bytes) -> bool:
    """Whether decompressed bytes `head` start a Burn NamedMpk document."""
    return sniff_namedmpk(head)


def sniff_namedmpk_gz(head: bytes) -> bool:
    """A gzip stream whose first decompressed bytes (what 64 compressed bytes give, often
    none) start a Burn NamedMpk document; `trainrec.namedmpk.gz`'s reader tells the rest
    apart once it has decompressed enough."""
    if head[:2] != b"\x1f\x8b":
        return False
    try:
        out = zlib.decompressobj(wbits=31).decompress(head, 64)
    except zlib.error:
        return False
    return gz_is_burn(out)


# -- reading helpers ------------------------------------------------------------------------------


def _read_all(path: Path, source: str, mmap: bool) -> Any:
    """The file's bytes: mapped (`mmap`), else read into a buffer of its own."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptRecordError("empty file", source=source)
        if mmap:
            return _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
        try:
            buf = np.empty(size, np.uint8)
        except MemoryError:
            raise RecorderError(f"a file of {size} bytes does not fit in memory (read it with "
                                "mmap=True)", source=source) from None
        view, got = buf.data, 0
        while got < size and (n := f.readinto(view[got:])):
            got += n
        if got != size or f.read(1):
            raise CorruptRecordError("file changed size while reading", source=source)
        return buf


def _tensor(buf: Any, offset: int, dtype: DType, shape: tuple[int, ...]) -> TensorData:
    count = math.prod(shape)
    arr = np.frombuffer(buf, dtype=dtype.numpy, count=count, offset=offset).reshape(shape)
    if not arr.flags.aligned:
        arr = arr.copy()  # msgpack and bincode do not align: a view would be unaligned
    return TensorData.from_array(arr, copy=False)


def _check_shape(shape: Any, key: str, source: str) -> tuple[int, ...]:
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)):
        raise CorruptRecordError(f"shape {shape!r:.80} is not a list of at most {MAX_DIMS} sizes",
                                 source=source, key=key)
    if math.prod(max(d, 1) for d in shape) >= 2**62:
        raise CorruptRecordError(f"shape {shape} is larger than any tensor can be", source=source, key=key)
    return tuple(shape)


def _precision(float_name: Any, int_name: Any, settings: Any) -> Precision:
    """Burn's precision settings (its metadata names the element types as Rust does) as
    trainrec's: Full, Half or Double where they are one of those."""
    floats = {"f64": DType.F64, "f32": DType.F32, "half::binary16::f16": DType.F16,
              "half::bfloat::bf16": DType.BF16, "half::binary16::bf16": DType.BF16}
    ints = {"i64": DType.I64, "i32": DType.I32, "i16": DType.I16, "i8": DType.I8}
    f, i = floats.get(float_name), ints.get(int_name)
    for name in ("full", "half", "double"):
        p = settings_by_name(name, None if f is None else f.value, None if i is None else i.value)
        if type(p) is not Precision:  # a built-in one
            return p
    return Precision(str(settings or "burn"), f, i)


def _header(fmt: str, version: tuple[int, int], burn_version: str, settings: Precision,
            record_type: str) -> Header:
    return Header(fmt, version, f"burn {burn_version}" if burn_version else "burn (version not recorded)",
                  settings, record_type)


# -- Burnpack -------------------------------------------------------------------------------------


def _scalar(value: Any, key: str, source: str) -> dict[str, Any]:
    ok = isinstance(value, dict) and len(value) == 1
    if ok:
        (tag, v), = value.items()
        ok = ((tag == "Int" and isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63)
              or (tag == "UInt" and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64)
              or (tag == "Float" and isinstance(v, (int, float)) and not isinstance(v, bool))
              or (tag == "Bool" and isinstance(v, bool)))
    if not ok:
        raise CorruptRecordError(f"a scalar is {{Int|UInt|Float|Bool: value}}, got {value!r:.80}",
                                 source=source, key=key)
    return dict(value)


def _kind(tensors: dict[str, Any], scalars: dict[str, Any]) -> str:
    """Optimizer records name tensors and scalars `{param_id}.{field}`; scheduler records hold
    scalars only."""
    if not tensors and scalars:
        return SCHEDULER
    names = list(tensors) + list(scalars)
    if names and all(re.match(r"\d+\.", n) for n in names) and any(n.endswith("." + _RANK) for n in scalars):
        return OPTIMIZER
    return MODULE


def parse_burnpack(buf: Any, source: str) -> tuple[Header, Item]:
    """Header and item of the Burnpack file held in `buf` (tensors view it)."""
    mv = memoryview(buf).cast("B")
    size = len(mv)
    if size < HEADER_SIZE:
        raise CorruptRecordError(f"a Burnpack header is {HEADER_SIZE} bytes, the file has {size}",
                                 source=source)
    if bytes(mv[:4]) != MAGIC:
        raise CorruptRecordError("not a Burnpack file (wrong magic)", source=source)
    version, meta_size = struct.unpack_from("<HI", mv, 4)
    if version > BURNPACK_VERSION:
        raise UnsupportedVersionError(f"Burnpack version {version}: this trainrec reads version "
                                      f"{BURNPACK_VERSION}", source=source)
    if meta_size > MAX_METADATA:
        raise CorruptRecordError(f"metadata of {meta_size} bytes declared, more than Burn's limit "
                                 f"of {MAX_METADATA}", source=source)
    if HEADER_SIZE + meta_size > size:
        raise CorruptRecordError(f"truncated: {meta_size} bytes of metadata declared, "
                                 f"{size - HEADER_SIZE} remain", source=source)
    doc = cbor.decode(mv[HEADER_SIZE : HEADER_SIZE + meta_size], source)
    if not isinstance(doc, dict) or "tensors" not in doc or not isinstance(doc["tensors"], dict):
        raise CorruptRecordError("the metadata is not a map with `tensors`", source=source)
    unknown = set(doc) - {"tensors", "metadata", "scalars"}
    if unknown:
        raise CorruptRecordError(f"the metadata holds keys this trainrec does not know "
                                 f"({sorted(unknown)!r:.120}): a newer Burnpack?", source=source)
    meta, scalars_in = doc.get("metadata", {}), doc.get("scalars", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError("metadata.metadata is not a map of strings", source=source, key="metadata")
    if not isinstance(scalars_in, dict):
        raise CorruptRecordError("metadata.scalars is not a map", source=source, key="scalars")
    scalars = {k: _scalar(v, f"scalars.{k}", source) for k, v in scalars_in.items()}
    entries = doc["tensors"]
    if len(entries) > MAX_TENSORS:
        raise CorruptRecordError(f"{len(entries)} tensors, more than Burn's limit of {MAX_TENSORS}",
                                 source=source)
    start = -(-(HEADER_SIZE + meta_size) // ALIGNMENT) * ALIGNMENT
    found: list[tuple[int, int, str, DType, tuple[int, ...], Any, Any]] = []
    for name, desc in entries.items():
        key = f"tensors.{name}"
        if not isinstance(desc, dict) or not {"dtype", "shape", "data_offsets"} <= set(desc) \
                or set(desc) - {"dtype", "shape", "data_offsets", "param_id"}:
            raise CorruptRecordError("a tensor descriptor is {dtype, shape, data_offsets, param_id?}",
                                     source=source, key=key)
        dtype = _dtype(desc["dtype"], key, source)
        shape = _check_shape(desc["shape"], key, source)
        offsets = desc["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CorruptRecordError(f"data_offsets {offsets!r:.80} is not [start, end)", source=source, key=key)
        lo, hi = offsets
        need = math.prod(shape) * dtype.itemsize
        if hi - lo != need:
            raise CorruptRecordError(f"{dtype.value} tensor of shape {list(shape)} needs {need} bytes, "
                                     f"its data_offsets hold {hi - lo}", source=source, key=key)
        if start + hi > size:
            raise CorruptRecordError(f"truncated: the tensor ends at byte {start + hi}, the file has {size}",
                                     source=source, key=key)
        pid = desc.get("param_id")
        if pid is not None and not (isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**64):
            raise CorruptRecordError(f"param_id {pid!r:.40} is not a u64", source=source, key=key)
        plain = desc["dtype"] == _burn_dtype(dtype, {"Bool": "Native"})
        found.append((lo, hi, name, dtype, shape, pid, None if plain else desc["dtype"]))
    found.sort(key=lambda e: (e[0], e[1], e[2]))
    for a, b in zip(found, found[1:]):
        if b[0] < a[1] and b[1] > b[0]:
            raise CorruptRecordError(f"tensors {a[2]!r} and {b[2]!r} overlap in the data section (Burn's "
                                     "writer never overlaps them)", source=source, key=f"tensors.{b[2]}")
    tensors: dict[str, Item] = {}
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}
    for lo, _, name, dtype, shape, pid, burn_dtype in found:
        tensors[name] = _tensor(buf, start + lo, dtype, shape)
        if pid is not None:
            param_ids[name] = pid
        if burn_dtype is not None:
            dtypes[name] = burn_dtype
    item: dict[str, Item] = {"tensors": tensors, "param_ids": param_ids, "metadata": dict(meta),
                             "scalars": scalars, "dtypes": dtypes}  # type: ignore[dict-item]
    written = " ".join(filter(None, (meta.get("producer", ""), meta.get("version", ""))))
    header = Header(BURNPACK, (version, 0), written or "burn (version not recorded)",
                    NativePrecisionSettings(), _kind(tensors, scalars))
    return header, item


def read_burnpack(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)
    with reading(source):
        return parse_burnpack(_read_all(Path(path), source, mmap), source)


# -- NamedMpk -------------------------------------------------------------------------------------

_META_KEYS = ("float", "int", "format", "version", "settings")


def _is_tensor_map(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"bytes", "shape", "dtype"} \
        and isinstance(node["bytes"], memoryview)


def _from_view(buf: Any, view: memoryview, dtype: DType, shape: tuple[int, ...], key: str,
               source: str) -> TensorData:
    need = math.prod(shape) * dtype.itemsize
    if view.nbytes != need:
        raise CorruptRecordError(f"{dtype.value} tensor of shape {list(shape)} needs {need} bytes, "
                                 f"{view.nbytes} are stored", source=source, key=key)
    arr = np.frombuffer(view, dtype=dtype.numpy, count=math.prod(shape)).reshape(shape)
    if not arr.flags.aligned:
        arr = arr.copy()
    return TensorData.from_array(arr, copy=False)


def parse_namedmpk(buf: Any, source: str, fmt: str = NAMEDMPK) -> tuple[Header, Item]:
    """Header and item of a Burn NamedMpk document held in `buf`."""
    head = bytes(memoryview(buf).cast("B")[:64])
    if not sniff_namedmpk(head):
        raise CorruptRecordError("not a Burn NamedMpk document (a msgpack map starting with "
                                 "`metadata`)", source=source)
    doc = decode_msgpack(buf, source, limits=Limits(max_header_bytes=1 << 20))
    if not isinstance(doc, dict) or not {"metadata", "item"} <= set(doc) or set(doc) - {"metadata", "item", "_b"}:
        raise CorruptRecordError("a Burn record is {metadata, item, _b}", source=source)
    meta = doc["metadata"]
    if not isinstance(meta, dict) or set(meta) != set(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError(f"Burn's metadata is a map of {', '.join(_META_KEYS)} (strings)",
                                 source=source, key="metadata")
    if doc.get("_b", []) != []:
        raise CorruptRecordError("`_b` (Burn's PhantomData) is an empty list", source=source, key="_b")
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}
    style = _bool_style(meta["version"])

    def tensor(node: dict[str, Any], path: str) -> TensorData:
        dtype = _dtype(node["dtype"], path, source)
        if node["dtype"] != _burn_dtype(dtype, style):
            dtypes[path] = node["dtype"]
        return _from_view(buf, node["bytes"], dtype, _check_shape(node["shape"], path, source), path, source)

    def convert(node: Any, path: str) -> Item:
        if isinstance(node, dict):
            if set(node) == {"id", "param"} and _is_tensor_map(node["param"]):
                if not isinstance(node["id"], str):
                    raise CorruptRecordError("a ParamId is a string", source=source, key=path)
                param_ids[path] = node["id"]
                return tensor(node["param"], path)
            if _is_tensor_map(node):
                return tensor(node, path)
            return {k: convert(v, join_key(path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, join_key(path, i)) for i, v in enumerate(node)]
        if isinstance(node, memoryview):
            return node.tobytes()
        if isinstance(node, Ext):
            raise CorruptRecordError("msgpack ext values are not written by Burn", source=source, key=path)
        return node  # type: ignore[no-any-return]

    record = convert(doc["item"], "")
    item: dict[str, Item] = {"metadata": dict(meta), "item": record, "param_ids": param_ids, "dtypes": dtypes}
    settings = _precision(meta["float"], meta["int"], meta["settings"])
    return _header(fmt, (0, 0), meta["version"], settings, MODULE), item


def read_namedmpk(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)
    with reading(source):
        return parse_namedmpk(_read_all(Path(path), source, mmap), source)


_GZ_BYTES = 256 << 20
_GZ_RATIO = 64


def gunzip(path: Path, source: str, check: Callable[[bytes], None] | None = None) -> bytearray:
    """The decompressed content of the gzip file `path`, refused once it grows past 256 MiB
    plus 64 times the compressed size (a decompression bomb costs at most that), and as soon
    as its first 64 bytes fail `check`."""
    d = zlib.decompressobj(wbits=31)
    out = bytearray()
    with open(path, "rb") as f:
        limit = _GZ_BYTES + _GZ_RATIO * os.fstat(f.fileno()).st_size
        checked = check is None
        try:
            while not d.eof:
                chunk = d.unconsumed_tail or f.read(1 << 16)
                if not chunk:
                    raise CorruptRecordError("truncated gzip stream", source=source)
                out += d.decompress(chunk, min(1 << 24 if checked else 64, limit - len(out) + 1))
                if len(out) > limit:
                    raise CorruptRecordError(f"decompresses to more than {limit} bytes", source=source)
                if not checked and len(out) >= 64:
                    assert check is not None
                    check(bytes(out[:64]))
                    checked = True
        except zlib.error as e:
            raise CorruptRecordError(f"not a valid gzip stream: {e}", source=source) from None
        if not checked and check is not None:
            check(bytes(out[:64]))
        if d.unused_data or f.read(1):
            raise CorruptRecordError("trailing data after the gzip stream", source=source)
    return out


def gz_head(path: Path, n: int = 64) -> bytes:
    """The first `n` decompressed bytes of a gzip file (fewer for a shorter or damaged
    stream), reading at most 1 MiB of it."""
    d = zlib.decompressobj(wbits=31)
    out = b""
    with open(path, "rb") as f:
        for _ in range(16):
            chunk = d.unconsumed_tail or f.read(1 << 16)
            if not chunk:
                break
            try:
                out += d.decompress(chunk, n - len(out))
            except zlib.error:
                break
            if len(out) >= n or d.eof:
                break
    return out


def read_namedmpk_gz(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)

    def check(head: bytes) -> None:
        if not gz_is_burn(head):
            raise CorruptRecordError("not a gzip Burn NamedMpk file", source=source)

    with reading(source):
        return parse_namedmpk(gunzip(Path(path), source, check), source, NAMEDMPK_GZ)


# -- Bin ------------------------------------------------------------------------------------------


class _Bin:
    """bincode 2 `config::standard()`: varint integers (< 251 in one byte, then 251/252/253
    for a u16/u32/u64 that follows, little-endian), strings and bytes as a varint length
    and their bytes, `Option` as a 0/1 byte, enums by variant index."""

    def __init__(self, buf: Any, source: str) -> None:
        self.buf = buf
        self.mv = memoryview(buf).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.source = source

    def fail(self, message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(f"{message} (at byte {self.pos})", source=self.source, key=key)

    def take(self, n: int, key: str) -> int:
        if n > self.end - self.pos:
            raise self.fail(f"truncated: {n} bytes declared, {self.end - self.pos} remain", key)
        start = self.pos
        self.pos += n
        return start

    def peek(self) -> int:
        return self.mv[self.pos] if self.pos < self.end else -1

    def varint(self, key: str) -> int:
        b = self.mv[self.take(1, key)]
        if b < 251:
            return int(b)
        if b > 253:
            raise self.fail(f"varint tag {b} (a u128, or invalid)", key)
        n = 1 << (b - 250)
        at = self.take(n, key)
        return int.from_bytes(self.mv[at : at + n], "little")

    def text(self, key: str, limit: int = 1 << 16) -> str:
        n = self.varint(key)
        if n > limit:
            raise self.fail(f"a string of {n} bytes", key)
        at = self.take(n, key)
        try:
            return bytes(self.mv[at : at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8", key) from None

    def fillers(self, allow_some: bool = True, scan: bool = False) -> None:
        """Skip the one-byte records between parameters: `None` and `EmptyRecord` (0), the
        tag of an `Option` that holds something (1); `scan` (no template): any byte below
        10, which also passes over the lengths of short lists (a ParamId has 10 or more
        characters)."""
        while 0 <= self.peek() <= (9 if scan else 1 if allow_some else 0):
            self.pos += 1

    def param(self, key: str, bool_store: bool, scan: bool = False) -> tuple[str, TensorData, Any]:
        self.fillers(scan=scan)
        start = self.pos
        pid = self.text(key, 64)
        if len(pid) < 2 or not re.fullmatch(r"[0-9a-v]+|[0-9a-fA-F-]{36}", pid):
            self.pos = start
            raise self.fail(f"expected a parameter (a ParamId), found {pid[:16]!r}", key)
        n = self.varint(key)
        data = self.take(n, key)
        ndim = self.varint(key)
        if ndim > MAX_DIMS:
            raise self.fail(f"a shape of {ndim} dimensions", key)
        shape = tuple(self.varint(key) for _ in range(ndim))
        _check_shape(list(shape), key, self.source)
        index = self.varint(key)
        if index >= len(_BIN_DTYPES):
            raise self.fail(f"dtype variant {index}", key)
        name: Any = _BIN_DTYPES[index]
        if name == "Bool" and bool_store:
            store = self.varint(key)
            if store >= len(_BOOL_STORES):
                raise self.fail(f"bool store variant {store}", key)
            name = {"Bool": _BOOL_STORES[store]}
        if name == "QFloat":
            raise CorruptRecordError("a quantized (QFloat) tensor: trainrec does not read Burn's "
                                     "quantized layouts", source=self.source, key=key)
        dtype = _dtype(name, key, self.source)
        t = _from_view(self.buf, self.mv[data : data + n], dtype, shape, key, self.source)
        return pid, t, name


def _structure(template: Any) -> Item:
    """The record tree a template gives a Bin file: a Burn NamedMpk or Bin item's `item`, or
    a Burnpack item's tensors nested by their dotted names (numbered segments as lists)."""
    if isinstance(template, (str, os.PathLike)):
        from .read import read_file

        template = read_file(template, mmap=True)
    if isinstance(template, tuple) and len(template) == 2 and isinstance(template[0], Header):
        template = template[1]
    if isinstance(template, dict) and "item" in template and "metadata" in template:
        return template["item"]  # type: ignore[no-any-return]
    if isinstance(template, dict) and isinstance(template.get("tensors"), dict):
        return nest(template["tensors"])
    laid = None
    for layout in _layouts:
        laid = layout(template)
        if laid is not None:
            break  # a record another adapter's form can describe
    if laid is not None:
        return nest(laid["tensors"])  # type: ignore[arg-type]
    raise TypeError("a Bin template is a Burn record (Burnpack, NamedMpk), a path to one, or a "
                    f"record whose parameters a neutral form names; got {type(template).__name__}")


_layouts: list[Callable[[Any], dict[str, Item] | None]] = []


def register_template_layout(layout: Callable[[Any], dict[str, Item] | None]) -> None:
    """Let a Bin template be any record `layout` lays out in Burn's names (a Burnpack-layout
    module item, None for a record it does not describe). The conversion layer, above this
    one, registers its neutral forms' (`trainrec.conversion.burn_neutral.burn_layout`):
    `trainrec/__init__.py` wires it."""
    _layouts.append(layout)


def split_training_item(item: list[Item], source: str) -> tuple[Item, Item | None]:
    """The Burn module item of a TrainingRecord's item and its optimizer item (None where
    the optimizer holds no state): what a Burn recorder writes of it."""
    if len(item) != 5:
        raise CorruptRecordError("a TrainingRecord item is a list of 5", source=source)
    model, optimizer = item[0], item[1]
    if not (isinstance(model, dict) and isinstance(model.get("kind"), str)
            and str(model["kind"]).startswith("burn")):
        kind = model.get("kind") if isinstance(model, dict) else None
        raise CorruptRecordError(f"a Burn file holds a Burn module record, this TrainingRecord's model "
                                 f"is a {kind!r}: convert it first (trainrec convert --to burn)", source=source)
    rest = [i for i, part in enumerate(item[2:4], 2) if part not in (None, {})]
    if rest:
        raise CorruptRecordError("a Burn file holds no scheduler or pending gradients; this record has "
                                 f"{' and '.join({2: 'a scheduler', 3: 'pending gradients'}[i] for i in rest)}",
                                 source=source)
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    held = isinstance(state, dict) and (state.get("tensors") or state.get("scalars"))
    return model["state"], ({k: v for k, v in state.items() if k != "config"} if held and isinstance(state, dict)
                            else None)


def nest(flat: dict[str, Any]) -> Item:
    """Dotted names as a tree: `{"a.0.w": x}` -> `{"a": [{"w": x}]}` (a map whose keys are
    0..n-1 becomes a list), in the order of `flat`."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        node = root
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise CorruptRecordError(f"the names {name!r} and {part!r} collide")
            node = nxt
        if parts[-1] in node:
            raise CorruptRecordError(f"the names collide at {name!r}")
        node[parts[-1]] = value

    def lists(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: lists(v) for k, v in node.items()}
            if out and set(out) == {str(i) for i in range(len(out))}:
                return [out[str(i)] for i in range(len(out))]
            return out
        return node

    return lists(root)  # type: ignore[no-any-return]


def parse_bin(buf: Any, source: str, template: Any = None) -> tuple[Header, Item]:
    p = _Bin(buf, source)
    meta = {k: p.text(f"metadata.{k}") for k in _META_KEYS}
    if "Bin" not in meta["format"]:
        raise CorruptRecordError(f"not a Burn Bin record (its format is {meta['format']!r:.100})", source=source)
    bool_store = _bool_style(meta["version"]) != "Bool"
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}

    def one(path: str, scan: bool = False) -> TensorData:
        pid, t, name = p.param(path, bool_store, scan)
        param_ids[path] = pid
        if name != _burn_dtype(t.dtype, _bool_style(meta["version"])):
            dtypes[path] = name
        return t

    if template is None:
        found: list[Item] = []
        while True:
            p.fillers(scan=True)
            if p.pos >= p.end:
                break
            found.append(one(str(len(found)), scan=True))
        record: Item = found
    else:
        shape_of = _structure(template)

        def walk(node: Any, path: str) -> Item:
            if isinstance(node, TensorData):
                t = one(path)
                if t.shape != node.shape:
                    raise RecordMismatchError(f"the file's tensor has shape {list(t.shape)}, the template's "
                                              f"{list(node.shape)}: the template is of another module",
                                              source=source, key=path)
                return t
            if isinstance(node, dict):
                return {k: walk(v, join_key(path, k)) for k, v in node.items()}
            if isinstance(node, list):
                if not any(True for _ in iter_tensors(node)):
                    return [walk(v, join_key(path, i)) for i, v in enumerate(node)]
                p.fillers(allow_some=len(node) != 1)
                n = p.varint(path)
                if n != len(node):
                    raise RecordMismatchError(f"a list of {n} entries where the template has {len(node)}",
                                              source=source, key=path)
                return [walk(v, join_key(path, i)) for i, v in enumerate(node)]
            return node  # type: ignore[no-any-return]  # a constant: its filler byte is skipped

        record = walk(shape_of, "")
        p.fillers()
        if p.pos != p.end:
            raise CorruptRecordError(f"{p.end - p.pos} bytes after the last parameter the template "
                                     "names: the template is of another module", source=source)
    item: dict[str, Item] = {"metadata": meta, "item": record, "param_ids": param_ids,  # type: ignore[dict-item]
                             "dtypes": dtypes}
    return _header(BIN, (0, 0), meta["version"], _precision(meta["float"], meta["int"], meta["settings"]),
                   MODULE), item


def read_bin(path: str | os.PathLike[str], mmap: bool = False, template: Any = None) -> tuple[Header, Item]:
    """A Burn Bin file. `template` (a Burn record, a path to one, or a record whose parameters
    a neutral form names) supplies the module's structure: tensors keyed by module path;
    without one the tensors come in file order, keyed 0, 1, ... (their module paths are not
    in the file)."""
    source = str(path)
    with reading(source):
        return parse_bin(_read_all(Path(path), source, mmap), source, template)


# -- items ----------------------------------------------------------------------------------------


def is_burn_item(item: Any) -> bool:
    """Whether `item` is laid out as a Burn record of this module (Burnpack or NamedMpk)."""
    return isinstance(item, dict) and (
        (isinstance(item.get("tensors"), dict) and "param_ids" in item)
        or ("item" in item and isinstance(item.get("metadata"), dict) and "param_ids" in item))


def module_tensors(item: Item) -> dict[str, TensorData]:
    """The tensors of a Burn item by module path (`fc1.weight`), in record order."""
    if not isinstance(item, dict):
        raise TypeError(f"a Burn record item is a map, got {type(item).__name__}")
    if isinstance(item.get("tensors"), dict):
        return {k: v for k, v in item["tensors"].items() if isinstance(v, TensorData)}  # type: ignore[union-attr]
    return dict(iter_tensors(item.get("item")))


def _flat(item: Item, source: str) -> tuple[list[tuple[str, TensorData, int | None]], dict[str, str],
                                            dict[str, Any], dict[str, Any]]:
    """(name, tensor, param id) in order, metadata, scalars and Burn dtypes of a Burn item."""
    if not is_burn_item(item):
        raise CorruptRecordError("not a Burn record item (a Burnpack {tensors, param_ids, ...} or a "
                                 "NamedMpk {metadata, item, param_ids})", source=source)
    assert isinstance(item, dict)
    ids = item.get("param_ids") or {}
    dtypes = item.get("dtypes") or {}
    if not isinstance(ids, dict) or not isinstance(dtypes, dict):
        raise CorruptRecordError("param_ids and dtypes are maps", source=source)
    out: list[tuple[str, TensorData, int | None]] = []
    for name, t in module_tensors(item).items():
        pid = ids.get(name)
        if isinstance(pid, str):
            value = param_id_value(pid)
            if value is None:
                raise CorruptRecordError(f"ParamId {pid!r:.40} is not Burn's base32 (a legacy UUID id, "
                                         "which Burn hashes): it has no u64 to write", source=source, key=name)
            pid = value
        if pid is not None and not (isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**64):
            raise CorruptRecordError(f"param_id {pid!r:.40} is not a u64", source=source, key=name)
        out.append((name, t, pid))
    if isinstance(item.get("tensors"), dict):
        meta = item.get("metadata") or {}
        scalars = item.get("scalars") or {}
    else:
        meta = {"format": "burnpack", "producer": "trainrec", "version": __version__}
        scalars = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptRecordError("metadata is a map of strings", source=source, key="metadata")
    if not isinstance(scalars, dict):
        raise CorruptRecordError("scalars is a map", source=source, key="scalars")
    return (out, {str(k): str(v) for k, v in meta.items()},
            {k: _scalar(v, f"scalars.{k}", source) for k, v in scalars.items()}, dict(dtypes))


class BurnpackRecorder(RecorderBase):
    """Burnpack files (`.bpk`) as Burn >= 0.22 writes them. Saves a Burn item (either layout:
    a NamedMpk record becomes a Burnpack of the same tensors and ParamIds), or a
    TrainingRecord whose model is a Burn module record (`trainrec.conversion.burn_neutral`): the module
    at the path and, when its optimizer holds state, the optimizer record beside it at
    `<name>.optim.bpk` (Burn keeps them in separate files). Args: a path; output: the `Path`.
    """

    suffix = ".bpk"

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings or NativePrecisionSettings())  # Burn's dtypes as they are

    def save_item(self, item: Item, args: Any, record_type: str = "Item", *,
                  allow_lossy: bool = False) -> Path | str:
        from ..storage.location import location

        path = location(args)  # a store URL too: uploaded as it is written
        if isinstance(item, list) and record_type == "TrainingRecord":
            model, optimizer = split_training_item(item, str(path))
            if optimizer is not None:
                self.save_item(optimizer, optimizer_path(path), OPTIMIZER, allow_lossy=allow_lossy)
            item = model
        write_burnpack(path, item, self.settings, allow_lossy=allow_lossy, recorder=self.native_name())
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        from ..format.envelope import path_arg
        from ..storage.location import is_url

        if is_url(args):  # read from a private local copy (remote.read_staged)
            from .remote import read_staged

            return read_staged(args, lambda local: read_burnpack(local, False))
        return read_burnpack(path_arg(args), mmap)


def optimizer_path(path: str | os.PathLike[str]) -> Path | str:
    """Where `BurnpackRecorder` puts a TrainingRecord's optimizer: `x.bpk` -> `x.optim.bpk`
    (a store URL's: the URL of that name beside it, a str)."""
    from ..storage.location import is_url

    url = is_url(path)
    folder, _, leaf = str(path).rpartition("/") if url else ("", "", Path(path).name)
    name = leaf[: -len(".bpk")] if leaf.lower().endswith(".bpk") else leaf
    if url:
        return f"{folder}/{name}.optim.bpk"
    return Path(path).with_name(f"{name}.optim.bpk")


def _bin_header(n: int) -> bytes:
    if n < 256:
        return b"\xc4" + bytes([n])
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _stored(t: TensorData, settings: Any, key: str, allow_lossy: bool, recorder: str) -> TensorData:
    return store_tensor(t, settings, key=key, allow_lossy=allow_lossy, recorder=recorder)


def burnpack_layout(item: Item, settings: Any = None, *, allow_lossy: bool = False,
                    recorder: str = "BurnpackRecorder", source: str = "") -> tuple[bytes, list[tuple[int, TensorData]], int]:
    """(header and metadata bytes, (offset, stored tensor) in write order, total size) of
    the Burnpack file of `item`."""
    tensors, meta, scalars, dtypes = _flat(item, source)
    if len(tensors) > MAX_TENSORS:
        raise CorruptRecordError(f"{len(tensors)} tensors, more than Burn reads ({MAX_TENSORS})", source=source)
    s = settings or NativePrecisionSettings()
    placed: list[tuple[int, TensorData]] = []
    descs: dict[str, Any] = {}
    at = 0
    for name, t, pid in tensors:
        stored = _stored(t, s, name, allow_lossy, recorder)
        if len(stored.shape) > MAX_DIMS:
            raise CorruptRecordError(f"a tensor of {len(stored.shape)} dimensions", source=source, key=name)
        at = -(-at // ALIGNMENT) * ALIGNMENT
        given = dtypes.get(name)
        burn = given if given is not None and stored.dtype is t.dtype else _burn_dtype(stored.dtype, {"Bool": "Native"})
        desc: dict[str, Any] = {"dtype": burn, "shape": list(stored.shape), "data_offsets": [at, at + stored.nbytes]}
        if pid is not None:
            desc["param_id"] = pid
        descs[name] = desc
        placed.append((at, stored))
        at += stored.nbytes
    doc: dict[str, Any] = {"tensors": {k: descs[k] for k in sorted(descs)}}
    if meta:
        doc["metadata"] = {k: meta[k] for k in sorted(meta)}
    if scalars:
        doc["scalars"] = {k: scalars[k] for k in sorted(scalars)}
    blob = cbor.encode(doc)
    if len(blob) > MAX_METADATA:
        raise CorruptRecordError(f"metadata of {len(blob)} bytes, more than Burn reads", source=source)
    head = MAGIC + struct.pack("<HI", BURNPACK_VERSION, len(blob)) + blob
    start = -(-len(head) // ALIGNMENT) * ALIGNMENT
    return head + bytes(start - len(head)), placed, start + at


def write_burnpack(path: Path | str, item: Item, settings: Any = None, *, allow_lossy: bool = False,
                   recorder: str = "BurnpackRecorder") -> None:
    """Write `item` as a Burnpack file at `path` (atomically: an existing file survives a
    failed write), or upload it to the store URL `path` as it is written."""
    from ..storage.location import output

    head, placed, total = burnpack_layout(item, settings, allow_lossy=allow_lossy, recorder=recorder,
                                          source=str(path))
    with output(path, size_hint=total) as f:
        f.write(head)
        at = 0
        for offset, t in placed:
            if offset > at:
                f.write(bytes(offset - at))
            f.write(np.ascontiguousarray(t.read()).reshape(-1).view(np.uint8).data)
            at = offset + t.nbytes


class BurnNamedMpkRecorder(RecorderBase):
    """Burn <= 0.21's NamedMpk files (`NamedMpkFileRecorder`; `compress=True`: gzipped, as
    `NamedMpkGzFileRecorder`), byte for byte as rmp_serde's `write_named` writes a record.
    Saves a Burn item of either layout (a Burnpack record is nested by its dotted names;
    a parameter without a ParamId gets a new one, as Burn would give it). Burn's metadata is
    the item's, or for a Burnpack item Burn 0.21's of `FullPrecisionSettings`."""

    suffix = ".mpk"

    def __init__(self, settings: Any = None, *, compress: bool = False) -> None:
        super().__init__(settings or NativePrecisionSettings())  # Burn's dtypes as they are
        self._compress = compress

    def save_item(self, item: Item, args: Any, record_type: str = "Item", *,
                  allow_lossy: bool = False) -> Path | str:
        from ..storage.location import location, output

        path = location(args)  # a store URL too: uploaded as it is written
        if isinstance(item, list) and record_type == "TrainingRecord":
            item = split_training_item(item, str(path))[0]
        meta, record, ids, dtypes = _named_parts(item, str(path))
        style = _bool_style(meta["version"])
        packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        s, name = self.settings, self.native_name()

        def tensor(f: Any, t: TensorData, key: str) -> None:
            stored = _stored(t, s, key, allow_lossy, name)
            given = dtypes.get(key)
            burn = given if given is not None and stored.dtype is t.dtype else _burn_dtype(stored.dtype, style)
            f.write(packer.pack_map_header(3) + packer.pack("bytes") + _bin_header(stored.nbytes))
            f.write(np.ascontiguousarray(stored.read()).reshape(-1).view(np.uint8).data)
            f.write(packer.pack("shape") + packer.pack(list(stored.shape)) + packer.pack("dtype")
                    + packer.pack(burn))

        def write(f: Any, node: Item, key: str) -> None:
            if isinstance(node, TensorData):
                if key in ids:
                    f.write(packer.pack_map_header(2) + packer.pack("id") + packer.pack(ids[key])
                            + packer.pack("param"))
                tensor(f, node, key)
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

        with output(path) as out:
            f: Any = gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) if self._compress else out
            f.write(packer.pack_map_header(3) + packer.pack("metadata") + packer.pack(meta)
                    + packer.pack("item"))
            write(f, record, "")
            f.write(packer.pack("_b") + packer.pack_array_header(0))
            if self._compress:
                f.close()
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        from ..format.envelope import path_arg
        from ..storage.location import is_url

        if is_url(args):  # read from a private local copy (remote.read_staged)
            from .remote import read_staged

            return read_staged(args, lambda local: self.read(local))
        path = path_arg(args)
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        return read_namedmpk_gz(path) if gz else read_namedmpk(path, mmap)


_FULL_META = {"float": "f32", "int": "i32",
              "format": "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::"
                        "FullPrecisionSettings>",
              "version": "0.21.0", "settings": "FullPrecisionSettings"}


def _named_parts(item: Item, source: str) -> tuple[dict[str, str], Item, dict[str, str], dict[str, Any]]:
    if not is_burn_item(item):
        raise CorruptRecordError("not a Burn record item", source=source)
    assert isinstance(item, dict)
    ids_in = item.get("param_ids") or {}
    dtypes = item.get("dtypes") or {}
    if not isinstance(ids_in, dict) or not isinstance(dtypes, dict):
        raise CorruptRecordError("param_ids and dtypes are maps", source=source)
    if "item" in item:
        meta = item["metadata"]
        record = item["item"]
    else:
        meta, record = dict(_FULL_META), nest(module_tensors(item))
    if not isinstance(meta, dict) or set(meta) != set(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError(f"Burn's metadata is a map of {', '.join(_META_KEYS)} (strings)",
                                 source=source, key="metadata")
    ids: dict[str, str] = {}
    for name, _ in iter_tensors(record):
        pid = ids_in.get(name)
        if pid is None and "item" not in item:
            pid = new_param_id()
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = param_id_text(pid)
        if pid is not None:
            if not isinstance(pid, str):
                raise CorruptRecordError(f"a ParamId is a string or a u64, got {pid!r:.40}", source=source, key=name)
            ids[name] = pid
    return {k: str(meta[k]) for k in _META_KEYS}, record, ids, dict(dtypes)


def tensors_in_order(item: Item) -> Iterator[tuple[str, TensorData]]:
    """The tensors of a Burn item by module path, in record order."""
    return iter(module_tensors(item).items())
