"""The NamedMpk format: one msgpack document, aligned tensor payloads, checksums.

`spec/FORMAT.md` is the normative description; this module implements it. Writing
streams every tensor straight from its buffer (peak extra memory: one converted
tensor). Reading walks the document with a bounds-checked parser over a buffer (bytes,
a read buffer or a read-only mmap): every declared length is checked against the
limits and the bytes that remain before anything is allocated, and tensors become
zero-copy numpy views into that buffer.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from .._version import __version__
from ..errors import (
    HINT_BYTES,
    ChecksumError,
    CorruptRecordError,
    UnsupportedVersionError,
    format_hint,
)
from ..items.checksum import crc32, crc_text
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import TENSOR_KEY, Item, check_item, join_key, path_of, walk
from ..precision import (
    Precision,
    PrecisionSettings,
    restorable,
    restore_tensor,
    settings_by_name,
    store_tensor,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ALIGNMENT",
    "Header",
    "write_document",
    "document_size_bound",
    "document_size_estimate",
    "read_document",
    "Limits",
    "check_limits",
    "check_magic",
    "decode_msgpack",
    "Ext",
]

FORMAT_NAME = "trainrec.namedmpk"
FORMAT_VERSION = (1, 1)
ALIGNMENT = 64
CHUNK_BYTES = 2**31
"""Payloads longer than this are written as an array of `bin` chunks (bin32 holds < 4 GiB)."""
MIN_CHUNK_BYTES = 1 << 20
"""Readers refuse a chunked payload whose chunks but the last hold fewer bytes, or whose last
chunk is empty (writers cut at `CHUNK_BYTES`)."""


@dataclass(frozen=True)
class Header:
    """What a NamedMpk file says about itself, checked before the item is read."""

    format: str
    version: tuple[int, int]
    trainrec_version: str
    settings: Precision
    record_type: str


@dataclass(frozen=True)
class Limits:
    """Bounds the reader enforces before allocating (see spec/FORMAT.md, "Limits"). The
    writer enforces the same ones, so nothing that saves fails to load."""

    max_header_bytes: int = 1 << 20
    max_depth: int = 64
    max_str_bytes: int = 16 << 20
    max_dims: int = 32
    object_bytes: int = 16 << 20
    """The object budget: decoded values (containers, scalars, tensor objects: their
    CPython size as `_cost` estimates it) may take this many bytes ..."""
    object_bytes_per_byte: int = 8
    """... plus this many per byte of the document. A document that needs more is refused
    as soon as it does, so a load's memory and time stay proportional to its size."""

    def object_budget(self, size: int) -> int:
        """The object budget of a document of `size` bytes."""
        return self.object_bytes + self.object_bytes_per_byte * size


