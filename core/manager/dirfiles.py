"""The names and file operations of a checkpoint directory: step and temporary names, the
markers of a save or delete under way, a save's id, durable removal, and the finalizer
that releases a manager's directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from ..storage.atomic import _TOKEN_HEX, TEMP_SUFFIX, _fsync_dir
from .dirlock import _NOFOLLOW, _NONBLOCK, _DirectoryLock

_METRICS_SUFFIX = ".metrics.json"
_METRICS_MAX_BYTES = 1 << 20
"""A step's metrics file is read only up to this size (and a save refuses larger metrics)."""
_STEP = re.compile(r"step-(\d{8,})")
_TEMP = re.compile(rf"\.(step-.+)\.[0-9a-f]{{{_TOKEN_HEX}}}" + re.escape(TEMP_SUFFIX))
"""A temp file of `_atomic.atomic_write` for a target named `step-...`."""
_DELETING = ".trainrec-del"
"""A directory checkpoint being deleted by retention: `.{name}.{token}` + this."""
_DELETING_NAME = re.compile(r"\.(.+?)(?:\.[0-9a-f]{12})?" + re.escape(_DELETING))
_SAVING = ".trainrec-save-"
"""The private folder of a save in flight: this + its save id (24 hex digits)."""
_SAVING_NAME = re.compile(re.escape(_SAVING) + r"[0-9a-f]{24}")
_SAVE_XATTR = "user.trainrec.save"


def _save_id_of(path: Path) -> str | None:
    """The save id a checkpoint carries (`user.trainrec.save`), None where it has none (a
    file system without extended attributes, or a copy that dropped them)."""
    try:
        return os.getxattr(path, _SAVE_XATTR, follow_symlinks=False).decode("ascii", "replace")
    except (OSError, AttributeError):
        return None


def _unlink_if(path: Path, expected: os.stat_result) -> None:
    """Remove `path` when it is still the file `expected` describes."""
    with contextlib.suppress(OSError):
        found = os.lstat(path)
        if (found.st_dev, found.st_ino) == (expected.st_dev, expected.st_ino):
            os.unlink(path)


def _remove_tree(path: Path) -> None:
    """Delete a real directory (never a link, never through one; errors ignored)."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)


class _Outcome:
    """The error of the latest background save, until the caller's thread raises it."""

    error: BaseException | None = None


def _finalize(outcome: _Outcome, lock: _DirectoryLock) -> None:
    """When the manager is collected or the program ends: release the lock, and report
    a background error nobody raised."""
    lock.release()
    if outcome.error is not None:
        print(f"trainrec: a background checkpoint save failed and its error was never raised "
              f"(call CheckpointManager.wait()): {outcome.error!r}", file=sys.stderr)


def _make_durable(path: Path) -> None:
    """fsync a checkpoint (a file, or a directory with every file and folder in it) and
    the directory that holds it."""
    paths = [path]
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            paths += [Path(root, n) for n in (*dirs, *files)]
    flags = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    for p in paths:
        try:
            fd = os.open(p, flags)
        except OSError as e:
            if e.errno == errno.ELOOP:
                continue  # a link: not part of what the recorder wrote
            raise
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) or stat.S_ISDIR(os.fstat(fd).st_mode):
                os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(path.parent)
