"""`CheckpointManager` on a store URL (`s3://bucket/run`, `memory://run`): the same saves,
retention, `latest` and loads, committed by commit objects instead of renames
(spec/PROTOCOLS.md, "Checkpoints on object stores").

Layout in the folder: a step's objects carry its save's id, `step-{step:08d}.{save}{suffix}`
(the checkpoint) and `step-{step:08d}.{save}.metrics.json`; its commit object
`step-{step:08d}.commit`, written last and only if absent, names both with size and CRC-32
(`commit.py`). A step exists exactly when its commit object does. Retention deletes a
step's commit object first (the step is gone at once) and its objects after; it runs only
after the newer step's commit was written (S3 reads after writes are strongly consistent).
Objects no commit names (a killed or failed save's) are deleted by a later save once
they are older than `2 * LEASE_SECONDS`, when no writer can still be committing them.

One writer per folder: a writing manager holds a lease, the object `.trainrec-lock`
(pid, host, a token, until when), created with `If-None-Match: *`, renewed with `If-Match`
on its ETag every `LEASE_SECONDS / 3` by a daemon thread and before each commit, and
deleted (`If-Match`) by `close()`. A second writer is refused naming the holder, unless
the lease has expired or names a process of this host that is gone (a killed writer's):
it then takes the lease over, conditionally on the ETag it read, so two cannot both take
it. A writer that finds its lease taken over refuses to commit. A store without verified
conditional writes (anything but s3:// and memory://, gs:// included) refuses writers and
serves `read_only=True` managers.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import socket
import threading
import time
import warnings
import weakref
from typing import Any, Literal

from ..errors import FileMissingError, RecorderError
from ..items.checksum import crc32
from ..storage.commit import COMMIT_SUFFIX, Commit, CommitObject, encode, expectations, read_commit
from ..storage.files import parse_json
from ..storage.location import expecting, location, read_bytes, uploads
from ..storage.store import Store
from ..training.protocols import Recorder
from ..training.record import TrainingRecord
from .local import (
    _METRICS_MAX_BYTES,
    _METRICS_SUFFIX,
    CheckpointManager,
    KeepBest,
    _finalize,
    _Outcome,
)

__all__ = ["StoreCheckpointManager", "LEASE_SECONDS", "LOCK_NAME"]

LEASE_SECONDS = 30.0
"""How long a writer's lease lasts without renewal."""
LOCK_NAME = ".trainrec-lock"
_COMMIT = re.compile(r"step-(\d{8,})" + re.escape(COMMIT_SUFFIX))
_OBJECT = re.compile(r"step-(\d{8,})\.([0-9a-f]{24})\..+")