def check_limits(
    item: Item, limits: Limits | None = None, *, depth: int = 1, tensor_depth: int = 2,
    source: str = "",
) -> None:
    """Raise `CorruptRecordError` naming the key when a reader bounded by `limits` would
    refuse `item`: nesting deeper than `max_depth`, a str (value or map key) longer than
    `max_str_bytes` in UTF-8, a tensor of more than `max_dims` dimensions.

    How deep a value sits is the format's: `depth` is the level of `item` itself
    (NamedMpk: 1, under the top-level map) and a tensor with a non-empty shape takes
    `tensor_depth` levels below its own (NamedMpk: its map's fields, then the shape's
    elements; a 0-d tensor one fewer). `check_item(item)` must have passed."""
    lim = limits or Limits()

    def fail(message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(f"{message}: it would save but never load", source=source, key=key)

    def too_long(s: str) -> str:
        if len(s) > lim.max_str_bytes // 4 and len(s.encode("utf-8")) > lim.max_str_bytes:
            return (f"string of {len(s.encode('utf-8'))} bytes is longer than readers accept "
                    f"(Limits.max_str_bytes = {lim.max_str_bytes})")
        return ""

    for _, node, below in walk(item, paths=False):
        level = depth + below
        if isinstance(node, TensorData):
            level += tensor_depth if node.shape else max(0, tensor_depth - 1)
        if level > lim.max_depth:
            problem = (f"nested {level} levels deep, more than readers accept "
                       f"(Limits.max_depth = {lim.max_depth})")
        elif isinstance(node, TensorData):
            if len(node.shape) <= lim.max_dims:
                continue
            problem = (f"tensor of {len(node.shape)} dimensions, more than readers accept "
                       f"(Limits.max_dims = {lim.max_dims})")
        elif isinstance(node, str):
            problem = too_long(node)
        elif isinstance(node, dict):
            problem = next(filter(None, map(too_long, node)), "")
        else:
            continue
        if problem:
            raise fail(problem, path_of(item, node, below))


class _Sink(Protocol):
    def write(self, data: Any, /) -> Any: ...


# -- writing ------------------------------------------------------------------------------


class _Writer:
    """Writes a document to `out`. `dry`: writes only the structure, with every checksum
    at its longest encoding and payloads counted, never read, so `pos` ends at an upper
    bound of the real document's size (alignment padding only shrinks with shorter
    checksums). Each tensor is stored as `store_tensor` says (checked unless
    `allow_lossy`; `recorder` is named in the error)."""

    def __init__(
        self, out: _Sink, settings: PrecisionSettings, dry: bool = False, *,
        allow_lossy: bool = False, recorder: str = "NamedMpkFileRecorder",
    ) -> None:
        self._out = out
        self._settings = settings
        self._allow_lossy = allow_lossy
        self._recorder = recorder
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        self._dry = dry
        self.pos = 0
        self._crc = 0
        self._pending = bytearray()
        """Structure bytes not yet written: written (and checksummed) in one call before
        the next payload, so a tensor's dozen small values cost one write, not twelve."""
        self.cost = 0
        """What the reader will charge to its object budget for the values written so far."""
        self._strs: set[str] = set()

    @property
    def crc(self) -> int:
        """The running checksum of the structure bytes written so far."""
        self.flush()
        return self._crc

    @crc.setter
    def crc(self, value: int) -> None:
        self.flush()
        self._crc = value

    def flush(self) -> None:
        """Write the pending structure bytes."""
        if self._pending:
            if not self._dry:  # a dry run counts bytes only; its checksums are never used
                self._out.write(self._pending)
                self._crc = crc32(self._pending, self._crc)
            self._pending = bytearray()  # a new one: `out` may still hold a view of the old

    def charge(self, v: object) -> None:
        """Add the object-budget cost the reader charges for plain value `v`."""
        if isinstance(v, str):
            if v in self._strs:
                return
            n = len(v) if v.isascii() else len(v.encode("utf-8"))
            if n <= _SHARED_STR_BYTES:
                self._strs.add(v)
            self.cost += _str_cost(n)
        elif isinstance(v, bool) or v is None:
            return
        elif isinstance(v, int):
            self.cost += 0 if -32 <= v <= 127 else _NUMBER_COST
        elif isinstance(v, float):
            self.cost += _NUMBER_COST
        elif isinstance(v, bytes):
            self.cost += _bytes_cost(len(v))
        elif isinstance(v, (list, tuple)):
            self.cost += _list_cost(len(v))
            for x in v:
                self.charge(x)
        elif isinstance(v, dict):
            self.cost += _dict_cost(len(v))
            for k, x in v.items():
                self.charge(k)
                self.charge(x)

    def raw(self, data: bytes) -> None:
        """Structure bytes: counted into the running structure checksum."""
        self._pending += data
        self.pos += len(data)

    def value(self, v: object) -> None:
        packed = _PACKED.get(v) if v.__class__ is str else None
        self.raw(packed or self._packer.pack(v))
        self.charge(v)

    def checksum(self, crc: int) -> None:
        self.value(_LONGEST_CRC if self._dry else crc)

    def item(self, item: Item, key: str = "") -> None:
        if isinstance(item, TensorData):
            target = self._settings.target(item.dtype)
            saved = None if target is item.dtype else item.dtype
            if self._dry:
                self.tensor(target, item.shape, None, saved)
            else:
                t = store_tensor(item, self._settings, key=key, allow_lossy=self._allow_lossy,
                                 recorder=self._recorder)
                self.tensor(t.dtype, t.shape, t.read().reshape(-1).view(np.uint8), saved)
        elif isinstance(item, dict):
            self.raw(self._packer.pack_map_header(len(item)))
            self.cost += _dict_cost(len(item))
            for k, v in item.items():
                self.value(k)
                self.item(v, join_key(key, k))
        elif isinstance(item, list):
            self.raw(self._packer.pack_array_header(len(item)))
            self.cost += _list_cost(len(item))
            for i, v in enumerate(item):
                self.item(v, join_key(key, i))
        else:
            self.value(item)

    def tensor(
        self, dtype: DType, shape: tuple[int, ...], flat: np.ndarray[Any, Any] | None,
        saved: DType | None = None,
    ) -> None:
        n = math.prod(shape) * dtype.itemsize if flat is None else flat.nbytes
        # the map's fields up to its payload, packed and charged as `value` would, one
        # by one, but in one piece: small checkpoints are mostly this per-tensor work
        # (a checkpoint saved again and again has the same shapes: they are packed once)
        known = _HEADS.get((dtype, saved, shape))
        if known is None:
            known = _HEADS[(dtype, saved, shape)] = _tensor_head(dtype, saved, shape)
            if len(_HEADS) > _MAX_HEADS:
                _HEADS.clear()
        start, names, dims_cost = known
        for name in names:
            if name not in self._strs:
                self.charge(name)
        self.cost += dims_cost
        chunks = [(i, min(n, i + CHUNK_BYTES)) for i in range(0, n, CHUNK_BYTES)] or [(0, 0)]
        tail = _PACKED["data"]
        if n > CHUNK_BYTES:
            tail += self._packer.pack_array_header(len(chunks))
        tail += _bin32_header(chunks[0][1] - chunks[0][0])
        pad_len = (-(self.pos + len(start) + 2 + len(tail))) % ALIGNMENT
        self.cost += _dict_cost(5 if saved is None else 6) + _tensor_cost(len(shape))
        self.cost += _bytes_cost(ALIGNMENT - 1 if self._dry else pad_len)
        self.cost += _list_cost(len(chunks)) if n > CHUNK_BYTES else 0
        self.raw(start + _PAD[pad_len] + tail)
        if flat is None:
            self.pos += n + 5 * (len(chunks) - 1)
            self.value("crc")
            self.checksum(0)
            return
        views = [flat[a:b].data for a, b in chunks]
        self.flush()
        # the checksum runs on a worker thread while this one writes (both release the GIL)
        pending = _crc_pool().submit(_crc_all, views) if n >= _PARALLEL_CRC_BYTES else None
        for i, view in enumerate(views):
            if i:
                self.raw(_bin32_header(view.nbytes))
                self.flush()
            self._out.write(view)
            self.pos += view.nbytes
        crc = pending.result() if pending is not None else _crc_all(views)
        self.value("crc")
        self.checksum(crc)


def _tensor_head(
    dtype: DType, saved: DType | None, shape: tuple[int, ...]
) -> tuple[bytes, tuple[str, ...], int]:
    """A tensor map's fields up to its `pad` key, packed; the strings among them; and the
    object-budget cost of its shape list (what `_Writer.charge` adds for it)."""
    head = [_MAP_HEADER[saved is None], _PACKED[TENSOR_KEY], _PACKED[dtype.value]]
    names = [TENSOR_KEY, dtype.value, "shape", "pad", "data"]
    if saved is not None:
        head += [_PACKED["dtype"], _PACKED[saved.value]]
        names += ["dtype", saved.value]
    head += [_PACKED["shape"], msgpack.packb(list(shape)), _PACKED["pad"]]
    dims_cost = _list_cost(len(shape)) + sum(0 if -32 <= d <= 127 else _NUMBER_COST for d in shape)
    return b"".join(head), tuple(names), dims_cost


_HEADS: dict[tuple[DType, DType | None, tuple[int, ...]], tuple[bytes, tuple[str, ...], int]] = {}
"""`_tensor_head` by dtype, saved dtype and shape."""
_MAX_HEADS = 4096

_LONGEST_CRC = 0xFFFFFFFF
_PACKED = {k: msgpack.packb(k) for k in (TENSOR_KEY, "dtype", "shape", "pad", "data", "crc",
                                         *(d.value for d in DType))}
"""The strings every tensor map holds, packed once."""
_MAP_HEADER = {True: b"\x85", False: b"\x86"}
"""A tensor map's header: 5 fields, or 6 with the saved dtype (`saved is None` -> 5)."""
_PAD = [b"\xc4" + bytes([n]) + bytes(n) for n in range(ALIGNMENT)]
"""The `pad` bin of each length."""


class _Counter:
    def write(self, data: Any, /) -> int:
        return memoryview(data).nbytes


_PARALLEL_CRC_BYTES = 1 << 20
_PARALLEL_VERIFY_BYTES = 8 << 20
_VERIFY_THREADS = min(4, os.cpu_count() or 1)


def _verify_pool() -> ThreadPoolExecutor:
    return _pool("verify", _VERIFY_THREADS)
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's thread pool `name`: a forked child (a DataLoader worker, a
    multiprocessing fork) gets its own, since the parent's threads do not exist there."""
    known = _POOLS.get(name)
    if known is None or known[0] != os.getpid():
        known = _POOLS[name] = (os.getpid(), ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"trainrec-{name}"))
    return known[1]


