"""The `RecorderError` hierarchy: every failure to save, load or restore a record.

Each message names the file (or "<bytes>", "<memory>") and the key path where the
problem sits, so a user can tell which checkpoint and which tensor is at fault.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator

__all__ = [
    "HINT_BYTES",
    "format_hint",
    "register_format_hints",
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


HINT_BYTES = 64
"""How many leading bytes of a file `format_hint` looks at (the format registry's sniff)."""

_by_head: Callable[[bytes, str], str] | None = None
_by_directory: Callable[[str], str] | None = None


def register_format_hints(by_head: Callable[[bytes, str], str],
                          by_directory: Callable[[str], str]) -> None:
    """Give every layer's errors the format registry's sentences (this module sits below
    the registry and never imports it; `trainrec/__init__.py` wires them).
    `by_head(head, not_)` names the reader of a file starting with `head` unless it is of
    format `not_`; `by_directory(path)` the reader of a checkpoint directory; "" for none."""
    global _by_head, _by_directory
    _by_head, _by_directory = by_head, by_directory


def format_hint(head: bytes, *, not_: str) -> str:
    """A sentence to append to a wrong-magic error: which recorder (or
    `trainrec.read_file`) reads a file starting with `head`; "" when it is of format
    `not_` or of no format trainrec knows."""
    return "" if _by_head is None else _by_head(bytes(head[:HINT_BYTES]), not_)


def _directory_hint(path: str) -> str:
    """Which recorder reads the checkpoint directory `path` (a format of directories, such
    as Orbax's), for the error a file recorder gives it; "" when none claims it."""
    return "" if _by_directory is None else _by_directory(path)