class StoreCheckpointManager(CheckpointManager):
    """A `CheckpointManager` whose `directory` is a store URL (a str); made by
    `CheckpointManager(url, ...)`. Raises as `CheckpointManager` does, and `RecorderError`
    for a recorder whose checkpoints are directories, or a writer on a store without
    conditional writes."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        recorder: Recorder | None = None,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        best: KeepBest | tuple[str, Literal["min", "max"], int] | None = None,
        read_only: bool = False,
    ) -> None:
        url = location(directory)
        if not isinstance(url, str):
            raise TypeError(f"StoreCheckpointManager takes a store URL, got {directory!r}")
        self._configure(recorder, keep_last, keep_every, best, read_only)
        url = url.rstrip("/")
        self.directory = url  # type: ignore[assignment]  # a URL, not a Path
        if self._is_dir:
            raise RecorderError(f"{type(self.recorder).__name__} writes directories: a "
                                "manager on a store takes a file recorder (NamedMpk, .pt, flax)",
                                source=url)
        self._store = Store(url)
        if not read_only and not self._store.exists_folder():
            raise FileMissingError("no such bucket: create it first", source=url)
        self._warned: set[str] = set()
        self._worker: threading.Thread | None = None
        self._outcome = _Outcome()
        self._own: set[str] = set()
        self._lock = _Lease(self._store)  # type: ignore[assignment]
        if not read_only:
            self._lock.acquire()
        self._finalizer = weakref.finalize(self, _finalize, self._outcome, self._lock)
        latest = self.latest_step()
        self._newest = -1 if latest is None else latest

    # -- saving ----------------------------------------------------------------------------

    def _commit(self, step: int, record: TrainingRecord[Any], doc: bytes, save_id: str) -> Any:
        """Upload the checkpoint and its metrics, then write the commit object, last."""
        stem = f"step-{step:08d}.{save_id}"
        names = (f"{stem}{self._suffix}", f"{stem}{_METRICS_SUFFIX}")
        self._own.add(save_id)
        url = self._store.url_of(names[0])
        try:
            with uploads() as log:
                record.save(self.recorder, url)
            written = log.get(url)
            if written is None:
                raise RecorderError(f"{type(self.recorder).__name__} did not upload through "
                                    "trainrec.storage: a manager on a store cannot commit it",
                                    source=url)
            self._store.put(names[1], doc)
            commit = Commit(step, save_id, (
                CommitObject("checkpoint", names[0], written.size, written.crc32),
                CommitObject("metrics", names[1], len(doc), crc32(doc))))
            self._lock.renew()  # type: ignore[attr-defined]  # still ours, just before the commit
        except BaseException:
            self._discard(names)
            raise
        # a commit that failed in flight may still have landed: its objects stay (swept
        # when old if no commit names them)
        if self._store.put_new(_commit_name(step), encode(commit)) is None:
            self._discard(names)
            raise RecorderError(f"step {step} is committed already (by another save): a step "
                                "is never replaced", source=self._path(step))
        return self._path(step)

    def _discard(self, names: tuple[str, ...]) -> None:
        for name in names:
            with contextlib.suppress(Exception):
                self._store.delete(name)

    def _retain(self, newest: int, newest_path: Any) -> None:
        listing = self._store.list()
        steps = _steps_in(listing)
        keep = self._kept(steps, newest)
        for s in (s for s in steps if s not in keep and s < newest):
            try:
                commit = read_commit(self._store, _commit_name(s))
            except FileMissingError:
                continue
            except RecorderError:
                commit = None  # damaged: the step goes, its objects when they are old
            self._store.delete(_commit_name(s))  # first: the step is gone at once
            listing.pop(_commit_name(s), None)
            for o in commit.objects if commit is not None else ():
                self._store.delete(o.name)
                listing.pop(o.name, None)
        self._sweep_uncommitted(newest, listing)

    def _sweep_uncommitted(self, newest: int, listing: dict[str, dict[str, Any]]) -> None:
        """Delete objects no commit names: a failed save's of this manager, or any older
        than two leases (no writer can still commit them)."""
        committed = {int(m.group(1)) for n in listing if (m := _COMMIT.fullmatch(n))}
        now = time.time()
        for name, info in listing.items():
            m = _OBJECT.fullmatch(name)
            if m is None or int(m.group(1)) > newest:
                continue
            step, save = int(m.group(1)), m.group(2)
            if step in committed and self._save_of(step) == save:
                continue
            old = now - _modified(info) > 2 * LEASE_SECONDS
            if (save in self._own and step != newest) or old:
                with contextlib.suppress(RecorderError):
                    self._store.delete(name)

    def _save_of(self, step: int) -> str | None:
        try:
            return read_commit(self._store, _commit_name(step)).save
        except RecorderError:
            return None

    # -- reading ---------------------------------------------------------------------------

    def _complete_steps(self) -> list[int]:
        return _steps_in(self._store.list())

    def _path(self, step: int) -> Any:
        return self._store.url_of(_commit_name(step))

    def _is_complete(self, entry: Any) -> bool:
        name = str(entry).rsplit("/", 1)[-1]
        m = _COMMIT.fullmatch(name)
        return m is not None and int(m.group(1)) in self._complete_steps()

    def _metrics_of(self, step: int) -> dict[str, float]:
        try:
            commit = read_commit(self._store, _commit_name(step))
            entry = commit.named("metrics")
            if entry is None:
                return {}
            with expecting(expectations(self._store, commit)):
                data = read_bytes(self._store.url_of(entry.name), _METRICS_MAX_BYTES)
            doc = parse_json(data, max_bytes=_METRICS_MAX_BYTES, max_depth=3,
                             source=self._store.url_of(entry.name))
            if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), dict):
                raise ValueError("metrics is not a map")
            if doc.get("step", step) != step or doc.get("save", commit.save) != commit.save:
                raise ValueError("they are another step's or save's")
            return {str(k): float(v) for k, v in doc["metrics"].items()}
        except FileMissingError:
            return {}
        except (RecorderError, ValueError, TypeError) as e:
            warnings.warn(f"trainrec: unreadable metrics of step {step} in {self.directory}: "
                          f"{e}; the step is treated as having none", stacklevel=3)
            return {}

    def load(
        self, step: int | None = None, device: Any = None, *, state_type: type[Any] | None = None
    ) -> TrainingRecord[Any]:
        """Load `step` (None: the latest committed) through its commit object: the
        checkpoint object must have the size and CRC-32 the commit names
        (`CorruptRecordError` otherwise). Raises as `CheckpointManager.load`."""
        self.wait()
        steps = self._complete_steps()
        if step is None:
            if not steps:
                raise FileMissingError("no committed checkpoint to load: the folder holds no "
                                       "step yet", source=str(self.directory))
            step = steps[-1]
        if step not in steps:
            raise self._missing(step)
        commit = read_commit(self._store, _commit_name(step))
        entry = commit.named("checkpoint")
        if entry is None:
            raise FileMissingError("the commit names no checkpoint object",
                                   source=self._path(step))
        with expecting(expectations(self._store, commit)):
            return TrainingRecord.load(self.recorder, self._store.url_of(entry.name), device,
                                       state_type=state_type)


def _steps_in(listing: dict[str, Any]) -> list[int]:
    """The committed steps among a folder's object names, ascending."""
    return sorted(int(m.group(1)) for n in listing
                  if (m := _COMMIT.fullmatch(n)) and n == _commit_name(int(m.group(1))))


