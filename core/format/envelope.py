"""The trainrec header, checksum table and file checksum carried by formats other than
NamedMpk.

Adapters' recorders (`.pt`, flax `.msgpack`) store a record as a plain map:
`{"format", "version", "trainrec", "settings", "record", "item", "checksums", "dtypes"}`,
where `checksums` lists the CRC-32 of each tensor's stored bytes and `dtypes` the dtype
each tensor was saved with where precision settings stored it in another one (else
None), both in tensor order: the order `iter_tensors` walks the item (maps in their
order, lists by index). Tables by position, not by key path: `{"a.b": x, "a": {"b": y}}`
has two tensors whose dotted paths are the same. From envelope version 2.0 on, the
file's last four bytes are the CRC-32 (big-endian) of every byte before them (the *file
checksum*), so nothing in the file, header, structure, scalar or container framing, can
change unnoticed. These helpers build and check those maps and the file checksum, so every
such recorder validates the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import ChecksumError, CorruptRecordError, UnsupportedVersionError
from ..items.checksum import crc32, crc_text
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors, map_tensors
from ..precision import PrecisionSettings, restore_tensor, settings_by_name
from .header import Header

__all__ = [
    "header_fields",
    "parse_header",
    "crc_of",
    "verify_checksums",
    "restore_dtypes",
    "TensorTables",
    "path_arg",
    "CrcWriter",
    "file_crc",
    "check_file_crc",
    "FILE_CRC_BYTES",
]

FILE_CRC_BYTES = 4
"""The file checksum: the last four bytes, big-endian, CRC-32 of every byte before them."""


def header_fields(fmt: str, version: tuple[int, int], settings: PrecisionSettings,
                  record_type: str) -> dict[str, Any]:
    """The header keys of an envelope, in order."""
    return {
        "format": fmt,
        "version": list(version),
        "trainrec": __version__,
        "settings": {"name": settings.name,
                     "float": None if settings.float_dtype is None else settings.float_dtype.value,
                     "int": None if settings.int_dtype is None else settings.int_dtype.value},
        "record": record_type,
    }


def parse_header(doc: dict[str, Any], fmt: str, major: int, source: str) -> Header:
    """The header of a decoded envelope whose `format` is `fmt`; raises
    `UnsupportedVersionError` for another major version, `CorruptRecordError` otherwise."""
    version = doc.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(isinstance(v, int) for v in version)):
        raise CorruptRecordError("malformed version", source=source, key="version")
    if version[0] != major:
        why = (" (1.x files carry no checksum over their header and structure; 2.x files "
               "are checked byte for byte)" if version[0] < major else "")
        raise UnsupportedVersionError(
            f"format version {version[0]}.{version[1]} is not supported; this trainrec reads "
            f"{major}.x{why}", source=source, key="version")
    settings, record, checksums = doc.get("settings"), doc.get("record"), doc.get("checksums")
    if not isinstance(settings, dict) or not isinstance(record, str) or not isinstance(checksums, list):
        raise CorruptRecordError("header lacks settings, record or checksums", source=source)
    try:
        precision = settings_by_name(settings["name"], settings.get("float"), settings.get("int"))
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptRecordError(f"malformed precision settings ({e})", source=source,
                                 key="settings") from None
    return Header(fmt, (version[0], version[1]), str(doc.get("trainrec", "")), precision, record)


def reserve_bytes(item: Item, settings: PrecisionSettings) -> int:
    """A file size to reserve before writing `item` in an envelope format: the tensor bytes
    under `settings` plus room for the container's framing (4 KiB a tensor, 1 MiB more)."""
    total = 1 << 20
    for _, t in iter_tensors(item):
        total += t.numel * settings.target(t.dtype).itemsize + 4096
    return total


def crc_of(t: TensorData) -> int:
    """CRC-32 of a tensor's little-endian C-order bytes."""
    return crc32(t.array.reshape(-1).view(np.uint8).data)


class TensorTables:
    """The `checksums` and `dtypes` tables a writer builds, one entry per tensor in the
    order it meets them (which must be `iter_tensors` order: maps in order, lists by
    index)."""

    def __init__(self) -> None:
        self.checksums: list[int] = []
        self.dtypes: list[str | None] = []

    def add(self, saved: TensorData, stored: TensorData) -> None:
        """Enter the next tensor: `saved` as given, `stored` as written."""
        self.dtypes.append(None if stored.dtype is saved.dtype else saved.dtype.value)
        self.checksums.append(crc_of(stored))