def _crc_pool() -> ThreadPoolExecutor:
    return _pool("crc", 1)


def _crc_all(views: list[memoryview]) -> int:
    crc = 0
    for v in views:
        crc = crc32(v, crc)
    return crc


def _bin32_header(n: int) -> bytes:
    return b"\xc6" + n.to_bytes(4, "big")


def write_document(
    out: _Sink, item: Item, settings: PrecisionSettings, record_type: str, *,
    allow_lossy: bool = False, recorder: str = "NamedMpkFileRecorder",
    limits: Limits | None = None,
) -> None:
    """Write `item` as one NamedMpk document to `out`, converting each tensor as
    `settings` say while it is written. Raises `CorruptRecordError` for a malformed item
    before anything is written, also for one a reader bounded by `limits` would refuse
    (see `check_limits`), and `LossyPrecisionError` (naming the tensor and `recorder`)
    when `settings` would change a value, unless `allow_lossy`."""
    check_item(item)
    check_limits(item, limits)
    _write(_Writer(out, settings, allow_lossy=allow_lossy, recorder=recorder), item, settings,
           record_type, limits or Limits())


def document_size_bound(
    item: Item, settings: PrecisionSettings, record_type: str, limits: Limits | None = None
) -> int:
    """An upper bound of the size of the document `write_document` writes for `item`,
    computed without reading or converting any tensor. It is exact but for checksums,
    counted at their longest msgpack encoding (5 bytes). Raises as `write_document` does
    for an item it would refuse."""
    check_item(item)
    check_limits(item, limits)
    w = _Writer(_Counter(), settings, dry=True)
    _write(w, item, settings, record_type, limits or Limits())
    return w.pos


