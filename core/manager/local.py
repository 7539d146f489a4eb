"""`CheckpointManager`: periodic background saves of captured `TrainingRecord`s into one
directory, retention (last N, every k-th, best K by a metric), the latest step on
restart, and a clean save on preemption (`SIGTERM`).

Layout (spec/PROTOCOLS.md, "CheckpointManager"): one file per step,
`step-{step:08d}{recorder.suffix}`, and next to it `step-{step:08d}.metrics.json`. A save
writes both into a private folder of its own, `.trainrec-save-{save id}` (mode 0700),
then moves the metrics and then the checkpoint into the directory, each by a rename that
never replaces anything (`renameat2(RENAME_NOREPLACE)`) and never follows a link. The
checkpoint's rename is the step's commit: a step is listed exactly when its checkpoint is
there (a regular file, or a real directory), and then its metrics are already on disk.
Both carry the save's id (the metrics in their JSON, the checkpoint in the extended
attribute `user.trainrec.save` where the file system keeps one), so metrics another save
wrote are never taken for this checkpoint's. Retention deletes the checkpoint first (the
step is gone at once) and its metrics after. Every other name in the directory is
foreign: never read, never deleted; a link or a special file (FIFO, device, socket) at a
step's name is never followed, opened or listed, and is reported once by a warning.

One writer per directory: a writing manager holds an exclusive `flock` on
`.trainrec-lock` from its construction to `close()` (or its collection, or the end of
its process, however it ends); a second one fails at construction naming the holder's
pid and host. `read_only=True` takes no lock and never writes.

A recorder whose checkpoints are directories (`OrbaxRecorder`) says so with
`is_directory = True`: a step is then a directory of that name, and retention renames it
to `.{name}.{token}.trainrec-del` (the step is gone at once) before deleting it. Such a
recorder may name the endings of what a killed save of its own leaves next to a
checkpoint (`temp_suffixes`, e.g. Orbax's `.orbax-checkpoint-tmp`, optionally followed by
`-{digits}`); the sweep after each save removes those of steps up to the newest.

This module holds `CheckpointManager` alone (one idea, a class of some 500 lines); the
directory's lock (`dirlock`), its names and file operations (`dirfiles`) and what a caller
passes besides the record (`policies`) live beside it, and every name importable from here
before the split still is (`from .dirfiles import ...  # noqa: F401` re-exports them).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from ..errors import FileMissingError, RecorderError
from ..precision import NativePrecisionSettings
from ..recorders.namedmpk import NamedMpkFileRecorder
from ..storage.atomic import (  # noqa: F401
    _TOKEN_HEX,
    TEMP_SUFFIX,
    _fsync_dir,
    _lock,
    _remove_if_orphaned,
    rename_noreplace,
)
from ..storage.files import json_fits, kind_of, read_json
from ..storage.location import is_url, location
from ..training.protocols import Recorder
from ..training.record import TrainingRecord
from .dirfiles import (  # noqa: F401
    _DELETING,
    _DELETING_NAME,
    _SAVE_XATTR,
    _SAVING,
    _SAVING_NAME,
    _STEP,
    _TEMP,
    _make_durable,
    _remove_tree,
    _save_id_of,
    _unlink_if,
)
from .dirfiles import (
    _METRICS_MAX_BYTES as _METRICS_MAX_BYTES,  # imported from here by trainrec itself
)
from .dirfiles import _METRICS_SUFFIX as _METRICS_SUFFIX  # imported from here by trainrec itself
from .dirfiles import _finalize as _finalize  # imported from here by trainrec itself
from .dirfiles import _Outcome as _Outcome  # imported from here by trainrec itself
from .dirlock import (  # noqa: F401
    _NOFOLLOW,
    _NONBLOCK,
    LOCK_NAME,
    _DirectoryLock,
    _held_by,
)
from .policies import (  # noqa: F401
    KeepBest,
    Metrics,
    Preemption,
    _metrics_arg,
    _positive_or_none,
    _rank,
    _step_arg,
)

__all__ = ["CheckpointManager", "KeepBest", "Preemption"]


class CheckpointManager:
    """Saves captured `TrainingRecord`s as numbered steps in `directory` (created when
    missing) with `recorder` (default `NamedMpkFileRecorder(NativePrecisionSettings())`:
    every dtype kept), and keeps:

    - the newest step, always, and the `keep_last` newest (`None`: every step);
    - every step divisible by `keep_every` (`None`: no such rule);
    - with `best=KeepBest(metric, mode, k)` (or the tuple `(metric, mode, k)`), the `k`
      best steps by that metric, passed to `save(..., metrics=)`. A step saved without
      that metric (by another configuration) is never deleted by this rule.

    A step is deleted only after a newer one is durable (fsynced, file and directory).
    Steps only grow: `save` refuses a step not greater than every step saved or found,
    and a step that exists is never replaced.

    One writer per directory: the manager holds the directory's lock (`.trainrec-lock`,
    an exclusive `flock`) from here until `close()`, its collection or the end of its
    process; a save after `close()` takes it again. `read_only=True` takes no lock,
    creates nothing and never writes (`save` is a `ValueError`): for a process that
    only lists, reads metrics and loads, such as an evaluator beside a training job.
    Drive a manager from one thread. Also a context manager: leaving it waits for the
    save in flight, raises its error and releases the lock.

    Raises `TypeError` / `ValueError` for bad arguments, `RecorderError` when `directory`
    is not a directory or cannot be created, or when another manager holds its lock
    (the message names its pid and host)."""

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
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        self._configure(recorder, keep_last, keep_every, best, read_only)
        self.directory = Path(location(directory))
        try:
            found = os.stat(self.directory)
        except FileNotFoundError:
            found = None
        except OSError as e:
            raise RecorderError(f"cannot use the checkpoint directory: {e}",
                                source=str(self.directory)) from e
        if found is not None and not stat.S_ISDIR(found.st_mode):
            raise RecorderError("the checkpoint directory is a file, not a directory",
                                source=str(self.directory))
        if not read_only:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RecorderError(f"cannot create the checkpoint directory: {e}",
                                    source=str(self.directory)) from e
        self._warned: set[str] = set()
        self._worker: threading.Thread | None = None
        self._outcome = _Outcome()
        self._lock = _DirectoryLock(self.directory)
        if not read_only:
            self._lock.acquire()
        self._finalizer = weakref.finalize(self, _finalize, self._outcome, self._lock)
        latest = self.latest_step()
        self._newest = -1 if latest is None else latest

    # the manager of a store URL (`trainrec.manager.store`, a subclass: the commit protocol);
    # that module registers it here as it is imported (the package imports it)
    _for_urls: type[CheckpointManager] | None = None

    def __new__(cls, directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> CheckpointManager:
        if cls is CheckpointManager and is_url(directory):
            if CheckpointManager._for_urls is None:
                raise RecorderError("no manager of store URLs is registered: import "
                                    "trainrec.manager (it registers trainrec.manager.store's)")
            return super().__new__(CheckpointManager._for_urls)
        return super().__new__(cls)

    # what help() and inspect.signature show is __init__'s, not the dispatching __new__'s
    __signature__ = inspect.Signature(list(inspect.signature(__init__).parameters.values())[1:])

    def _configure(self, recorder: Recorder | None, keep_last: int | None,
                   keep_every: int | None, best: Any, read_only: bool) -> None:
        """Check and keep the arguments that do not depend on where the steps are."""
        if not isinstance(read_only, bool):
            raise TypeError(f"read_only must be a bool, got {type(read_only).__name__}")
        if recorder is None:
            recorder = NamedMpkFileRecorder(NativePrecisionSettings())
        suffix = getattr(recorder, "suffix", None)
        if not isinstance(recorder, Recorder) or not isinstance(suffix, str) or not suffix:
            raise TypeError(
                f"CheckpointManager needs a file recorder (one with a `suffix` such as '.mpk'), "
                f"got {type(recorder).__name__}")
        self.keep_last = _positive_or_none(keep_last, "keep_last")
        self.keep_every = _positive_or_none(keep_every, "keep_every")
        if best is not None and not isinstance(best, KeepBest):
            if not isinstance(best, tuple) or len(best) != 3:
                raise TypeError(f"best must be KeepBest(metric, mode, k) or a tuple (metric, "
                                f"mode, k), e.g. ('loss', 'min', 2); got {best!r}")
            best = KeepBest(*best)
        self.best: KeepBest | None = best
        self.recorder = recorder
        self.read_only = read_only
        self._suffix = suffix
        self._name = re.compile(_STEP.pattern + re.escape(suffix))
        self._is_dir = getattr(recorder, "is_directory", False) is True
        leftovers = getattr(recorder, "temp_suffixes", ())
        if isinstance(leftovers, str) or not all(isinstance(x, str) and x for x in leftovers):
            raise TypeError(f"{type(recorder).__name__}.temp_suffixes must be a tuple of name "
                            f"endings, got {leftovers!r}")
        self._leftovers = tuple(leftovers)

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.directory)!r}, {self.recorder!r}, "
                f"keep_last={self.keep_last}, keep_every={self.keep_every}, best={self.best}"
                f"{', read_only=True' if self.read_only else ''})")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
            return
        if self._worker is not None:
            self._worker.join()  # the loop's own error goes on; ours stays for the next call
        self._lock.release()

    # -- saving ----------------------------------------------------------------------------

    def save(
        self, step: int, record: TrainingRecord[Any], *, metrics: Metrics | None = None,
        block: bool = False,
    ) -> None:
        """Write `record` as `step` on a background thread and return; `block=True` returns
        when it is written and retention has run. A save still in flight is waited for
        first, and an error it raised is raised here (this save is then not started).

        Raises `TypeError` for a record that is not a `TrainingRecord` or bad metrics,
        `ValueError` for a step that is not greater than every step already saved or in
        the directory, metrics without the `best` metric, or a `read_only` manager;
        `RecorderError` when the directory's lock, released by `close()`, is now another
        manager's. The write's own errors (`RecorderError`, e.g. `LossyPrecisionError`,
        or a step that appeared meanwhile) are raised by the next call or `wait()`."""
        step = _step_arg(step)
        if not isinstance(record, TrainingRecord):
            raise TypeError(
                f"save takes a captured TrainingRecord (TrainingRecord.capture(...)), got "
                f"{type(record).__name__}")
        values = _metrics_arg(metrics, self.best)
        if self.read_only:
            raise ValueError(f"this CheckpointManager of {str(self.directory)!r} was made with "
                             "read_only=True: it never writes (make one without it to save)")
        save_id = secrets.token_hex(12)
        doc = json.dumps({"step": step, "metrics": values, "save": save_id}, sort_keys=True)
        if problem := json_fits(doc, _METRICS_MAX_BYTES):
            raise ValueError(f"the metrics take too much room: {problem}")
        self.wait()
        if not self._lock.held:
            self._lock.acquire()
            latest = self._complete_steps()  # another manager may have saved meanwhile
            self._newest = max(self._newest, latest[-1] if latest else -1)
        if step <= self._newest:
            raise ValueError(
                f"step {step} is not after step {self._newest}, the newest saved in "
                f"{str(self.directory)!r}: steps only grow (a step is never replaced)")
        self._newest = step
        self._worker = threading.Thread(
            target=self._write, args=(step, record, doc.encode(), save_id),
            name=f"trainrec-save-{step}")
        self._worker.start()
        if block:
            self.wait()

    def wait(self) -> None:
        """Return when no save is in flight; raise the error of a background save that
        failed (once: it is then cleared)."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._raise_pending()

    def close(self) -> None:
        """Wait for the save in flight (raising its error, as `wait`) and release the
        directory's lock, so that another manager may write there. A later `save` takes
        the lock again."""
        try:
            self.wait()
        finally:
            self._lock.release()

    def _raise_pending(self) -> None:
        if self._worker is not None and not self._worker.is_alive():
            self._worker.join()
            self._worker = None
        error, self._outcome.error = self._outcome.error, None
        if error is not None:
            latest = self._complete_steps()
            self._newest = latest[-1] if latest else -1  # the failed step may be saved again
            raise error

    def _write(self, step: int, record: TrainingRecord[Any], doc: bytes, save_id: str) -> None:
        try:
            try:
                path = self._commit(step, record, doc, save_id)
            except OSError as e:
                raise RecorderError(f"cannot save step {step}: {e}", source=str(self._path(step))) from e
            try:
                self._retain(step, path)
            except OSError as e:
                raise RecorderError(f"step {step} was saved, but retention failed: {e}",
                                    source=str(self.directory)) from e
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._outcome.error = e

    def _commit(self, step: int, record: TrainingRecord[Any], doc: bytes, save_id: str) -> Path:
        """Write the step into a folder of its own, then move its metrics and (the commit)
        its checkpoint into the directory, never over anything."""
        staging = self.directory / f"{_SAVING}{save_id}"
        os.mkdir(staging, 0o700)  # ours alone: nobody else can plant a link in it
        try:
            staged_metrics = staging / self._metrics_path(step).name
            fd = os.open(staged_metrics, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                os.write(fd, doc)
                os.fsync(fd)
                metrics_id = os.fstat(fd)
            finally:
                os.close(fd)
            staged = staging / self._path(step).name
            record.save(self.recorder, staged)
            with contextlib.suppress(OSError, AttributeError, NotImplementedError):
                os.setxattr(staged, _SAVE_XATTR, save_id.encode(), follow_symlinks=False)
            self._place(staged_metrics, self._metrics_path(step), step)
            _fsync_dir(self.directory)  # the metrics are durable before the step is listed
            try:
                self._place(staged, self._path(step), step)
            except BaseException:
                _unlink_if(self._metrics_path(step), metrics_id)  # ours, of a step never committed
                raise
            _fsync_dir(self.directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._path(step)

    def _place(self, staged: Path, target: Path, step: int) -> None:
        """Move `staged` to `target` without replacing what is there; the metrics of a
        step never committed (a killed save's, a regular file) are replaced."""
        try:
            rename_noreplace(staged, target)
            return
        except FileExistsError:
            found = os.lstat(target)
        leftover = (target.name.endswith(_METRICS_SUFFIX) and stat.S_ISREG(found.st_mode)
                    and not self._is_complete(self._path(step)))
        if not leftover:
            what = kind_of(found.st_mode)
            raise RecorderError(
                f"{target.name} exists already ({what}): a step is never replaced, and a link "
                f"or special file there is never followed; remove it to save step {step}",
                source=str(target))
        os.unlink(target)
        rename_noreplace(staged, target)

    def _retain(self, newest: int, newest_path: Path) -> None:
        steps = self._complete_steps()
        keep = self._kept(steps, newest)
        doomed = [s for s in steps if s not in keep and s < newest]
        if doomed:
            _make_durable(newest_path)  # the recorder may be durable=False
        for s in doomed:
            with contextlib.suppress(FileNotFoundError):
                self._delete_checkpoint(self._path(s))  # first: the step is gone at once
            metrics = self._metrics_path(s)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(metrics).st_mode):  # a link there is not ours
                    os.unlink(metrics)
        self._sweep(newest)

    def _delete_checkpoint(self, path: Path) -> None:
        if not self._is_dir:
            os.unlink(path)  # a listed step: a regular file (unlink never follows a link)
            return
        doomed = path.with_name(f".{path.name}.{secrets.token_hex(6)}{_DELETING}")
        rename_noreplace(path, doomed)  # one step: the step is no longer listed
        _remove_tree(doomed)

    def _kept(self, steps: Sequence[int], newest: int) -> set[int]:
        keep = {newest}
        if self.keep_last is None:
            keep.update(steps)
        else:
            keep.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.best is not None:
            metric, ranked = self.best.metric, []
            for s in steps:
                value = self._metrics_of(s).get(metric)
                if value is None:
                    keep.add(s)  # cannot be ranked: never deleted by this rule
                else:
                    ranked.append((_rank(value, self.best.mode), -s, s))
            keep.update(s for *_, s in sorted(ranked)[: self.best.k])
        return keep

    def _sweep(self, newest: int) -> None:
        """Remove what killed saves left: metrics of steps never committed (older than the
        newest), temp files of our own names whose writer is gone, and the folders of
        saves (ours: the lock says no other writer is alive)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        complete = set(self._complete_steps())
        for name in names:
            if name.endswith(_METRICS_SUFFIX):
                s = self._step_of(name[: -len(_METRICS_SUFFIX)])
                if s is not None and s < newest and s not in complete:
                    with contextlib.suppress(OSError):
                        if stat.S_ISREG(os.lstat(self.directory / name).st_mode):
                            os.unlink(self.directory / name)
            elif (m := _TEMP.fullmatch(name)) is not None:
                target = m.group(1)
                ours = self._name.fullmatch(target) or (
                    target.endswith(_METRICS_SUFFIX)
                    and self._step_of(target[: -len(_METRICS_SUFFIX)]) is not None)
                if ours and sys.platform != "win32":  # no flock there: nothing tells a live writer
                    _remove_if_orphaned(str(self.directory / name))
            elif _SAVING_NAME.fullmatch(name):
                if self._lock.enforced:
                    _remove_tree(self.directory / name)
            elif self._is_dir:
                self._sweep_directory_leftover(name, newest)

    def _sweep_directory_leftover(self, name: str, newest: int) -> None:
        """Remove a directory checkpoint that retention was deleting, or what a killed save
        of a step older than `newest` left (the recorder's `temp_suffixes`)."""
        target: str | None
        if (m := _DELETING_NAME.fullmatch(name)) is not None:
            target = m.group(1)
            stale = True
        else:
            found = (re.fullmatch(rf"(.+){re.escape(x)}(-\d+)?", name) for x in self._leftovers)
            target = next((m.group(1) for m in found if m is not None), None)
            stale = False
        if target is None or not self._name.fullmatch(target):
            return
        s = self._step_of(target[: -len(self._suffix)])
        if s is not None and (stale or s <= newest):  # saves run one at a time: none is live
            _remove_tree(self.directory / name)

    # -- reading ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The complete steps in the directory, ascending (a save in flight is not one
        until its file is committed). Raises the error of a finished background save."""
        self._raise_pending()
        return self._complete_steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with `step` (`{}` for none). Raises `FileMissingError` for a
        step that is not complete."""
        step = _step_arg(step)
        self._raise_pending()
        if not self._is_complete(self._path(step)):
            raise self._missing(step)
        return self._metrics_of(step)

    def _metrics_of(self, step: int) -> dict[str, float]:
        """The step's metrics: `{}`, with a warning, for a file that is unreadable, not a
        regular file, of another step, or of another save than the checkpoint's."""
        path = self._metrics_path(step)
        try:
            doc = read_json(path, max_bytes=_METRICS_MAX_BYTES, max_depth=3, follow=False)
            if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), dict):
                raise ValueError("metrics is not a map")
            if doc.get("step", step) != step:
                raise ValueError(f"they are step {doc.get('step')!r}'s")
            save = doc.get("save")
            tag = _save_id_of(self._path(step)) if isinstance(save, str) else None
            if tag is not None and tag != save:
                raise ValueError(f"another save wrote them (save {save}) than the checkpoint "
                                 f"(save {tag}): two writers in one directory?")
            return {str(k): float(v) for k, v in doc["metrics"].items()}
        except FileMissingError:
            return {}
        except (RecorderError, ValueError, TypeError) as e:
            warnings.warn(f"trainrec: unreadable metrics of step {step} ({path}): {e}; the step "
                          "is treated as having none", stacklevel=3)
            return {}

    def load(
        self, step: int | None = None, device: Any = None, *, state_type: type[Any] | None = None
    ) -> TrainingRecord[Any]:
        """Load `step` (None: the latest) after waiting for the save in flight.

        Raises `FileMissingError` naming the directory and the steps it holds when `step`
        is not among them or there is none; the recorder's `RecorderError`s otherwise."""
        self.wait()
        if step is None:
            steps = self._complete_steps()
            if not steps:
                raise FileMissingError("no complete checkpoint to load: the directory holds no "
                                       "step yet", source=str(self.directory))
            step = steps[-1]
        step = _step_arg(step)
        if not self._is_complete(self._path(step)):
            raise self._missing(step)
        return TrainingRecord.load(self.recorder, self._path(step), device, state_type=state_type)

    # -- preemption ------------------------------------------------------------------------

    @contextlib.contextmanager
    def preemption(
        self, signals: Sequence[int] = (signal.SIGTERM,)
    ) -> Iterator[Preemption]:
        """Within the block, `signals` (default `SIGTERM`, what schedulers and spot VMs
        send before killing) set the yielded flag instead of ending the process; a second
        one gets the handler that was there before (the default: the process ends). The
        loop checks the flag, saves with `block=True` and leaves; leaving the block puts
        the old handlers back. Only the main thread can install signal handlers
        (`ValueError` otherwise)."""
        flag = Preemption()
        previous: dict[int, Any] = {}

        def handler(signum: int, frame: FrameType | None) -> None:
            if flag:
                old = previous[signum]
                signal.signal(signum, signal.SIG_DFL if old is None else old)
                signal.raise_signal(signum)
                return
            flag.signal = signum

        try:
            for s in signals:
                previous[s] = signal.signal(s, handler)
            yield flag
        finally:
            for s, old in previous.items():
                signal.signal(s, signal.SIG_DFL if old is None else old)

    # -- names -----------------------------------------------------------------------------

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}{self._suffix}"

    def _metrics_path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}{_METRICS_SUFFIX}"

    def _step_of(self, stem: str) -> int | None:
        m = _STEP.fullmatch(stem)
        if m is None or stem != f"step-{int(m.group(1)):08d}":
            return None
        return int(m.group(1))

    def _complete_steps(self) -> list[int]:
        steps = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if not self._name.fullmatch(entry.name):
                        continue
                    s = self._step_of(entry.name[: -len(self._suffix)])
                    if s is None:
                        continue
                    if self._is_complete(entry):
                        steps.append(s)
                    elif entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                        with contextlib.suppress(OSError):  # gone meanwhile: nothing to say
                            self._warn_foreign(entry.name, entry.stat(follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise RecorderError(f"cannot list the checkpoint directory: {e}",
                                source=str(self.directory)) from e
        return sorted(steps)

    def _is_complete(self, entry: os.DirEntry[str] | Path) -> bool:
        """Whether a checkpoint of this manager's recorder is there: a regular file, or a
        real directory for a recorder whose checkpoints are directories; never a link."""
        if isinstance(entry, Path):
            try:
                mode = os.lstat(entry).st_mode
            except OSError:
                return False
            return stat.S_ISDIR(mode) if self._is_dir else stat.S_ISREG(mode)
        return entry.is_dir(follow_symlinks=False) if self._is_dir else entry.is_file(follow_symlinks=False)

    def _warn_foreign(self, name: str, mode: int) -> None:
        """Say once that a link or special file sits at a step's name (not listed)."""
        if name in self._warned or stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return
        self._warned.add(name)
        warnings.warn(f"trainrec: {name} in {self.directory} is {kind_of(mode)}, not a "
                      "checkpoint this manager wrote: not listed as a step, never followed "
                      "or opened", stacklevel=4)

    def _missing(self, step: int) -> FileMissingError:
        steps = self._complete_steps()
        shown = ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "")
        return FileMissingError(
            f"no complete checkpoint for step {step}; the steps there are: {shown or 'none'}",
            source=str(self.directory))
