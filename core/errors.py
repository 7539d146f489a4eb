"""The `RecorderError` hierarchy: every failure to save, load or restore a record.

Each message names the file (or "<bytes>", "<memory>") and the key path where the
problem sits, so a user can tell which checkpoint and which tensor is at fault.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

__all__ = [
    "reading",
    "RecorderError",
    "FileMissingError",
    "CorruptRecordError",
    "ChecksumError",
    "UnsupportedVersionError",
    "RecordMismatchError",
    "LossyPrecisionError",
]


class RecorderError(Exception):
    """Root of every failure to save, load or restore a record.

    `source` names the file (or "<bytes>"); `key` is the dotted path of the offending
    item, or "" when the failure concerns the whole payload.
    """

    def __init__(self, message: str, *, source: str = "", key: str = "") -> None:
        self.source = source
        self.key = key
        where = []
        if source:
            where.append(f"file {source}")
        if key:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class FileMissingError(RecorderError, FileNotFoundError):
    """The checkpoint file (or the folder to save it in) does not exist. It is also a
    `FileNotFoundError` (`errno` ENOENT, `filename` the path), so code written for
    `open` or `torch.load` catches it."""

    def __init__(self, message: str, *, source: str = "", key: str = "") -> None:
        super().__init__(message, source=source, key=key)
        self.errno = errno.ENOENT
        self.filename = source or None

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # not OSError's "[Errno 2] ..." form


class CorruptRecordError(RecorderError):
    """The payload is truncated, malformed, hostile or not a trainrec record."""


class ChecksumError(CorruptRecordError):
    """A stored checksum does not match the bytes: the file was damaged after it was written."""


class UnsupportedVersionError(RecorderError):
    """The payload was written by a format version this trainrec cannot read."""


class RecordMismatchError(RecorderError):
    """The record is valid but does not fit the live object (ParamIds, shapes, dtypes, kind)."""


class LossyPrecisionError(RecorderError):
    """The recorder's precision settings would change a stored value. `reason` is the
    message without the file and key."""

    def __init__(self, message: str, *, source: str = "", key: str = "") -> None:
        self.reason = message
        super().__init__(message, source=source, key=key)


@contextlib.contextmanager
def reading(source: str) -> Iterator[None]:
    """Reading a checkpoint file: a missing path or a directory becomes `FileMissingError`,
    any other `OSError` a `RecorderError`, each naming `source`. Every file recorder
    reads inside it, so they all fail the same way."""
    try:
        yield
    except FileNotFoundError as e:
        raise FileMissingError("no such checkpoint", source=source) from e
    except IsADirectoryError as e:
        raise FileMissingError("checkpoint path is a directory" + _directory_hint(source),
                               source=source) from e
    except OSError as e:
        raise RecorderError(f"cannot read checkpoint: {e}", source=source) from e


def _directory_hint(path: str) -> str:
    """Which recorder reads the checkpoint directory `path` (a format of directories, such
    as Orbax's), for the error a file recorder gives it; "" when none claims it."""
    from .recorders.formats import resolve_directory_format

    try:
        fmt = resolve_directory_format(path)
    except RecorderError:
        return ""
    return f"; this is {fmt.description or fmt.name}, and trainrec.read_file reads any of them"
