"""Reading the `.pt` files `TorchFileRecorder` writes, without torch.

A `.pt` file is a zip archive (every entry stored, not compressed): `{prefix}/data.pkl`
holds the record as a protocol-2 pickle, `{prefix}/data/{key}` the bytes of each tensor's
storage, and the zip comment trainrec's file checksum (spec/FORMAT.md §8). The pickle is
read by a small opcode interpreter for the subset `torch.save` emits, never by Python's
unpickler: a GLOBAL resolves only names on a fixed allow-list (tensor rebuilds, storage
types, torch dtypes, the empty `OrderedDict` of backward hooks, the bytes codec) to
trainrec's own functions, which build numpy views of the storages' bytes; any other name
is a `CorruptRecordError` naming it. Everything is bounded: the memo, the stack and the
objects built are charged to the object budget of `Limits` (16 MiB plus 8 bytes per
pickle byte, as NamedMpk's reader), nesting to `Limits.max_depth`, and every tensor must
be the whole of its own contiguous storage (no offsets, strides 0, shared storages), as
torch's path in the torch adapter demands too.

This module holds `read_pt` and the parse of a file's parts; the zip container
(`pt_zip`) and the restricted unpickler (`pt_unpickler`) live beside it, and every name
importable from here before the split still is (`trainrec.ptfile` is an alias).
"""

from __future__ import annotations

import mmap as _mmap
import os
from pathlib import Path
from typing import Any

from ..errors import CorruptRecordError, reading
from ..format.envelope import (
    FILE_CRC_BYTES,
    check_file_crc,
    parse_header,
    restore_dtypes,
    verify_checksums,
)
from ..format.header import Header
from ..format.limits import Limits
from ..items.checksum import crc32
from ..items.dtypes import DType  # noqa: F401
from ..items.tensor import TensorData
from ..items.tree import Item, join_key
from ..storage.files import open_regular
from .pt_unpickler import (  # noqa: F401
    _ALLOWED,
    _INT_MIN,
    _MAX_LINE,
    _SMALL_INTS,
    _STORAGE_TYPES,
    _TORCH_DTYPES,
    _UINT_MAX,
    _allow_list,
    _contiguous,
    _Global,
    _Hooks,
    _ints,
    _Machine,
    _Storage,
)
from .pt_zip import (  # noqa: F401
    _READ_CHUNK,
    _entries,
    _Entry,
    _read_all,
)
from .sniff import HEAD_BYTES, reader_of

__all__ = ["FORMAT", "VERSION", "COMMENT", "EOCD_BYTES", "TRAILER_BYTES", "read_pt"]


FORMAT = "trainrec.torch"
VERSION = (2, 0)
COMMENT = b"trainrec.crc32:"
"""The zip comment of a trainrec `.pt` file, followed by the file checksum's four bytes."""
EOCD_BYTES = 22
"""Bytes of a zip's end-of-central-directory record without its comment."""
TRAILER_BYTES = EOCD_BYTES + len(COMMENT) + FILE_CRC_BYTES


def read_pt(path: Path, mmap: bool = False, *, limits: Limits | None = None) -> tuple[Header, Item]:
    """Header and item of a `.pt` file written by `TorchFileRecorder`, read without torch.

    Checks the file checksum over every byte before the pickle is interpreted, then the
    header (magic, version), the checksum and dtype tables. Tensors are views of one
    buffer this call read the file into (`mmap=True`: of a read-only map of the file).
    Raises `CorruptRecordError` (`ChecksumError` for a damaged file) naming the file and
    key, `UnsupportedVersionError` for another major version, `FileMissingError`."""
    source = str(path)
    with reading(source):
        with open_regular(path, source) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEAD_BYTES, 0)
            if head[:4] != b"PK\x03\x04":
                raise CorruptRecordError("not a .pt zip file (wrong magic)"
                                         + reader_of(head, not_=FORMAT), source=source)
            signed = _has_trailer(os.pread(fd, TRAILER_BYTES, max(0, size - TRAILER_BYTES)))
            # the file checksum first: a damaged file is a ChecksumError, whatever it hit
            if mmap:
                buf: Any = _mmap.mmap(fd, 0, access=_mmap.ACCESS_READ)
                if signed:
                    check_file_crc(crc32(memoryview(buf)[: size - FILE_CRC_BYTES]),
                                   int.from_bytes(buf[size - FILE_CRC_BYTES :], "big"), source)
            else:
                buf, crc = _read_all(f, size, source, signed)
                if signed:
                    check_file_crc(crc, int.from_bytes(buf[size - FILE_CRC_BYTES :], "big"), source)
            entries = _entries(f, size, source)
    return _parse(buf, entries, source, signed, owned=not mmap, limits=limits or Limits())


