"""`_Commit`: a checkpoint directory every rank writes into, committed once: a temp
directory next to `path` under a `flock`, every rank's outcome gathered, the manifest
written last, then one rename (`path` exists exactly when the checkpoint is complete);
temp directories a killed save left are swept by a later one. `_UrlCommit`: the same
steps for a store URL, each rank staging and uploading its own files, rank 0 writing one
commit object last. `DistributedRecorder` and `DCPRecorder` share both (`commit_for`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainrec import FileMissingError, RecorderError
from trainrec.adapter_kit import atomic_write, folders

from .distributed_collectives import _NOT_COMMITTED, _all_gather, _broadcast, _collective
from .distributed_manifest import MANIFEST

if sys.platform != "win32":
    import fcntl

_LOCK = ".lock"
_TEMP_SUFFIX = ".trainrec-dist-tmp"
_TEMP = re.compile(r"\..+\.[0-9a-f]{12}" + re.escape(_TEMP_SUFFIX))


def _os_error(error: OSError, what: str, path: Path) -> RecorderError:
    """`error` (an `OSError` of a save) as the `RecorderError` a save raises."""
    out = RecorderError(f"{what}: {type(error).__name__}: {error.strerror or error}; "
                        f"{_NOT_COMMITTED}", source=str(path))
    out.__cause__ = error
    return out


def _told(error: BaseException | None, path: Path) -> str:
    """`error` as the other ranks are told it, type and message, without the "(file PATH)"
    that their own error about `path` adds again."""
    text, where = str(error), f" (file {path})"
    if isinstance(error, RecorderError) and text.endswith(where):
        text = text[:-len(where)]
    return f"{type(error).__name__}: {text}"


class _Commit:
    """One collective save into a temp directory, renamed to `path` by rank 0 once every
    rank's part is durable. `begin`, then `wrote` or `fail`, then `finish`, on every rank."""

    def __init__(self, path: Path, rank: int, world: int, group: Any) -> None:
        self.path, self.rank, self.world, self.group = path, rank, world, group
        self.token = ""
        self.temp = Path()
        self._lock: int | None = None
        self._error: Exception | None = None
        self._outcome: tuple[Any, ...] = ("ok", 0)

    def prepare(self) -> None:
        """Rank 0: make the temp directory (`token`, `temp`); what fails is kept for `begin`."""
        try:
            self._make_temp()
        except RecorderError as e:
            self._error = e
        except OSError as e:  # a folder we may not write in, a read-only file system
            self._error = _os_error(e, "could not start the save", self.path)

    def begin(self, payload: Any) -> Any:
        """Every rank learns the temp directory's name and gets rank 0's `payload`. Raises on
        every rank what kept rank 0 from starting (after `prepare`)."""
        message: list[Any] = [None]
        if self.rank == 0:
            if self.token:
                message = [("ok", self.token, payload)]
            else:
                message = [("error", _told(self._error, self.path), None)]
        _collective(lambda: _broadcast(message, self.group), self.path, "starting the save",
                    self._abandon)
        status, value, payload = message[0]
        if status != "ok":
            if self._error is not None:
                raise self._error
            raise RecorderError(f"rank 0 could not start the save: {value}", source=str(self.path))
        self.token = value
        self.temp = self._temp_of(value)
        return payload

    def _temp_of(self, token: str) -> Path:
        """Where this rank writes its files for the save `token`."""
        return self.path.parent / f".{self.path.name}.{token}{_TEMP_SUFFIX}"

    def wrote(self, value: Any) -> None:
        """This rank's part is durable; `value` goes into the manifest (see `finish`)."""
        self._outcome = ("ok", value)

    def fail(self, error: Exception) -> None:
        if isinstance(error, OSError):  # permissions, a read-only or full file system
            error = _os_error(error, "could not write its part", self.path)
        self._error = error
        self._outcome = ("error", _told(error, self.path))

    def finish(self, manifest: dict[str, Any], gathered: str = "overrides") -> None:
        """Meet every rank; rank 0 commits when all parts are durable, with every rank's
        `wrote` value, in rank order, under the manifest's key `gathered`. Raises on every
        rank when any rank failed (on that rank, its own error)."""
        outcomes: list[Any] = [None] * self.world
        _collective(lambda: _all_gather(outcomes, self._outcome, self.group), self.path,
                    "waiting for every rank's part", self._abandon)
        failed = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] != "ok"]
        result: list[Any] = [("ok", "")]
        cause: Exception | None = None
        if self.rank == 0:
            if not failed:
                try:
                    manifest[gathered] = [o[1] for o in outcomes]
                    self._commit(manifest, outcomes)
                except Exception as e:  # noqa: BLE001 - the other ranks wait for the word
                    result = [("error", f"rank 0 could not commit: {type(e).__name__}: {e}; "
                                        f"{_NOT_COMMITTED}")]
                    cause = e
            if failed or result[0][0] != "ok":
                self._abandon()
        if not failed:
            _collective(lambda: _broadcast(result, self.group), self.path, "confirming the commit",
                        lambda: None, "rank 0 may have committed it: the checkpoint is complete "
                        "exactly when its directory exists")
        if self._error is not None:
            raise self._error
        if failed:
            shown = "; ".join(f"rank {r}: {m}" for r, m in failed)
            raise RecorderError(f"not committed, since a rank failed to write its part ({shown})",
                                source=str(self.path))
        if result[0][0] != "ok":
            raise RecorderError(result[0][1], source=str(self.path)) from cause

    def _make_temp(self) -> None:
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if os.path.lexists(self.path):
            raise RecorderError(
                "a distributed checkpoint is a directory and is never replaced: save under a "
                "new path (a new step)", source=str(self.path))
        if not parent.is_dir():
            raise FileMissingError(f"cannot save: the folder {str(parent)!r} does not exist "
                                   "(create it first)", source=str(self.path))
        _sweep(parent)
        for _ in range(100):
            token = secrets.token_hex(6)
            temp = parent / f".{self.path.name}.{token}{_TEMP_SUFFIX}"
            try:
                temp.mkdir()
            except FileExistsError:
                continue
            try:
                lock = os.open(temp / _LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError:
                shutil.rmtree(temp, ignore_errors=True)
                raise
            if sys.platform != "win32":
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else holds it
            self.token, self.temp, self._lock = token, temp, lock  # started: `begin` says so
            return
        raise RecorderError("no free temporary directory name after 100 tries",
                            source=str(self.path))

    def _commit(self, manifest: dict[str, Any], outcomes: list[Any]) -> None:
        with atomic_write(self.temp / MANIFEST) as f:
            f.write(json.dumps(manifest, sort_keys=True, indent=1).encode())
        os.unlink(self.temp / _LOCK)  # still locked through our descriptor: see _sweep
        _fsync(self.temp)
        if os.path.lexists(self.path):
            raise RecorderError("the checkpoint appeared while it was being saved: another "
                                "writer uses this path", source=str(self.path))
        os.rename(self.temp, self.path)
        _fsync(self.path.parent if str(self.path.parent) else Path("."))
        self._release()

    def _abandon(self) -> None:
        if self.rank == 0 and self.token:
            shutil.rmtree(self.temp, ignore_errors=True)
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _sweep(parent: Path) -> None:
    """Remove temp directories of saves whose rank 0 is gone: ours by name, with a `.lock`
    nobody holds. One without a lock file (being committed, or of another tool) is left."""
    if sys.platform == "win32":
        return
    try:
        names = [n for n in os.listdir(parent) if _TEMP.fullmatch(n)]
    except OSError:
        return
    for name in names:
        temp = parent / name
        try:
            fd = os.open(temp / _LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its rank 0 is alive
        try:
            shutil.rmtree(temp, ignore_errors=True)
        finally:
            os.close(fd)


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


class _UrlCommit(_Commit):
    """One collective save to the store URL `path` (`trainrec.adapter_kit.folders`): every
    rank writes its files into a private local temporary folder (`temp`), uploads each as
    a data object of this save once written, and rank 0, when every rank's uploads
    succeeded, uploads the manifest and writes the one commit object naming every rank's
    objects. A save that fails deletes the objects it uploaded; `path` is committed
    exactly when its commit object is there."""

    def __init__(self, url: str, rank: int, world: int, group: Any) -> None:
        super().__init__(url, rank, world, group)  # type: ignore[arg-type]  # a URL, not a Path
        self.url = url
        self.store: Any = None
        self._staging = False
        self._early: Exception | None = None
        self._own: list[Any] = []

    def _make_temp(self) -> None:
        self.store = folders.Store(self.url)
        folders.refuse_committed(self.store)
        self.token = folders.new_save_id()
        self._stage()

    def _stage(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="trainrec-stage-"))
        self._staging = True

    def _temp_of(self, token: str) -> Path:
        if self.rank != 0:
            try:
                self.store = folders.Store(self.url)
            except RecorderError as e:  # told to every rank at `finish`, not raised here
                self._early = e
            self._stage()
        return self.temp

    def wrote(self, value: Any) -> None:
        if self._early is None:
            super().wrote(value)

    def finish(self, manifest: dict[str, Any], gathered: str = "overrides") -> None:
        try:
            if self._early is not None:
                self.fail(self._early)
            elif self._outcome[0] == "ok":
                try:
                    folders.upload_files(self.store, self.temp, self.token, self.rank, self._own)
                    self._outcome = ("ok", self._outcome[1],
                                     [(o.role, o.name, o.size, o.crc32) for o in self._own])
                except Exception as e:  # noqa: BLE001 - every rank must hear of it
                    self.fail(e)
            super().finish(manifest, gathered)
        except BaseException:
            self._drop_own()
            raise
        finally:
            self._unstage()

    def _commit(self, manifest: dict[str, Any], outcomes: list[Any]) -> None:
        objects = [folders.CommitObject(*e) for o in outcomes for e in o[2]]
        data = json.dumps(manifest, sort_keys=True, indent=1).encode()
        try:
            objects.append(folders.upload_bytes(self.store, f"{self.token}.{MANIFEST}", MANIFEST,
                                                data))
            if not folders.commit_folder(self.store, self.token, objects):
                raise RecorderError("a checkpoint was committed here by another save while this "
                                    "one ran: never replaced", source=self.url)
        except BaseException:
            if not folders.committed_by(self.store, self.token):
                folders.discard(self.store, objects)
                self._own = []
            raise
        self._own = []  # committed: never discarded

    def _abandon(self) -> None:
        self._drop_own()
        self._unstage()

    def _drop_own(self) -> None:
        if self._own and self.store is not None and not folders.committed_by(self.store, self.token):
            folders.discard(self.store, self._own)
        self._own = []

    def _unstage(self) -> None:
        if self._staging:
            shutil.rmtree(self.temp, ignore_errors=True)
            self._staging = False


def commit_for(path: Path | str, rank: int, world: int, group: Any) -> _Commit:
    """The commit of a save to `path`: a local directory's rename, or a store URL's commit
    object."""
    return _UrlCommit(path, rank, world, group) if isinstance(path, str) else _Commit(
        path, rank, world, group)