def document_size_estimate(item: Item, settings: PrecisionSettings) -> int:
    """About the size of the document `write_document` writes for `item`, in one cheap
    walk (no packing): each tensor's stored payload plus a fixed allowance for its map
    and padding, plus the other values' and keys' lengths. For reserving disk blocks
    before a save: it may miss by a few bytes per value either way (the writes then
    allocate the rest, and a save frees what it reserved and did not use);
    `document_size_bound` is the exact bound, at the price of a dry run of the writer."""
    total = 512  # the header
    for _path, node, _depth in walk(item, paths=False):
        if isinstance(node, TensorData):
            n = math.prod(node.shape) * settings.target(node.dtype).itemsize
            total += n + ALIGNMENT + 64 + 9 * len(node.shape) + 5 * (n // CHUNK_BYTES)
        elif isinstance(node, (str, bytes)):
            total += len(node) * (3 if isinstance(node, str) else 1) + 5
        elif isinstance(node, dict):
            total += 5 + sum(len(k) * 3 + 5 for k in node if isinstance(k, str))
        else:
            total += 9
    return total


def _write(
    w: _Writer, item: Item, settings: PrecisionSettings, record_type: str, limits: Limits
) -> None:
    w.raw(b"\x88")
    w.value("format")
    w.value(FORMAT_NAME)
    w.value("version")
    w.value(list(FORMAT_VERSION))
    w.value("trainrec")
    w.value(__version__)
    w.value("settings")
    w.value(
        {
            "name": settings.name,
            "float": None if settings.float_dtype is None else settings.float_dtype.value,
            "int": None if settings.int_dtype is None else settings.int_dtype.value,
        }
    )
    w.value("record")
    w.value(record_type)
    if w.pos > limits.max_header_bytes:
        raise CorruptRecordError(
            f"header of {w.pos} bytes is longer than readers accept (Limits.max_header_bytes = "
            f"{limits.max_header_bytes}): it would save but never load", key="record")
    header_crc = w.crc
    w.value("header_crc")
    w.checksum(header_crc)
    w.value("item")
    w.crc = 0
    w.item(item)
    item_crc = w.crc
    w.value("item_crc")
    w.checksum(item_crc)
    w.flush()
    budget = Limits().object_budget(w.pos)
    if w.cost > budget:
        raise CorruptRecordError(
            f"the item holds more small objects than a reader allows for a document of "
            f"{w.pos} bytes (object budget {budget} bytes, this item needs {w.cost}; see "
            "Limits.object_bytes): store large sequences of scalars as tensors"
        )


# -- reading ------------------------------------------------------------------------------


# -- the object budget (Limits.object_bytes): what a decoded value costs, estimated as
# CPython's sizes; the writer charges the same amounts for what it writes (`_Writer.cost`),
# so a document that saves also loads.

_SHARED_STR_BYTES = 32
"""The reader decodes a str this short once and shares it; only the first is charged."""
_NUMBER_COST = 28


def _str_cost(n: int) -> int:
    return 49 + n


def _bytes_cost(n: int) -> int:
    return 33 + n


def _list_cost(n: int) -> int:
    return 56 + 8 * n


def _dict_cost(n: int) -> int:
    return 64 + 40 * n


def _tensor_cost(ndim: int) -> int:
    return 256 + 8 * ndim


_EMPTY_DICT_COST = _dict_cost(0)
_VIEW_COST = 256
"""A memoryview and what it is wrapped in (`Ext`)."""


@dataclass(frozen=True)
class Ext:
    """A msgpack ext value from `decode_msgpack`: its type code and a view of its payload."""

    code: int
    data: memoryview


def decode_msgpack(buf: Any, source: str, *, limits: Limits | None = None) -> object:
    """The one msgpack value that fills `buf`, read with the NamedMpk reader's bounds
    (`Limits`: every length checked against the bytes that remain, nesting, string size,
    the object budget; str map keys, no duplicates). Bins and ext payloads come back as
    read-only memoryviews of `buf` (ext values as `Ext`), never copied.
    Raises `CorruptRecordError` naming `source`."""
    p = _Parser(memoryview(buf).toreadonly(), source, limits or Limits(), plain=True)
    if not p.end:
        raise p.fail("empty payload", "")
    v = p.value("", 1)
    if p.pos != p.end:
        raise p.fail(f"{p.end - p.pos} bytes of trailing data after the document", "")
    return v


class _Span:
    __slots__ = ("length", "offset")

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length


class _Parser:
    def __init__(
        self, buf: Any, source: str, limits: Limits, eager: bool = False,
        plain: bool = False, owned: bool = False,
    ) -> None:
        self.buf = buf
        self.owned = owned
        """`buf` is the reader's own (see `read_document`): tensors are marked private."""
        self.mv = memoryview(buf).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.source = source
        self.limits = limits
        self.spans: list[_Span] = []
        self.avail = self.end
        self.unverified: list[tuple[list[_Span], int, str]] = []
        """The eager parse's tensors whose checksums `verify_tensors` has still to check."""
        self.eager = eager
        self.budget = limits.object_budget(self.end)
        self.plain = plain
        """Plain msgpack (`decode_msgpack`): no tensor maps; ext values and bins as views."""
        self.strs: dict[bytes, str] = {}
        self.stop = self.end
        """No value may extend past this offset (the header limit while the header is read)."""

    def fail(self, message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(message, source=self.source, key=key)

    def need(self, upto: int, key: str) -> None:
        if upto > self.avail:
            raise self.fail(f"the source ended after {self.avail} of {self.end} bytes", key)

    def charge(self, cost: int, key: str) -> None:
        """Spend `cost` bytes of the object budget; refuse the document once it is spent."""
        self.budget -= cost
        if self.budget < 0:
            raise self.fail(
                f"the document decodes to more objects than its size allows (object budget "
                f"{self.limits.object_budget(self.end)} bytes for {self.end} bytes, see Limits)",
                key,
            )

    def take(self, n: int, key: str) -> int:
        start = self.pos
        if n > self.stop - start:
            if self.stop < self.end:
                raise self.fail(f"header larger than {self.limits.max_header_bytes} bytes", key)
            raise self.fail(
                f"truncated: {n} bytes declared at offset {start}, only {self.end - start} remain",
                key,
            )
        self.need(start + n, key)
        self.pos = start + n
        return start

    def uint(self, n: int, key: str) -> int:
        start = self.take(n, key)
        return int.from_bytes(self.mv[start : start + n], "big")

    def count(self, n: int, per_entry: int, key: str) -> int:
        if n * per_entry > self.end - self.pos:
            raise self.fail(
                f"declared {n} entries at offset {self.pos}, more than the bytes that remain", key
            )
        return n

    def string(self, n: int, key: str) -> str:
        if n > self.limits.max_str_bytes:
            raise self.fail(f"string of {n} bytes exceeds the limit", key)
        start = self.take(n, key)
        raw = bytes(self.mv[start : start + n])
        if n <= _SHARED_STR_BYTES:
            s = self.strs.get(raw)
            if s is not None:
                return s  # keys repeat in every tensor map and state dict: one object each
        self.charge(_str_cost(n), key)
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("string is not valid UTF-8", key) from None
        if n <= _SHARED_STR_BYTES:
            self.strs[raw] = s
        return s

    def value(self, key: str, depth: int, spans: bool = False) -> object:
        """One msgpack value; tensor maps come back as `TensorData`, bins as bytes (as
        `_Span`s, uncopied, when `spans`: tensor payloads)."""
        if depth > self.limits.max_depth:
            raise self.fail(f"nesting deeper than {self.limits.max_depth}", key)
        b = self.mv[self.take(1, key)]
        if b <= 0x7F:
            return b
        if 0xCA <= b <= 0xD3:
            self.charge(_NUMBER_COST, key)  # a float or an int CPython may not cache
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, key, depth)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, key, depth, spans)
        if 0xA0 <= b <= 0xBF:
            return self.string(b & 0x1F, key)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if b in (0xC4, 0xC5, 0xC6):
            n = self.uint(1 << (b - 0xC4), key)
            span = _Span(self.take(n, key), n)
            if spans:
                return span
            if self.plain:
                self.charge(_VIEW_COST, key)
                return self.mv[span.offset : span.offset + n]
            self.charge(_bytes_cost(n), key)
            return self.to_bytes(span)
        if b == 0xCA:
            return float(struct.unpack_from(">f", self.mv, self.take(4, key))[0])
        if b == 0xCB:
            return float(struct.unpack_from(">d", self.mv, self.take(8, key))[0])
        if 0xCC <= b <= 0xCF:
            return self.uint(1 << (b - 0xCC), key)
        if 0xD0 <= b <= 0xD3:
            n = 1 << (b - 0xD0)
            start = self.take(n, key)
            return int.from_bytes(self.mv[start : start + n], "big", signed=True)
        if 0xD9 <= b <= 0xDB:
            return self.string(self.uint(1 << (b - 0xD9), key), key)
        if b in (0xDC, 0xDD):
            return self.array(self.uint(2 if b == 0xDC else 4, key), key, depth, spans)
        if b in (0xDE, 0xDF):
            return self.map(self.uint(2 if b == 0xDE else 4, key), key, depth)
        if self.plain and (0xC7 <= b <= 0xC9 or 0xD4 <= b <= 0xD8):
            n = 1 << (b - 0xD4) if b >= 0xD4 else self.uint(1 << (b - 0xC7), key)
            code = self.uint(1, key)
            start = self.take(n, key)
            self.charge(_VIEW_COST, key)
            return Ext(code - 256 if code > 127 else code, self.mv[start : start + n])
        raise self.fail(f"msgpack type byte 0x{b:02x} is not used by this format", key)

    def array(self, n: int, key: str, depth: int, spans: bool = False) -> list[object]:
        self.count(n, 1, key)
        self.charge(_list_cost(n), key)
        out: list[object] = []
        inline = depth + 1 <= self.limits.max_depth
        if not inline:
            n = min(n, 1)  # the first element fails the depth check
        mv, unpack = self.mv, struct.unpack_from
        ready = min(self.avail, self.stop)
        for i in range(n):
            # the common scalars inline: long lists of numbers are common in caller state
            pos = self.pos
            if inline and pos < ready:
                b = mv[pos]
                if b <= 0x7F:
                    self.pos = pos + 1
                    out.append(b)
                    continue
                if b == 0xCB and pos + 9 <= ready:
                    self.charge(_NUMBER_COST, key)
                    self.pos = pos + 9
                    out.append(unpack(">d", mv, pos + 1)[0])
                    continue
                if b == 0x80:
                    self.budget -= _EMPTY_DICT_COST
                    if self.budget < 0:
                        self.charge(0, key)
                    self.pos = pos + 1
                    out.append({})
                    continue
            out.append(self.value(join_key(key, i), depth + 1, spans))
            if spans and i and isinstance(prev := out[-2], _Span) and prev.length < MIN_CHUNK_BYTES:
                # writers cut at CHUNK_BYTES: a million empty chunks would cost a Python
                # object each, and a load seconds, for a tensor of no bytes
                raise self.fail(f"a tensor payload chunk of {prev.length} bytes before the last "
                                f"(every chunk but the last holds at least {MIN_CHUNK_BYTES})", key)
            ready = min(self.avail, self.stop)
        return out

    def map(self, n: int, key: str, depth: int) -> object:
        self.count(n, 2, key)
        self.charge(_dict_cost(n), key)
        out: dict[str, object] = {}
        if not n:
            return out
        mv, strs = self.mv, self.strs
        inline = depth + 1 <= self.limits.max_depth
        ready = min(self.avail, self.stop)
        for i in range(n):
            # inline: a short key already seen, then an int or an empty map (state dicts)
            pos = self.pos
            k: object = None
            if inline and pos < ready and 0xA0 <= mv[pos] <= 0xBF:
                end = pos + 1 + (mv[pos] & 0x1F)
                if end < ready:
                    k = strs.get(bytes(mv[pos + 1 : end]))
                    if k is not None:
                        self.pos = end
            if k is None:
                k = self.value(key, depth + 1)
                ready = min(self.avail, self.stop)
            if not isinstance(k, str):
                raise self.fail("map keys must be strings", key)
            if k in out:
                raise self.fail(f"duplicate map key {k!r}", key)
            if i == 0 and k == TENSOR_KEY and not self.plain:
                return self.tensor(n, key, depth)
            pos = self.pos
            if inline and pos < ready:
                b = mv[pos]
                if b <= 0x7F:
                    self.pos = pos + 1
                    out[k] = b
                    continue
                if b == 0x80:
                    self.budget -= _EMPTY_DICT_COST
                    if self.budget < 0:
                        self.charge(0, key)
                    self.pos = pos + 1
                    out[k] = {}
                    continue
            out[k] = self.value(join_key(key, k), depth + 1)
            ready = min(self.avail, self.stop)
        return out

    def to_bytes(self, span: _Span) -> bytes:
        return bytes(self.mv[span.offset : span.offset + span.length])

    def tensor(self, n: int, key: str, depth: int) -> TensorData:
        fields: dict[str, object] = {TENSOR_KEY: self.value(key, depth + 1)}
        for _ in range(n - 1):
            k = self.value(key, depth + 1)
            if not isinstance(k, str) or k in fields:
                raise self.fail("malformed tensor map", key)
            fields[k] = self.value(key, depth + 1, spans=k == "data")
        try:
            dtype = DType.from_code(fields[TENSOR_KEY])
            saved = DType.from_code(fields.get("dtype", dtype.value))
        except ValueError:
            raise self.fail(f"unknown dtype {fields[TENSOR_KEY]!r} or {fields.get('dtype')!r}",
                            key) from None
        shape = fields.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > self.limits.max_dims
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise self.fail(f"shape {shape!r} is not a list of non-negative ints", key)
        data = fields.get("data")
        chunks = data if isinstance(data, list) else [data]
        if not chunks or not all(isinstance(c, _Span) for c in chunks):
            raise self.fail("tensor data is not bin or an array of bin", key)
        spans: list[_Span] = [c for c in chunks if isinstance(c, _Span)]
        if len(spans) > 1 and spans[-1].length == 0:
            raise self.fail("a chunked tensor payload whose last chunk is empty", key)
        crc = fields.get("crc")
        if not isinstance(crc, int) or isinstance(crc, bool):
            raise self.fail("tensor has no crc", key)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        if sum(s.length for s in spans) != nbytes:
            raise self.fail(
                f"{dtype.value} tensor of shape {tuple(shape)} needs {nbytes} bytes, "
                f"{sum(s.length for s in spans)} are stored",
                key,
            )
        # numpy refuses such a shape even with a zero dimension
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
            raise self.fail(f"shape {shape!r} is larger than any array can be", key)
        self.charge(_tensor_cost(len(shape)), key)
        self.spans.extend(spans)
        verified = False
        if self.eager:  # checked before `read_document` returns (`verify_tensors`)
            self.unverified.append((spans, crc, key))
            verified = True
        t = TensorData(dtype, tuple(shape), self.loader(dtype, tuple(shape), spans, crc, key, verified),
                       private=self.owned)
        if saved is not dtype:  # stored in another dtype by precision settings (since 1.1)
            if not restorable(dtype, saved):
                raise self.fail(f"a {saved.value} tensor is never stored as {dtype.value}", key)
            stored = t
            t = TensorData(saved, stored.shape, lambda: restore_tensor(stored, saved).read(),
                           private=self.owned)
        if self.eager:
            t.array  # noqa: B018 - materialize the (verified) view
        return t

    def verify_tensors(self) -> None:
        """Check the checksums of the tensors an eager parse has read, on up to
        `_VERIFY_THREADS` threads when they hold more than `_PARALLEL_VERIFY_BYTES`
        (crc32 releases the GIL); the first mismatch in document order raises."""
        jobs, self.unverified = self.unverified, []
        total = sum(s.length for spans, _, _ in jobs for s in spans)
        if total < _PARALLEL_VERIFY_BYTES or len(jobs) < 2 or _VERIFY_THREADS < 2:
            for job in jobs:
                self.check_crc(*job)
            return
        sums = list(_verify_pool().map(self.crc_of, [spans for spans, _, _ in jobs]))
        for (spans, crc, key), got in zip(jobs, sums):
            self.check_crc(spans, crc, key, got)

    def crc_of(self, spans: list[_Span]) -> int:
        got = 0
        for s in spans:
            got = crc32(self.mv[s.offset : s.offset + s.length], got)
        return got

    def check_crc(self, spans: list[_Span], crc: int, key: str, got: int | None = None) -> None:
        if got is None:
            got = self.crc_of(spans)
        if got != crc:
            raise ChecksumError(
                f"tensor checksum mismatch (stored {crc:#010x}, computed {got:#010x})",
                source=self.source,
                key=key,
            )

    def loader(
        self, dtype: DType, shape: tuple[int, ...], spans: list[_Span], crc: int, key: str,
        verified: bool,
    ) -> Callable[[], np.ndarray[Any, Any]]:
        buf, mv, source = self.buf, self.mv, self.source
        count = 1
        for d in shape:
            count *= d

        def load() -> np.ndarray[Any, Any]:
            got = crc
            if not verified:
                got = 0
                for s in spans:
                    got = crc32(mv[s.offset : s.offset + s.length], got)
            if got != crc:
                raise ChecksumError(
                    f"tensor checksum mismatch (stored {crc:#010x}, computed {got:#010x})",
                    source=source,
                    key=key,
                )
            if len(spans) == 1:
                arr = np.frombuffer(buf, dtype=dtype.numpy, count=count, offset=spans[0].offset)
            else:
                raw = np.empty(count * dtype.itemsize, np.uint8)
                at = 0
                for s in spans:
                    raw[at : at + s.length] = np.frombuffer(mv, np.uint8, s.length, s.offset)
                    at += s.length
                arr = raw.view(dtype.numpy)
            return arr.reshape(shape)

        return load

    def structure_crc(self, start: int, end: int) -> int:
        crc, at = 0, start
        for s in self.spans:
            crc = crc32(self.mv[at : s.offset], crc)
            at = s.offset + s.length
        return crc32(self.mv[at:end], crc)


