"""The trainrec header and checksum table carried by formats other than NamedMpk.

Adapters' recorders (`.pt`, flax `.msgpack`) store a record as a plain map:
`{"format", "version", "trainrec", "settings", "record", "item", "checksums", "dtypes"}`,
where `checksums` maps each tensor's key path to the CRC-32 of its stored bytes and
`dtypes` (since version 1.1) maps the key path of each tensor that precision settings
stored in another dtype to the dtype it was saved with. These helpers build and check
those maps, so every such recorder validates the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .checksum import crc32, crc_text
from .dtypes import DType
from .errors import ChecksumError, CorruptRecordError, UnsupportedVersionError
from .format import Header
from .items import Item, iter_tensors, map_tensors
from .precision import restore_tensor, settings_by_name
from .protocols import PrecisionSettings
from .tensor import TensorData

__all__ = ["header_fields", "parse_header", "crc_of", "verify_checksums", "restore_dtypes",
           "path_arg"]


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
        raise UnsupportedVersionError(
            f"format version {version[0]}.{version[1]} is not supported; this trainrec reads "
            f"{major}.x", source=source, key="version")
    settings, record, checksums = doc.get("settings"), doc.get("record"), doc.get("checksums")
    if not isinstance(settings, dict) or not isinstance(record, str) or not isinstance(checksums, dict):
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


def verify_checksums(item: Item, checksums: Any, source: str) -> None:
    """Check that `checksums` lists exactly the item's tensors and each matches."""
    found = dict(iter_tensors(item))
    if not isinstance(checksums, dict) or set(found) != set(checksums):
        raise CorruptRecordError("the checksum table does not match the tensors", source=source,
                                 key="checksums")
    for key, t in found.items():
        got = crc_of(t)
        if got != checksums[key]:
            raise ChecksumError(f"tensor checksum mismatch (stored {crc_text(checksums[key])}, "
                                f"computed {got:#010x})", source=source, key=f"item.{key}")


def restore_dtypes(item: Item, dtypes: Any, source: str) -> Item:
    """`item` with every tensor the `dtypes` table lists back in the dtype it was saved
    with (`dtypes` None: a version 1.0 file, tensors as stored). Raises
    `CorruptRecordError` for a table that names no tensor or a dtype no setting stores
    that way."""
    if dtypes is None:
        return item
    tensors = dict(iter_tensors(item))
    if not isinstance(dtypes, dict) or not set(dtypes) <= set(tensors):
        raise CorruptRecordError("the dtype table does not match the tensors", source=source,
                                 key="dtypes")

    def back(key: str, t: TensorData) -> TensorData:
        if key not in dtypes:
            return t
        try:
            return restore_tensor(t, DType.from_code(dtypes[key]))
        except ValueError as e:
            raise CorruptRecordError(str(e), source=source, key=f"dtypes.{key}") from None

    return map_tensors(item, back)


def path_arg(args: Any) -> Path:
    """A file recorder's args as a `Path`; `TypeError` for anything else."""
    if not isinstance(args, (str, os.PathLike)):
        raise TypeError(f"file recorders take a path, got {type(args).__name__}")
    return Path(args)
