"""DCP's `.metadata`, read for `DCPRecorder` and `trainrec verify`: bounded, checked against
the size and CRC-32 its save recorded in the manifest, unpickled through an allow-list of
DCP's own classes with an opcode budget, checked for the shape of every value, and its
chunk lists checked to tile each tensor.

DCP keeps no checksum of its `.metadata`, and its entries (which bytes of which shard file
are which tensor, and which part of it) were covered by none: two entries of one length
swapped (a parameter and its pending gradient, `exp_avg` and `exp_avg_sq`) loaded without a
word. The manifest (format 3.0) has the file's size and CRC-32; the file also names the
save that wrote it (DCP's `StorageMeta.save_id` is the save's id), so a `dcp/` folder of
another save is told apart from a damaged one.

The reads are bounded before anything is unpickled: at most `metadata_byte_budget(n)`
bytes and `metadata_op_budget(n)` pickle opcodes for a checkpoint whose manifest lists `n`
shard entries (a `.metadata` holds about 220 bytes and 110 opcodes an entry), so a hostile
file costs time and memory in proportion to the checkpoint it claims to describe.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainrec import ChecksumError, CorruptRecordError, RecorderError
from trainrec.adapter_kit import crc32

__all__ = ["file_digest", "metadata_byte_budget", "metadata_op_budget", "read_metadata",
           "check_chunks"]

METADATA = ".metadata"

_BYTES_BASE, _BYTES_PER_ENTRY = 64 << 10, 2 << 10
_OPS_BASE, _OPS_PER_ENTRY = 16 << 10, 512


def metadata_byte_budget(entries: int) -> int:
    """The largest `.metadata` read for a checkpoint of `entries` shard entries."""
    return _BYTES_BASE + _BYTES_PER_ENTRY * entries


def metadata_op_budget(entries: int) -> int:
    """The most pickle opcodes unpickled from it."""
    return _OPS_BASE + _OPS_PER_ENTRY * entries


def open_regular(file: Path, what: str) -> int:
    """A descriptor of `file` (`what`, for messages) opened for reading, after checking it
    is a regular file (a FIFO is opened without blocking, and refused): `CorruptRecordError`
    for a missing file or one of another kind, `RecorderError` when it cannot be opened
    (permissions)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptRecordError(f"{what} is missing", source=str(file)) from None
    except OSError as e:
        raise RecorderError(f"{what} cannot be opened: {type(e).__name__}: {e.strerror or e}",
                            source=str(file)) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptRecordError(f"{what} is not a regular file", source=str(file))
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_digest(file: Path) -> dict[str, int]:
    """{"size": bytes, "crc32": CRC-32} of `file` (the save's record of its `.metadata`)."""
    with open(file, "rb", buffering=0) as f:
        data = f.read()
    return {"size": len(data), "crc32": crc32(data)}


def _read_bounded(file: Path, limit: int) -> bytes:
    fd = open_regular(file, "DCP's .metadata")
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptRecordError(
                f"DCP's .metadata holds {size} bytes, more than the {limit} a checkpoint of "
                "this many shard entries can need: refused unread", source=str(file))
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise RecorderError(f"DCP's .metadata cannot be read: {type(e).__name__}: {e.strerror or e}",
                            source=str(file)) from e
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while it was read
        raise CorruptRecordError(f"DCP's .metadata holds more than {limit} bytes",
                                 source=str(file))
    return data


def read_metadata(folder: Path, saved: dict[str, int], save_id: str, entries: int) -> Any:
    """DCP's `.metadata` of `folder`, checked: at most `metadata_byte_budget(entries)`
    bytes; their size and CRC-32 those the save recorded (`saved`), else `ChecksumError`
    (or `CorruptRecordError` naming another save, when the file names one other than
    `save_id`); unpickled within `metadata_op_budget(entries)` opcodes, with DCP's own
    classes only; every value of the kind DCP's loader expects (`_check_structure`)."""
    file = folder / METADATA
    data = _read_bounded(file, metadata_byte_budget(entries))
    crc = crc32(data)
    if len(data) != saved["size"] or crc != saved["crc32"]:
        other = _named_save(data, entries)
        if other is not None and other != save_id:
            raise CorruptRecordError(
                f"the {folder.name}/ folder is another save's: its .metadata was written by "
                f"save {other!r}, manifest.json is save {save_id!r} (a folder swapped or "
                "copied in, not damage)", source=str(folder))
        raise ChecksumError(
            f"DCP's .metadata is damaged: {len(data)} bytes with CRC-32 {crc:08x}, the save "
            f"wrote {saved['size']} bytes with CRC-32 {saved['crc32']:08x} (it says which bytes "
            "of the shard files are which tensor)", source=str(file))
    metadata = unpickle_metadata(data, metadata_op_budget(entries), str(file))
    _check_structure(metadata, str(file))
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    if metadata.storage_meta.save_id != save_id:
        raise CorruptRecordError(
            f"DCP's .metadata names save {metadata.storage_meta.save_id!r}, manifest.json "
            f"save {save_id!r}", source=str(file))
    return metadata