def verify_checksums(item: Item, checksums: Any, source: str, *, recompute: bool = True) -> None:
    """Check that `checksums` has one CRC-32 value for each of the item's tensors, in
    tensor order, and (`recompute`) that each matches; without `recompute` (the file
    checksum covered the tensors' bytes) only that each entry is a CRC-32 value."""
    found = list(iter_tensors(item))
    if not isinstance(checksums, list) or len(checksums) != len(found):
        raise CorruptRecordError(
            f"the checksum table does not match the tensors (a list of {len(found)} "
            f"CRC-32 values, one per tensor in order)", source=source, key="checksums")
    if not all(type(v) is int and 0 <= v <= 0xFFFFFFFF for v in checksums):
        raise CorruptRecordError("malformed checksum table", source=source, key="checksums")
    if not recompute:
        return
    for (key, t), stored in zip(found, checksums):
        got = crc_of(t)
        if got != stored:
            raise ChecksumError(f"tensor checksum mismatch (stored {crc_text(stored)}, "
                                f"computed {got:#010x})", source=source, key=f"item.{key}")


def restore_dtypes(item: Item, dtypes: Any, source: str) -> Item:
    """`item` with every tensor whose `dtypes` entry (one per tensor, in tensor order) is
    a dtype code back in that dtype; an entry None leaves the tensor as stored. Raises
    `CorruptRecordError` for a table of another length or a dtype no setting stores that
    way."""
    count = sum(1 for _ in iter_tensors(item))
    if not isinstance(dtypes, list) or len(dtypes) != count:
        raise CorruptRecordError(
            f"the dtype table does not match the tensors (a list of {count} entries, one per "
            "tensor in order)", source=source, key="dtypes")
    at = iter(dtypes)

    def back(key: str, t: TensorData) -> TensorData:
        code = next(at)
        if code is None:
            return t
        try:
            return restore_tensor(t, DType.from_code(code))
        except (ValueError, TypeError) as e:
            raise CorruptRecordError(str(e), source=source, key=f"dtypes (tensor {key})") from None

    return map_tensors(item, back)


def path_arg(args: Any) -> Path:
    """A file recorder's args as a `Path`; `TypeError` for anything else, a store URL
    included (`Path` would fold `s3://b/x` into a local `s3:/b/x`): a recorder that saves
    to URLs takes its args with `storage.location`."""
    if not isinstance(args, (str, os.PathLike)):
        raise TypeError(f"file recorders take a path, got {type(args).__name__}")
    from ..storage.location import is_url

    if is_url(args):
        raise TypeError(f"this recorder takes a local path, not the URL {args!r} (the "
                        "NamedMpk, gzip, .pt, flax and Burn file recorders and "
                        "CheckpointManager take URLs)")
    return Path(args)


class CrcWriter:
    """A file-like sink that passes every write on to `out` and keeps the CRC-32 of all of
    it (`crc`). The last `hold` bytes written are held back (`held`) until `release`, so
    a writer can still change them (a zip's end record) before they are checksummed."""

    def __init__(self, out: Any, hold: int = 0) -> None:
        self._out = out
        self._hold = hold
        self.held = b""
        self.crc = 0

    def _emit(self, data: Any) -> None:
        self.crc = crc32(data, self.crc)
        self._out.write(data)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if not self._hold:
            self._emit(view)
            return n
        if n >= self._hold:
            self._emit(self.held)
            self._emit(view[: n - self._hold])
            self.held = bytes(view[n - self._hold :])
        else:
            joined = self.held + bytes(view)
            self._emit(joined[: -self._hold] if len(joined) > self._hold else b"")
            self.held = joined[-self._hold :]
        return n

    def flush(self) -> None:
        pass

    def release(self, data: bytes) -> None:
        """Write `data` in place of the held bytes."""
        self.held = b""
        self._emit(data)


_CRC_READ = 8 << 20


def file_crc(f: Any, size: int, source: str) -> tuple[int, int]:
    """`(computed, stored)` file checksums of the `size`-byte file `f` (read in pieces of
    8 MiB, from the start); raises `CorruptRecordError` when it is too short to hold one."""
    if size < FILE_CRC_BYTES:
        raise CorruptRecordError("file too short to hold its checksum", source=source)
    buf = bytearray(min(_CRC_READ, size))
    view = memoryview(buf)
    f.seek(0)
    crc, left = 0, size - FILE_CRC_BYTES
    while left:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            raise CorruptRecordError("file shrank while reading", source=source)
        crc = crc32(view[:n], crc)
        left -= n
    tail = f.read(FILE_CRC_BYTES)
    if len(tail) != FILE_CRC_BYTES:
        raise CorruptRecordError("file shrank while reading", source=source)
    return crc, int.from_bytes(tail, "big")


def check_file_crc(computed: int, stored: int, source: str) -> None:
    """Raise `ChecksumError` unless the file checksums agree."""
    if computed != stored:
        raise ChecksumError(f"file checksum mismatch (stored {stored:#010x}, computed "
                            f"{computed:#010x})", source=source, key="")

