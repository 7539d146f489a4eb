"""Crash-safe file replacement: a save either lands whole or leaves the target untouched."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .errors import FileMissingError, RecorderError

_UMASK = os.umask(0)
os.umask(_UMASK)

TEMP_SUFFIX = ".trainrec-tmp"


@contextlib.contextmanager
def atomic_write(path: Path, *, durable: bool = True, size_hint: int = 0) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it replaces `path` atomically and (`durable`)
    durably: flush, fsync, rename, fsync of the directory. On any exception the temp file
    is removed, `path` is unchanged and the error propagates (OSError as `RecorderError`).

    `size_hint`: about this many bytes will be written. They are reserved on disk first
    (Linux `fallocate`, without changing the file's size), so a disk without room fails
    before anything is written, and the writes skip the filesystem's delayed allocation:
    no per-page block reservation, and no flush of the whole file when the rename replaces
    an older one (ext4's auto_da_alloc). Reserved blocks the writes did not use are freed."""
    directory = path.parent if str(path.parent) else Path(".")
    _remove_orphans(directory, path.name)
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=directory
        )
    except OSError as e:
        if not directory.exists():
            raise FileMissingError(
                f"cannot save: the folder {str(directory)!r} does not exist (create it first)",
                source=str(path)) from e
        if not directory.is_dir():
            raise RecorderError(f"cannot save: {str(directory)!r} is not a folder",
                                source=str(path)) from e
        raise RecorderError(f"cannot create a file next to the target: {e}", source=str(path)) from e
    try:
        if size_hint > 0:
            _reserve(fd, size_hint)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            yield f
            f.flush()
            if size_hint > 0:
                f.truncate()  # frees reserved blocks the writes did not use
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise RecorderError(f"cannot write checkpoint: {e}", source=str(path)) from e
        raise
    if durable:
        _fsync_dir(directory)


_FALLOC_FL_KEEP_SIZE = 1
_fallocate: Any = None
if sys.platform.startswith("linux"):
    try:
        _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _fallocate.restype = ctypes.c_int
    except (OSError, AttributeError):
        _fallocate = None


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate `nbytes` of disk blocks for `fd` without changing its size. Raises
    `OSError(ENOSPC)` when the disk lacks the room; a filesystem without `fallocate`
    just skips the reservation."""
    if _fallocate is None:
        return
    if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(err, f"{os.strerror(err)}: the checkpoint needs at least {nbytes} bytes")


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


def _remove_orphans(directory: Path, name: str) -> None:
    """Delete temp files of earlier saves to `name` whose writing process no longer
    exists (killed mid-save). A file whose pid is alive, or unreadable, is left alone."""
    prefix = f".{name}."
    try:
        entries = [e for e in os.listdir(directory) if e.startswith(prefix) and e.endswith(TEMP_SUFFIX)]
    except OSError:
        return
    for entry in entries:
        pid_text = entry[len(prefix) :].split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # the writer is alive (or the pid was reused): not ours to delete
        except ProcessLookupError:
            pass
        except OSError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(directory / entry)
