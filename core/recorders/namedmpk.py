"""Recorders: NamedMpk to a file, a gzip file or bytes.

A recorder only moves items to bytes and back (see `format.py` and spec/FORMAT.md).
File paths are used exactly as given: no extension is added.
"""

from __future__ import annotations

import gzip
import io
import mmap as _mmap
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    CorruptRecordError,
    RecorderError,
    RecordMismatchError,
    reading,
)
from ..format.header import Header
from ..format.limits import ALIGNMENT
from ..format.reader import check_magic, read_document
from ..format.writer import document_size_estimate, write_document
from ..items.tensor import handing_out
from ..items.tree import Item, check_item
from ..precision import FullPrecisionSettings, HalfPrecisionSettings, NativePrecisionSettings
from ..storage.files import open_regular
from ..storage.location import location, object_size, open_input, read_into, upload
from ..training.protocols import PrecisionSettings, Record
from ..training.records import lazy_fields
from .sniff import HEAD_BYTES, reader_of

__all__ = [
    "RecorderBase",
    "NamedMpkFileRecorder",
    "NamedMpkGzFileRecorder",
    "NamedMpkBytesRecorder",
    "DefaultRecorder",
    "CompactRecorder",
    "record_name",
]

_NATIVE = NativePrecisionSettings()


def record_name(record_type: type[Any]) -> str:
    """The name a record type is stored under in a file header."""
    return str(getattr(record_type, "RECORD_NAME", record_type.__name__))




class RecorderBase:
    """Base of trainrec's recorders (adapters' too): `record` / `load` / `load_item` in
    terms of two methods a subclass provides, `save_item(item, args, record_type, *,
    allow_lossy=False)` and `read(args, mmap=False) -> (Header, Item)`. Precision settings
    default to Full; a subclass stores each tensor with `trainrec.precision.store_tensor`
    and loads it back with `restore_tensor`."""

    def __init__(self, settings: PrecisionSettings | None = None) -> None:
        if settings is not None and not isinstance(settings, PrecisionSettings):
            raise TypeError(f"settings must be PrecisionSettings, got {type(settings).__name__}")
        self._settings: PrecisionSettings = settings or FullPrecisionSettings()

    @property
    def settings(self) -> PrecisionSettings:
        return self._settings

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._settings!r})"

    def record(self, record: Record, args: Any, *, allow_lossy: bool = False) -> Any:
        """Write `record` (converted by this recorder's settings) and return the output.

        Raises `LossyPrecisionError` naming the first tensor whose values the settings
        would change (checked while each tensor is written), unless `allow_lossy=True`."""
        return self.save_item(record.into_item(_NATIVE), args, record_name(type(record)),
                              allow_lossy=allow_lossy)

    def load(self, args: Any, device: Any, record_type: type[Any], **kw: Any) -> Any:
        """Read a payload written from a `record_type` and rebuild it on `device`.

        Arrays of a `@record` are handed out without a second copy where the recorder
        read the file into a buffer of its own: they are writable views of that buffer
        (each its own region; no two loads share one), which stays allocated while any
        of them lives."""
        header, item = self.read(args, **kw)
        expected = record_name(record_type)
        if header.record_type != expected:
            raise RecordMismatchError(
                f"payload holds a {header.record_type}, not a {expected}",
                source=self._source(args),
            )
        if kw.get("mmap"):  # the map's tensors: each field built when first read
            with lazy_fields():
                return record_type.from_item(item, device)
        with handing_out():  # `item` is this call's alone and dropped after it
            return record_type.from_item(item, device)

    def load_item(self, args: Any, **kw: Any) -> Item:
        return self.read(args, **kw)[1]

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Any:
        raise NotImplementedError

    def native_name(self) -> str:
        """This recorder's class as written with `NativePrecisionSettings()`, the one that
        keeps every dtype (named by `LossyPrecisionError`)."""
        return type(self).__name__

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        """Header and item of a payload. `mmap=True` defers each tensor's checksum to its
        first read (and, for files, maps the file instead of reading it)."""
        raise NotImplementedError

    def _source(self, args: Any) -> str:
        return str(args)