def _named_save(data: bytes, entries: int) -> str | None:
    """The save id a `.metadata` that failed its checksum names, when it unpickles."""
    try:
        metadata = unpickle_metadata(data, metadata_op_budget(entries), "")
        _check_structure(metadata, "")
    except RecorderError:
        return None
    meta = metadata.storage_meta
    return meta.save_id if meta is not None else None


# -- unpickling ----------------------------------------------------------------------------

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "StorageMeta",
        "TensorStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What DCP's pickled `.metadata` holds (checked on torch 2.6 to 2.13): its dataclasses, a
layout, `torch.Size`, dtypes and the checkpoint's path. Nothing else is unpickled."""


class _ForbiddenError(Exception):
    pass


class _BudgetError(Exception):
    pass


def _counted(op: Any) -> Any:
    def run(self: _MetadataUnpickler) -> None:
        self.ops_left -= 1
        if self.ops_left < 0:
            raise _BudgetError
        op(self)
    return run


class _MetadataUnpickler(pickle._Unpickler):
    """Python's unpickler, whose memo is a dict: C's grows an array to twice the index a
    memo opcode names (a 9-byte file asks gigabytes). It costs about 10x C's time (4 ms
    against 0.4 ms for the 32 KB `.metadata` of 16 parameters with AdamW state), and runs
    at most `ops_left` opcodes."""

    dispatch = {code: _counted(op) for code, op in pickle._Unpickler.dispatch.items()}

    def __init__(self, file: Any, ops: int) -> None:
        super().__init__(file)
        self.ops_left = ops

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _ForbiddenError(f"{module}.{name}")


def unpickle_metadata(data: bytes, ops: int, source: str) -> Any:
    """`data` unpickled with DCP's metadata classes only, within `ops` opcodes."""
    try:
        return _MetadataUnpickler(io.BytesIO(data), ops).load()
    except _ForbiddenError as e:
        raise CorruptRecordError(f"DCP's .metadata names {e}, which DCP's metadata never holds: "
                                 "refused without unpickling it (it could run code)",
                                 source=source) from None
    except _BudgetError:
        raise CorruptRecordError(f"DCP's .metadata needs more than {ops} pickle opcodes, more "
                                 "than a checkpoint of this many shard entries holds: refused",
                                 source=source) from None
    except Exception as e:  # noqa: BLE001 - unpickling raises anything
        raise CorruptRecordError(f"DCP's .metadata is unreadable: {type(e).__name__}: {e}",
                                 source=source) from e


# -- the shape of every value ----------------------------------------------------------------

_MISSING = object()


