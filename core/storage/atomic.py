"""Crash-safe file replacement: a save either lands whole or leaves the target untouched.

A save writes `.{stem}.{token}.trainrec-tmp` next to the target and renames it over
the target. `stem` is the target's name, or for a name too long to leave room in
NAME_MAX its start, `~` and a hash of the whole name; `token` is 12 random hex digits.
So a temp file's name says which target it belongs to, and nothing else matches it.
The writer holds an exclusive `flock` on its temp file from before its first byte to
after the rename; the kernel drops the lock when the writer dies. A save deletes a
leftover temp file of its own target only when it owns it and can take that lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import FileMissingError, RecorderError

if sys.platform != "win32":
    import fcntl

TEMP_SUFFIX = ".trainrec-tmp"
_TOKEN_HEX = 12
_NAME_MAX = 255  # bytes, on every filesystem Linux and macOS commonly use


@contextlib.contextmanager
def atomic_write(path: Path, *, durable: bool = True, size_hint: int = 0) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it replaces `path` atomically and (`durable`)
    durably: flush, fsync, rename, fsync of the directory. On any exception the temp file
    is removed, `path` is unchanged and the error propagates (OSError as `RecorderError`).

    A symlink at `path` is written through: its target gets the new contents and the
    link stays. An existing target keeps its permission bits and, where the caller may
    set it, its group; a new file gets `0o666` less the umask, as `open` would give it.
    A target that exists but is not a regular file is refused.

    `size_hint`: about this many bytes will be written. They are reserved on disk first
    (Linux `fallocate`, without changing the file's size), so a disk without room fails
    before anything is written, and the writes skip the filesystem's delayed allocation:
    no per-page block reservation, and no flush of the whole file when the rename replaces
    an older one (ext4's auto_da_alloc). Reserved blocks the writes did not use are freed."""
    target = _write_through_links(path)
    directory = target.parent if str(target.parent) else Path(".")
    stem = _temp_stem(target.name)
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    except OSError as e:
        raise RecorderError(f"cannot save here: {e}", source=str(path)) from e
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise RecorderError(
            "the target exists and is not a regular file; a save replaces a file, "
            "never a directory, FIFO, device or socket", source=str(path))
    _remove_orphans(directory, stem)
    try:
        fd, tmp = _create_temp(directory, stem, existing)
    except OSError as e:
        if not directory.exists():
            raise FileMissingError(
                f"cannot save: the folder {str(directory)!r} does not exist (create it first)",
                source=str(path)) from e
        if not directory.is_dir():
            raise RecorderError(f"cannot save: {str(directory)!r} is not a folder",
                                source=str(path)) from e
        hint = ("; a save writes a new file in the target's directory and renames it over "
                "the target, so it needs write permission on the directory, not only on the "
                "file" if isinstance(e, PermissionError) else "")
        raise RecorderError(f"cannot create a file next to the target: {e}{hint}",
                            source=str(path)) from e
    try:
        f = os.fdopen(fd, "wb", buffering=1 << 20)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise
    try:
        with f:  # closed, and its lock released, only after the rename or the unlink
            try:
                if size_hint > 0:
                    _reserve(fd, size_hint)
                yield f
                f.flush()
                if size_hint > 0:
                    f.truncate()  # frees reserved blocks the writes did not use
                if durable:
                    os.fsync(fd)
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as e:
        raise RecorderError(f"cannot write checkpoint: {e}", source=str(path)) from e
    if durable:
        _fsync_dir(directory)


def _write_through_links(path: Path) -> Path:
    """The file a save to `path` must replace: `path` itself, or, when `path` is a
    symlink, the file it finally points to (which need not exist yet)."""
    if not os.path.islink(path):
        return path
    target = Path(os.path.realpath(path))
    if os.path.islink(target):
        raise RecorderError("the symlink does not resolve (a loop)", source=str(path))
    return target


def _temp_stem(name: str) -> str:
    """The part of a temp file's name that names its target, short enough that the
    whole name fits NAME_MAX."""
    room = _NAME_MAX - len(f"..{'0' * _TOKEN_HEX}{TEMP_SUFFIX}")
    if len(os.fsencode(name)) <= room:
        return name
    digest = "~" + hashlib.blake2b(os.fsencode(name), digest_size=8).hexdigest()
    keep = name
    while len(os.fsencode(keep + digest)) > room:
        keep = keep[:-1]
    return keep + digest