def _has_trailer(end: bytes) -> bool:
    """True when `end` (the file's last bytes) is a zip end record with trainrec's comment."""
    comment = len(COMMENT) + FILE_CRC_BYTES
    return (len(end) == TRAILER_BYTES and end[:4] == b"PK\x05\x06"
            and end[20:22] == comment.to_bytes(2, "little")
            and end[EOCD_BYTES : EOCD_BYTES + len(COMMENT)] == COMMENT)


def _parse(buf: Any, entries: dict[str, _Entry], source: str, signed: bool, *, owned: bool,
           limits: Limits) -> tuple[Header, Item]:
    pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptRecordError("not a torch.save archive (no single data.pkl)", source=source)
    prefix = pickles[0][: -len("/data.pkl")]
    order = entries.get(f"{prefix}/byteorder")
    if order is not None and bytes(memoryview(buf)[order.start : order.start + order.size]) != b"little":
        raise CorruptRecordError("storages written big-endian: trainrec reads the "
                                 "little-endian .pt files it writes", source=source)
    pkl = entries[pickles[0]]
    machine = _Machine(memoryview(buf).cast("B")[pkl.start : pkl.start + pkl.size], buf, entries,
                       prefix, source, owned, limits)
    try:
        doc = machine.run()
    except CorruptRecordError as e:
        if FORMAT.encode() in bytes(machine.data):
            raise
        # a torch.save file of something else (a state_dict, a model): say so, not just where
        # the interpreter of trainrec's subset stopped
        stopped = str(e.args[0]).removesuffix(f" (file {source}, key 'data.pkl')")
        raise CorruptRecordError(f"not a trainrec .pt record: a torch.save file that TorchFileRecorder "
                                 f"did not write (torch.load reads it); {stopped}",
                                 source=source, key="data.pkl") from None

    def fail(msg: str, key: str = "") -> CorruptRecordError:
        return CorruptRecordError(msg, source=source, key=key)

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail("not a trainrec .pt record (wrong magic)")
    header = parse_header(doc, FORMAT, VERSION[0], source)
    if not signed:
        raise fail("the file checksum is missing or damaged")
    seen: set[int] = set()

    def convert(node: Any, key: str, depth: int) -> Item:
        if depth > limits.max_depth:
            raise fail(f"nesting deeper than {limits.max_depth}", key)
        if isinstance(node, (dict, list, TensorData)):
            if id(node) in seen:
                raise fail("the pickle refers to the same object twice (shared containers)", key)
            seen.add(id(node))
        if isinstance(node, TensorData):
            return node
        if isinstance(node, dict):
            return {k: convert(v, join_key(key, k), depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, join_key(key, i), depth + 1) for i, v in enumerate(node)]
        if isinstance(node, int) and not isinstance(node, bool) and not _INT_MIN <= node <= _UINT_MAX:
            raise fail(f"integer {node} does not fit in 64 bits", key)
        if node is None or isinstance(node, (bool, int, float, str, bytes)):
            return node
        raise fail(f"{type(node).__name__} is not an item", key)

    item = convert(doc.get("item"), "item", 0)
    # the file checksum covered every byte, tensors' included
    verify_checksums(item, doc["checksums"], source, recompute=False)
    return header, restore_dtypes(item, doc.get("dtypes"), source)