class NamedMpkFileRecorder(RecorderBase):
    """NamedMpk in a plain file (`.mpk` by convention). Args: a path; output: the `Path`.

    `load(..., mmap=True)` maps the file and hands out zero-copy read-only tensors whose
    checksums are verified when each is first read (`verify=True`: all at once, now).
    Mapped tensors stay valid when the file is replaced by a later save (a rename), not if
    another program truncates it in place. `durable=False` skips the fsyncs of a save (the
    rename stays atomic; a power loss may then lose the newest checkpoint).
    """

    suffix = ".mpk"  # the file name ending `CheckpointManager` gives its checkpoints

    def __init__(self, settings: PrecisionSettings | None = None, *, durable: bool = True) -> None:
        super().__init__(settings)
        self._durable = durable

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path | str:
        from ..storage.atomic import atomic_write

        path = location(args)
        check_item(item)  # bounds the walk below: a malformed item is refused before any file
        if isinstance(path, str):  # a store URL: uploaded as it is written (storage.py)
            with upload(path) as f:
                write_document(f, item, self._settings, record_type, allow_lossy=allow_lossy,
                               recorder=self.native_name())
            return path
        # every save reserves its blocks first (`fallocate`): a full disk fails it before it
        # writes, and replacing an older file skips ext4's flush at rename (auto_da_alloc),
        # which made a 2 MB save 1.5 ms slower than with the reservation (measured)
        size = document_size_estimate(item, self._settings)
        with atomic_write(path, durable=self._durable, size_hint=size) as f:
            write_document(f, item, self._settings, record_type, allow_lossy=allow_lossy,
                           recorder=self.native_name())
        return path

    def read(self, args: Any, *, mmap: bool = False, verify: bool = False) -> tuple[Header, Item]:
        path = location(args)
        if isinstance(path, str):  # streamed into one buffer; `mmap` defers the checksums
            whole = _aligned_buffer(object_size(path), path)
            if not len(whole):
                raise CorruptRecordError("empty object", source=path)
            read_into(path, whole)
            check_magic(bytes(whole[:_MAGIC_BYTES]), path)
            return read_document(whole, path, lazy=mmap and not verify, owned=True)
        source = str(path)
        with reading(source):
            with open_regular(path, source) as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise CorruptRecordError("empty file", source=source)
                check_magic(os.pread(f.fileno(), _MAGIC_BYTES, 0), source)
                if mmap:
                    buf: Any = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
                    return read_document(buf, source, lazy=not verify)
                # one read, then the parse (which checksums every tensor): reading on a
                # thread while the parser checksummed made loads of 512 MiB 2x slower at
                # the median and 9x at the p95 on a busy 2-CPU VM (GIL and wake-ups)
                buf = _aligned_buffer(size, source)
                _read_exactly(f, buf, source)
                return read_document(buf, source, owned=True)


