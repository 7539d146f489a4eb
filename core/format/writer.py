"""Writing a NamedMpk document: every tensor streamed straight from its buffer (peak extra
memory: one converted tensor), aligned, with its checksum; the size bounds a save reserves."""

from __future__ import annotations

import math
from typing import Any, Protocol

import msgpack
import numpy as np

from .._version import __version__
from ..errors import (
    CorruptRecordError,
)
from ..items.checksum import crc32
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import TENSOR_KEY, Item, check_item, join_key, walk
from ..precision import (
    PrecisionSettings,
    store_tensor,
)
from . import header as _header
from . import limits as _limits
from .checksums import _PARALLEL_CRC_BYTES, _crc_all, _crc_pool
from .header import FORMAT_NAME
from .limits import (
    _NUMBER_COST,
    _SHARED_STR_BYTES,
    ALIGNMENT,
    Limits,
    _bytes_cost,
    _dict_cost,
    _list_cost,
    _str_cost,
    _tensor_cost,
    check_limits,
)

__all__ = ["write_document", "document_size_bound", "document_size_estimate"]

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
        chunks = [(i, min(n, i + _limits.CHUNK_BYTES)) for i in range(0, n, _limits.CHUNK_BYTES)] or [(0, 0)]
        tail = _PACKED["data"]
        if n > _limits.CHUNK_BYTES:
            tail += self._packer.pack_array_header(len(chunks))
        tail += _bin32_header(chunks[0][1] - chunks[0][0])
        pad_len = (-(self.pos + len(start) + 2 + len(tail))) % ALIGNMENT
        self.cost += _dict_cost(5 if saved is None else 6) + _tensor_cost(len(shape))
        self.cost += _bytes_cost(ALIGNMENT - 1 if self._dry else pad_len)
        self.cost += _list_cost(len(chunks)) if n > _limits.CHUNK_BYTES else 0
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
            total += n + ALIGNMENT + 64 + 9 * len(node.shape) + 5 * (n // _limits.CHUNK_BYTES)
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
    w.value(list(_header.FORMAT_VERSION))
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