def _commit_name(step: int) -> str:
    return f"step-{step:08d}{COMMIT_SUFFIX}"


def _modified(info: dict[str, Any]) -> float:
    """When an object was last written (seconds since the epoch; now when unknown)."""
    when = info.get("LastModified") or info.get("created") or info.get("mtime")
    if isinstance(when, datetime.datetime):
        return when.timestamp()
    if isinstance(when, (int, float)):
        return float(when)
    return time.time()


class _Lease:
    """A writer's lease on a store folder: the object `.trainrec-lock` (module docstring)."""

    _live: weakref.WeakSet[_Lease] = weakref.WeakSet()

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tag: str | None = None
        self.enforced = True
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._lost: str | None = None
        self._since = ""

    @property
    def held(self) -> bool:
        return self.tag is not None

    def _doc(self, since: str) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since,
                           "until": time.time() + LEASE_SECONDS,
                           "token": secrets.token_hex(8)}).encode()

    def acquire(self) -> None:
        """Take the lease, or raise `RecorderError` naming its live holder."""
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for _ in range(20):
            tag = self.store.put_new(LOCK_NAME, self._doc(since))
            if tag is None:
                try:
                    data, old = self.store.read(LOCK_NAME, 4096)
                except FileMissingError:
                    continue  # released meanwhile
                holder = _holder(data)
                if not _stale(holder):
                    raise RecorderError(_held_by(holder), source=self.store.url)
                tag = self.store.replace(LOCK_NAME, self._doc(since), old)
                if tag is None:
                    continue  # changed meanwhile: look again
            with self._mutex:
                self.tag, self._lost, self._since = tag, None, since
            self._stop = threading.Event()
            threading.Thread(target=self._heartbeat, args=(self._stop,), daemon=True,
                             name="trainrec-lease").start()
            _Lease._live.add(self)
            return
        raise RecorderError("the folder's lock object keeps changing", source=self.store.url)

    def renew(self) -> None:
        """Extend the lease; `RecorderError` when another writer has taken it over."""
        with self._mutex:
            if self._lost is None and self.tag is not None:
                tag = self.store.replace(LOCK_NAME, self._doc(self._since), self.tag)
                if tag is None:
                    self._lost = ("another writer took this manager's lease over (it was not "
                                  f"renewed for {LEASE_SECONDS:.0f} s): this manager no longer "
                                  "commits here")
                self.tag = tag
            if self._lost is not None:
                raise RecorderError(self._lost, source=self.store.url)
            if self.tag is None:
                raise RecorderError("the manager holds no lease (closed)", source=self.store.url)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(LEASE_SECONDS / 3):
            try:
                self.renew()
            except RecorderError:
                return  # the next commit raises it

    def release(self) -> None:
        self._stop.set()
        with self._mutex:
            tag, self.tag = self.tag, None
        if tag is not None and self._lost is None:
            with contextlib.suppress(Exception):
                self.store.delete(LOCK_NAME, tag)

    @staticmethod
    def _forget_in_child() -> None:
        """After `fork`, in the child: the parent's leases are not the child's to release."""
        for lease in list(_Lease._live):
            lease.tag = None
            lease._stop.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Lease._forget_in_child)


def _holder(data: bytes) -> dict[str, Any]:
    try:
        doc = parse_json(data, max_bytes=4096, max_depth=1)
    except RecorderError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _stale(holder: dict[str, Any]) -> bool:
    """Whether a lease is free to take: expired, or held by a process of this host that
    is gone. An unreadable one is never taken."""
    until, pid = holder.get("until"), holder.get("pid")
    if not isinstance(until, (int, float)) or not isinstance(pid, int):
        return False
    if until < time.time():
        return True
    if holder.get("host") != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _held_by(holder: dict[str, Any]) -> str:
    if not holder:
        who = "a lock object that says nothing readable (delete .trainrec-lock if no writer is alive)"
    else:
        who = f"pid {holder.get('pid')!r} on host {holder.get('host')!r}"
        if holder.get("since"):
            who += f" (since {holder['since']})"
        until = holder.get("until")
        if isinstance(until, (int, float)):
            who += f", its lease runs {max(0.0, until - time.time()):.0f} s more"
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            who += ": this process; close() that manager first, or save with it"
    return (f"another CheckpointManager writes to this folder: {who}. One writer per folder: "
            "stop it first, or read with CheckpointManager(..., read_only=True)")


CheckpointManager._for_urls = StoreCheckpointManager  # CheckpointManager(url) builds this one