def read_document(
    buf: Any, source: str, *, lazy: bool = False, limits: Limits | None = None,
    owned: bool = False,
) -> tuple[Header, Item]:
    """Parse a NamedMpk document held in `buf` (bytes, bytearray, numpy buffer or mmap).

    Checks the magic, version and header checksum before reading the item, then the
    structure checksum; with `lazy=False` also every tensor checksum. Tensors view `buf`.
    `owned=True`: `buf` is writable memory the caller allocated for this read alone and
    will not touch again, so `TensorData.take` may hand its tensors out without copying.
    Raises `CorruptRecordError` (or `ChecksumError`) and `UnsupportedVersionError`.
    """
    p = _Parser(buf, source, limits or Limits(), eager=not lazy, owned=owned)
    header = _read_header(p)
    k = p.value("", 1)
    if k != "item":
        raise p.fail(f"expected key 'item' after the header, found {k!r}", "")
    item_start = p.pos
    item: Item = p.value("item", 1)  # type: ignore[assignment]
    item_end = p.pos
    if p.value("", 1) != "item_crc":
        raise p.fail("expected key 'item_crc' after the item", "")
    stored = p.value("item_crc", 1)
    if p.pos != p.end:
        raise p.fail(f"{p.end - p.pos} bytes of trailing data after the document", "")
    computed = p.structure_crc(item_start, item_end)
    if stored != computed:
        raise ChecksumError(
            f"structure checksum mismatch (stored {crc_text(stored)}, computed {computed:#010x})",
            source=source,
            key="item",
        )
    p.verify_tensors()
    return header, item  # eager: the parser has read (and verified) every tensor


