"""The checkpoint directory's lock: one manager at a time writes a directory (`LOCK_NAME`,
held with flock; who holds it is said in the refusal).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import time
import warnings
import weakref
from pathlib import Path

from ..errors import RecorderError
from ..storage.atomic import _lock
from ..storage.files import kind_of, read_json

LOCK_NAME = ".trainrec-lock"
"""The file a writing manager holds an exclusive `flock` on."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class _DirectoryLock:
    """The exclusive `flock` on `directory/.trainrec-lock` a writing manager holds. The
    file says who holds it (pid, host, since when); it is never deleted (a lock file
    deleted and made again could be locked twice). The kernel drops the lock when the
    holder's process ends, however it ends; a child made by `fork` does not keep it."""

    _live: weakref.WeakSet[_DirectoryLock] = weakref.WeakSet()

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self.fd: int | None = None
        self.enforced = False
        """Whether the file system gave the lock (False where it has none: NFS without
        lockd, some FUSE mounts; the manager then warns and writes unlocked)."""

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        flags = (os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK
                 | getattr(os, "O_CLOEXEC", 0))
        source = str(self.path)
        for _ in range(100):
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                if os.path.islink(self.path):
                    raise RecorderError("the directory's lock file is a symbolic link, never "
                                        "followed: remove it", source=source) from e
                hint = ("; to only read this directory, use CheckpointManager(..., "
                        "read_only=True)" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
                        else "")
                raise RecorderError(f"cannot open the directory's lock file: {e}{hint}",
                                    source=source) from e
            try:
                found = os.fstat(fd)
                if not stat.S_ISREG(found.st_mode):
                    raise RecorderError(f"the directory's lock file is {kind_of(found.st_mode)}, "
                                        "not a regular file: remove it", source=source)
                got = _lock(fd)
                if got is False:
                    raise RecorderError(_held_by(self.path), source=str(self.path.parent))
                if got is True:
                    linked = os.stat(self.path, follow_symlinks=False)
                    if (linked.st_dev, linked.st_ino) != (found.st_dev, found.st_ino):
                        os.close(fd)  # replaced between our open and our lock: lock the new one
                        continue
                else:
                    warnings.warn(f"trainrec: the file system of {self.path.parent} has no locks: "
                                  "nothing keeps a second CheckpointManager from writing there",
                                  stacklevel=4)
                holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder.encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            self.fd, self.enforced = fd, got is True
            _DirectoryLock._live.add(self)
            return
        raise RecorderError("the directory's lock file keeps being replaced", source=source)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def _forget_in_child() -> None:
        """After `fork`, in the child: close its copies of the lock files (the parent keeps
        its locks; a child that outlives it must not hold them)."""
        for lock in list(_DirectoryLock._live):
            lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_DirectoryLock._forget_in_child)


def _held_by(path: Path) -> str:
    """Who holds the lock at `path`, as the file says, in a sentence."""
    who = "a process whose lock file says nothing readable"
    try:
        doc = read_json(path, max_bytes=4096, max_depth=1, follow=False)
        if isinstance(doc, dict):
            pid, host = doc.get("pid"), doc.get("host")
            who = f"pid {pid!r} on host {host!r}"
            if doc.get("since"):
                who += f" (since {doc['since']})"
            if pid == os.getpid() and host == socket.gethostname():
                who += ": this process; close() that manager first, or save with it"
    except RecorderError:
        pass
    return (f"another CheckpointManager writes to this directory: {who}. One writer per "
            "directory: stop it first, or read with CheckpointManager(..., read_only=True)")