class NamedMpkGzFileRecorder(RecorderBase):
    """NamedMpk compressed with gzip (`.mpk.gz`). Args: a path; output: the `Path`.

    Loading decompresses into memory and then reads as a plain NamedMpk document. A stream
    whose first bytes are not a NamedMpk document is refused at once; one that grows past
    `max_bytes` (by default 256 MiB plus 64 times the compressed size) is refused when it
    does, so a decompression bomb costs at most that.
    """

    suffix = ".mpk.gz"

    def __init__(
        self,
        settings: PrecisionSettings | None = None,
        *,
        compresslevel: int = 6,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(settings)
        self._level = compresslevel
        self._max = max_bytes

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path | str:
        from ..storage.atomic import atomic_write

        path = location(args)
        with upload(path) if isinstance(path, str) else atomic_write(path) as f:
            with gzip.GzipFile(
                filename="", mode="wb", fileobj=f, compresslevel=self._level, mtime=0
            ) as gz:
                write_document(gz, item, self._settings, record_type, allow_lossy=allow_lossy,
                               recorder=self.native_name())
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        path = location(args)
        source = str(path)
        with reading(source):
            with open_input(path) as f:
                head = f.read(2)
                if head != b"\x1f\x8b":
                    f.seek(0)
                    raise CorruptRecordError(
                        "not a gzip file (wrong magic)"
                        + reader_of(f.read(HEAD_BYTES), not_="trainrec.namedmpk.gz"), source=source)
                f.seek(0)
                limit = self._max
                if limit is None:
                    size = object_size(path) if isinstance(path, str) else os.fstat(f.fileno()).st_size
                    limit = _GZ_BYTES + _GZ_RATIO * size
                buf = _gunzip(f, limit, source)
        return read_document(buf, source, lazy=mmap, owned=True)


class NamedMpkBytesRecorder(RecorderBase):
    """NamedMpk in memory. Save args: None; output: `bytes`. Load args: a bytes-like
    object; loaded tensors are read-only views of it."""

    def save_item(
        self, item: Item, args: Any = None, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> bytes:
        if args is not None:
            raise TypeError("NamedMpkBytesRecorder takes args=None when saving")
        out = io.BytesIO()
        write_document(out, item, self._settings, record_type, allow_lossy=allow_lossy,
                       recorder=self.native_name())
        return out.getvalue()

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        if not isinstance(args, (bytes, bytearray, memoryview)):
            raise TypeError(f"load args must be bytes, got {type(args).__name__}")
        return read_document(args, "<bytes>", lazy=mmap)

    def _source(self, args: Any) -> str:
        return "<bytes>"


class DefaultRecorder(NamedMpkFileRecorder):
    """NamedMpk file with full precision (f32, i32), as Burn's `DefaultRecorder`."""

    def __init__(self) -> None:
        super().__init__(FullPrecisionSettings())

    def native_name(self) -> str:
        return "NamedMpkFileRecorder"


class CompactRecorder(NamedMpkFileRecorder):
    """NamedMpk file with half precision (f16, i16), as Burn's `CompactRecorder`."""

    def __init__(self) -> None:
        super().__init__(HalfPrecisionSettings())

    def native_name(self) -> str:
        return "NamedMpkFileRecorder"


_GZ_BYTES = 256 << 20
_GZ_RATIO = 64
"""`NamedMpkGzFileRecorder`'s default cap: this many bytes plus this many times the
compressed size (checkpoints of trained weights compress by less than 2x)."""

_MAGIC_BYTES = 64
"""Enough of a file to tell a NamedMpk document from anything else before reading it."""


def _aligned_buffer(size: int, source: str) -> np.ndarray[Any, Any]:
    try:
        raw = np.empty(size + ALIGNMENT, np.uint8)
    except MemoryError:
        raise RecorderError(f"a file of {size} bytes does not fit in memory (load it with "
                            "mmap=True)", source=source) from None
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + size]


def _read_exactly(f: Any, buf: np.ndarray[Any, Any], source: str) -> None:
    view = buf.data
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CorruptRecordError(f"file shrank while reading ({got} bytes)", source=source)
        got += n


def _gunzip(f: Any, limit: int, source: str) -> bytearray:
    """The decompressed content of gzip file `f`, in one buffer, refused as soon as its
    first bytes are not a NamedMpk document or it grows past `limit` bytes."""
    d = zlib.decompressobj(wbits=31)
    out = bytearray()
    checked = False
    try:
        while not d.eof:
            chunk = d.unconsumed_tail or f.read(1 << 16)  # small reads: no 1 MiB buffer for a tiny file
            if not chunk:
                raise CorruptRecordError("truncated gzip stream", source=source)
            step = (1 << 24) if checked else _MAGIC_BYTES
            out += d.decompress(chunk, min(step, limit - len(out) + 1))
            if len(out) > limit:
                raise CorruptRecordError(
                    f"decompresses to more than {limit} bytes (raise max_bytes to allow it)",
                    source=source,
                )
            if not checked and len(out) >= _MAGIC_BYTES:
                check_magic(bytes(out), source)
                checked = True
    except zlib.error as e:
        raise CorruptRecordError(f"not a valid gzip stream: {e}", source=source) from None
    if not checked:
        check_magic(bytes(out), source)
    if d.unused_data or f.read(1):
        raise CorruptRecordError("trailing data after the gzip stream", source=source)
    return out