def _read_header(p: _Parser) -> Header:
    if not p.end:
        raise p.fail("empty payload", "")
    p.need(1, "")
    first = p.mv[0]
    if not (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)):
        raise p.fail(_wrong_magic(p), "")
    p.stop = min(p.end, p.limits.max_header_bytes)
    b = p.mv[p.take(1, "")]
    n = b & 0x0F if b <= 0x8F else p.uint(2 if b == 0xDE else 4, "")
    fields: dict[str, object] = {}
    for _ in range(n):
        key_start = p.pos
        k = p.value("", 1)
        if not isinstance(k, str):
            raise p.fail("header keys must be strings", "")
        if not fields and (k != "format"):
            raise p.fail(_wrong_magic(p), "")
        if k == "header_crc":
            stored = p.value(k, 1)
            computed = crc32(p.mv[:key_start])
            if stored != computed:
                raise ChecksumError(
                    f"header checksum mismatch (stored {crc_text(stored)}, computed {computed:#010x})",
                    source=p.source,
                    key="header_crc",
                )
            if n != len(fields) + 3:
                raise p.fail("the top-level map must end with header_crc, item, item_crc", "")
            p.stop = p.end
            return _header_from(fields, p)
        fields[k] = p.value(k, 1)
        if k == "format" and fields[k] != FORMAT_NAME:
            raise p.fail(_wrong_magic(p), "format")
        if k == "version":
            _check_version(fields[k], p)
    raise p.fail("header has no header_crc", "")