def _sizes(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _check_structure(m: Any, source: str) -> None:
    """`CorruptRecordError` unless every value of the unpickled `.metadata` is of the kind
    DCP's loader and trainrec's checks read (an object built by the pickle may lack any
    attribute, or hold another type: a bit flip was an AttributeError or KeyError later)."""
    def bad(what: str) -> CorruptRecordError:
        return CorruptRecordError(f"DCP's .metadata is malformed: {what}", source=source)

    def field(obj: Any, name: str) -> Any:
        value = getattr(obj, name, _MISSING)
        if value is _MISSING:
            raise bad(f"a {type(obj).__name__} without {name}")
        return value

    if type(m) is not Metadata:
        raise CorruptRecordError("DCP's .metadata does not hold a DCP Metadata", source=source)
    entries = field(m, "state_dict_metadata")
    if type(entries) is not dict:
        raise bad("state_dict_metadata is not a dict")
    for key, meta in entries.items():
        if type(key) is not str:
            raise bad(f"an entry named by a {type(key).__name__}")
        if type(meta) is BytesStorageMetadata:
            continue
        if type(meta) is not TensorStorageMetadata:
            raise bad(f"entry {key!r} is a {type(meta).__name__}")
        props, size, chunks = (field(meta, n) for n in ("properties", "size", "chunks"))
        if type(props) is not TensorProperties or not isinstance(field(props, "dtype"), torch.dtype):
            raise bad(f"entry {key!r} has no tensor properties with a dtype")
        if not _sizes(size) or type(chunks) is not list:
            raise bad(f"entry {key!r} has no size or chunk list")
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata or not (
                    _sizes(field(chunk, "offsets")) and _sizes(field(chunk, "sizes"))):
                raise bad(f"a chunk of {key!r} is not offsets and sizes")
    storage = field(m, "storage_data")
    if type(storage) is not dict:
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(field(index, "fqn")) is not str:
            raise bad("a storage entry is not keyed by a MetadataIndex")
        offset = field(index, "offset")
        if offset is not None and not _sizes(offset):
            raise bad(f"the storage entry of {index.fqn!r} has an offset {offset!r}")
        if type(info) is not _StorageInfo:
            raise bad(f"the storage entry of {index.fqn!r} is a {type(info).__name__}")
        path = field(info, "relative_path")
        transforms = getattr(info, "transform_descriptors", None)
        if not isinstance(path, str) or not (transforms is None or (
                isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms))):
            raise bad(f"the storage entry of {index.fqn!r} names no file")
        field(info, "offset"), field(info, "length")  # their kinds: `_checked_metadata`
    meta = getattr(m, "storage_meta", None)
    if meta is not None and (type(meta) is not StorageMeta or not isinstance(
            getattr(meta, "save_id", None), (str, type(None)))):
        raise bad("storage_meta is not a StorageMeta")
    planner = getattr(m, "planner_data", None)
    if planner is not None and type(planner) is not dict:
        raise bad("planner_data is not a dict")


# -- chunks ----------------------------------------------------------------------------------


def check_chunks(metadata: Any, folder: Path) -> None:
    """`CorruptRecordError` unless the chunks `.metadata` lists of every tensor entry tile
    it: each inside the tensor and with a place in the shard files, and the non-empty ones
    a grid (per dimension, their intervals sorted cover the dimension end to end, each
    neighbour starting where the last ended; `_tiling_problem`): O(n log n), for any number
    of chunks. DCP reads what the chunks cover and leaves the rest of
    the live tensor as it was: a chunk moved by one element, or a list emptied, loaded
    without a word."""
    for name, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        size = list(meta.size)
        filled = []
        for chunk in meta.chunks:
            at, extent = list(chunk.offsets), list(chunk.sizes)
            if not (len(at) == len(extent) == len(size) and all(
                    o + e <= n for o, e, n in zip(at, extent, size))):
                raise CorruptRecordError(
                    f"DCP's .metadata gives {name} a chunk at {at} of {extent}, outside its "
                    f"shape {size}", source=str(folder), key=name)
            if MetadataIndex(name, chunk.offsets) not in metadata.storage_data:
                raise CorruptRecordError(
                    f"DCP's .metadata gives {name} a chunk at {at} that is in no shard file",
                    source=str(folder), key=name)
            if math.prod(extent):
                filled.append((tuple(at), tuple(extent)))
        if math.prod(size):
            problem = _tiling_problem(filled, size)
            if problem:
                total = sum(math.prod(e) for _, e in filled)
                raise CorruptRecordError(
                    f"DCP's .metadata's chunks of {name} do not cover its shape {size} once "
                    f"({total} elements in {len(filled)} non-empty chunk(s): {problem})",
                    source=str(folder), key=name)


def _tiling_problem(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], size: list[int],
                    d: int = 0) -> str:
    """What keeps the non-empty `chunks` (offsets, sizes) from tiling `size` along its
    dimensions from `d` on, or "": their intervals along `d`, sorted, cover it end to end,
    each starting where the last ended, and the chunks of each interval tile the rest the
    same way (a grid, the layout DCP writes from a device mesh, or grids inside its bands).
    O(n log n) in the chunks, for any number; a tiling that is no such nesting (a chunk
    across two bands of another dimension's) is refused too."""
    if d == len(size):
        return "" if len(chunks) == 1 else "two at one place, overlapping"
    bands: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for at, extent in chunks:
        bands.setdefault((at[d], extent[d]), []).append((at, extent))
    end = 0
    for start, length in sorted(bands):
        if start != end:
            return (f"along dimension {d} one starts at {start}, " +
                    ("overlapping" if start < end else f"leaving {end}..{start} uncovered"))
        end = start + length
    if end != size[d]:
        return f"along dimension {d} they end at {end}"
    for band in sorted(bands):
        problem = _tiling_problem(bands[band], size, d + 1)
        if problem:
            return problem
    return ""