def _temp_name(stem: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{stem}.") + f"[0-9a-f]{{{_TOKEN_HEX}}}" + re.escape(TEMP_SUFFIX))


def _create_temp(directory: Path, stem: str, existing: os.stat_result | None) -> tuple[int, str]:
    """A new temp file, open for writing and locked, and its path. Its mode is the
    existing target's, or 0o666 less the umask (applied by the kernel)."""
    mode = 0o666 if existing is None else stat.S_IMODE(existing.st_mode) & 0o777
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = str(directory / f".{stem}.{secrets.token_hex(_TOKEN_HEX // 2)}{TEMP_SUFFIX}")
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            continue
        try:
            claimed = _claim(fd, tmp)
            if claimed and existing is not None:
                _copy_access(fd, existing)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            os.close(fd)
            raise
        if claimed:
            return fd, tmp
        os.close(fd)  # a cleaner took it in the instant before our lock: it deletes it
    raise FileExistsError(errno.EEXIST, "no free temporary file name after 100 tries")


def _claim(fd: int, tmp: str) -> bool:
    """Lock our new temp file; False when a cleaner locked (and so deletes) it first.
    Cleaners unlink before they unlock, so a file still at its name once we hold the
    lock is ours for the whole write."""
    if _lock(fd) is False:
        return False
    try:
        linked = os.stat(tmp, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (linked.st_dev, linked.st_ino) == (own.st_dev, own.st_ino)


def _copy_access(fd: int, existing: os.stat_result) -> None:
    """Give the temp file the existing target's group (where we may) and mode. Where the
    filesystem refuses, the file keeps its creation mode: the target's, narrowed by the
    umask, so never wider than the target's."""
    if sys.platform == "win32":
        return
    if os.fstat(fd).st_gid != existing.st_gid:
        with contextlib.suppress(PermissionError):
            os.fchown(fd, -1, existing.st_gid)
    with contextlib.suppress(PermissionError, NotImplementedError):
        os.fchmod(fd, stat.S_IMODE(existing.st_mode) & 0o777)  # after fchown, which may clear bits


def _lock(fd: int) -> bool | None:
    """Take an exclusive lock on `fd` without waiting: True when taken, False when
    another open file holds it, None when the filesystem has no locks."""
    if sys.platform == "win32":
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


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


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2: Any = None
if sys.platform.startswith("linux"):
    try:
        _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                               ctypes.c_uint]
        _renameat2.restype = ctypes.c_int
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        _renameat2 = None


def rename_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename `src` (a file or a directory) to `dst`, which must not exist: never replaces
    anything there, and never follows a link there (a dangling one included). Raises
    `FileExistsError` when `dst` exists, in any form; other `OSError`s as `rename` does.

    Linux: one `renameat2(RENAME_NOREPLACE)`. Where the kernel or the file system has no
    such flag: a file by `link` then `unlink` (`link` refuses an existing name just as
    atomically); a directory, or a file system without hard links, by checking that `dst`
    is free and renaming, which a writer racing on the same name could get in between (the
    manager's directory lock keeps its own writers apart)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if not stat.S_ISDIR(os.lstat(src).st_mode):
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
                raise
        else:
            os.unlink(src)
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


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


def _remove_orphans(directory: Path, stem: str) -> None:
    """Delete temp files of earlier saves to this target whose writer is gone: those
    named for this target exactly, owned by us, regular files, and not locked. Anything
    else (another target's, another user's, a live writer's, a lockless filesystem's)
    is left alone."""
    if sys.platform == "win32":
        return
    ours = _temp_name(stem)
    try:
        names = [n for n in os.listdir(directory) if ours.fullmatch(n)]
    except OSError:
        return
    for name in names:
        _remove_if_orphaned(str(directory / name))


def _remove_if_orphaned(tmp: str) -> None:
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # a FIFO must not block
    try:
        fd = os.open(tmp, flags)
    except OSError:
        return
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            return
        if _lock(fd) is not True:
            return  # its writer is alive, or nothing can tell
        linked = os.stat(tmp, follow_symlinks=False)
        if (linked.st_dev, linked.st_ino) == (found.st_dev, found.st_ino):
            os.unlink(tmp)  # before the lock is dropped: see `_claim`
    except OSError:
        return
    finally:
        os.close(fd)
