"""Crash-safe file replacement: a save either lands whole or leaves the target untouched."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import RecorderError

_UMASK = os.umask(0)
os.umask(_UMASK)

TEMP_SUFFIX = ".trainrec-tmp"


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it replaces `path` atomically and durably
    (flush, fsync, rename, fsync of the directory). On any exception the temp file is
    removed, `path` is unchanged and the error propagates (OSError as `RecorderError`)."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=directory)
    except OSError as e:
        raise RecorderError(f"cannot create a file next to the target: {e}", source=str(path)) from e
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise RecorderError(f"cannot write checkpoint: {e}", source=str(path)) from e
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself has landed
    finally:
        os.close(dfd)
