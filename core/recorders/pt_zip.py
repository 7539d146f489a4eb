"""The zip container of a `.pt` file, read in place: its entries (names, offsets, sizes,
checksums) bounded by the file's size.
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptRecordError
from ..format.envelope import FILE_CRC_BYTES
from ..items.checksum import crc32

_READ_CHUNK = 16 << 20


def _read_all(f: Any, size: int, source: str, signed: bool) -> tuple[np.ndarray[Any, Any], int]:
    """The file in one 64-byte-aligned buffer of its own, and the CRC-32 of all but its
    last four bytes (computed piece by piece as they arrive, while they are in cache)."""
    from .namedmpk import _aligned_buffer

    buf = _aligned_buffer(size, source)
    view = buf.data
    f.seek(0)
    got, crc, covered = 0, 0, size - FILE_CRC_BYTES
    while got < size:
        n = f.readinto(view[got : min(size, got + _READ_CHUNK)])
        if not n:
            raise CorruptRecordError(f"file shrank while reading ({got} bytes)", source=source)
        if signed and got < covered:
            crc = crc32(view[got : min(got + n, covered)], crc)
        got += n
    if f.read(1):
        raise CorruptRecordError("file grew while reading", source=source)
    return buf, crc


@dataclass(frozen=True)
class _Entry:
    start: int
    size: int


def _entries(f: Any, size: int, source: str) -> dict[str, _Entry]:
    """Every zip entry's data range, after checking that each is stored uncompressed,
    within the file, and that no two overlap (no two tensors can share bytes)."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except Exception as e:  # zipfile raises many types for a bad file; all mean "corrupt"
        raise CorruptRecordError(f"not a loadable .pt file: {type(e).__name__}: {e}",
                                 source=source) from None
    out: dict[str, _Entry] = {}
    fd = f.fileno()
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptRecordError(f"zip entry {info.filename!r} is compressed; trainrec "
                                     ".pt files store every entry as is", source=source)
        local = os.pread(fd, 30, info.header_offset)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise CorruptRecordError(f"zip entry {info.filename!r} has no local header",
                                     source=source)
        name_len, extra_len = struct.unpack_from("<HH", local, 26)
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > size or info.filename in out:
            raise CorruptRecordError(f"zip entry {info.filename!r} lies outside the file or "
                                     "is listed twice", source=source)
        out[info.filename] = _Entry(start, info.file_size)
    spans = sorted((e.start, e.start + e.size) for e in out.values() if e.size)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptRecordError("zip entries overlap", source=source)
    return out