def _wrong_magic(p: _Parser) -> str:
    head = bytes(p.mv[: min(p.avail, HINT_BYTES)])
    return "not a trainrec NamedMpk document (wrong magic)" + format_hint(head, not_=FORMAT_NAME)
def check_magic(prefix: Any, source: str) -> None:
    """Raise `CorruptRecordError` unless `prefix` (the first bytes of a payload, at least
    64 of them when the payload has that many) starts a NamedMpk document: lets a reader
    refuse another file before it reads or allocates the rest."""
    p = _Parser(prefix, source, Limits())
    try:
        b = p.mv[p.take(1, "")] if p.end else -1
        if not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF)):
            raise p.fail("not a trainrec NamedMpk document (wrong magic)", "")
        if b > 0x8F:
            p.uint(2 if b == 0xDE else 4, "")
        ok = p.value("", 1) == "format" and p.value("", 1) == FORMAT_NAME
    except CorruptRecordError:
        ok = False
    if not ok:
        head = bytes(memoryview(prefix)[:HINT_BYTES])
        raise CorruptRecordError("not a trainrec NamedMpk document (wrong magic)"
                                 + format_hint(head, not_=FORMAT_NAME), source=source)


def _check_version(v: object, p: _Parser) -> None:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
        raise p.fail(f"malformed version {v!r}", "version")
    if v[0] != FORMAT_VERSION[0]:
        raise UnsupportedVersionError(
            f"format version {v[0]}.{v[1]} is not supported by this trainrec, which reads "
            f"version {FORMAT_VERSION[0]}.x (writes {FORMAT_VERSION[0]}.{FORMAT_VERSION[1]})",
            source=p.source,
            key="version",
        )


def _header_from(fields: dict[str, object], p: _Parser) -> Header:
    version = fields.get("version")
    settings = fields.get("settings")
    record = fields.get("record")
    trainrec_version = fields.get("trainrec")
    if not isinstance(version, list):
        raise p.fail("header has no version", "version")
    if not isinstance(record, str) or not isinstance(trainrec_version, str):
        raise p.fail("header lacks record or trainrec version", "record")
    if not isinstance(settings, dict):
        raise p.fail("header has no settings", "settings")
    try:
        name = settings["name"]
        if not isinstance(name, str):
            raise ValueError(name)
        precision = settings_by_name(name, settings.get("float"), settings.get("int"))
    except (KeyError, ValueError, TypeError) as e:
        raise p.fail(f"malformed precision settings ({e})", "settings") from None
    return Header(FORMAT_NAME, (version[0], version[1]), trainrec_version, precision, record)
