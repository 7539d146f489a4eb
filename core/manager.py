"""`CheckpointManager`: periodic background saves of captured `TrainingRecord`s into one
directory, retention (last N, every k-th, best K by a metric), the latest step on
restart, and a clean save on preemption (`SIGTERM`).

Layout (spec/PROTOCOLS.md, "CheckpointManager"): one file per step,
`step-{step:08d}{recorder.suffix}`, written by the recorder's atomic save, and next to it
`step-{step:08d}.metrics.json`, written atomically *before* the checkpoint. The
checkpoint's rename is the step's commit: a step is listed exactly when its checkpoint
file exists, and then its metrics are already on disk. Retention deletes the checkpoint
first (the step is gone at once) and its metrics after. Every other name in the
directory is foreign: never read, never deleted.

A recorder whose checkpoints are directories (`OrbaxRecorder`) says so with
`is_directory = True`: a step is then a directory of that name, and retention renames it
to `.{name}.trainrec-del` (the step is gone at once) before deleting it. Such a recorder
may name the endings of what a killed save of its own leaves next to a checkpoint
(`temp_suffixes`, e.g. Orbax's `.orbax-checkpoint-tmp`, optionally followed by
`-{digits}`); the sweep after each save removes those of steps up to the newest.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import re
import shutil
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from ._atomic import _TOKEN_HEX, TEMP_SUFFIX, _fsync_dir, _remove_if_orphaned, atomic_write
from .errors import FileMissingError, RecorderError
from .precision import NativePrecisionSettings
from .protocols import Recorder
from .recorders import NamedMpkFileRecorder
from .training import TrainingRecord

__all__ = ["CheckpointManager", "KeepBest", "Preemption"]

Metrics = Mapping[str, float]
_METRICS_SUFFIX = ".metrics.json"
_STEP = re.compile(r"step-(\d{8,})")
_TEMP = re.compile(rf"\.(step-.+)\.[0-9a-f]{{{_TOKEN_HEX}}}" + re.escape(TEMP_SUFFIX))
"""A temp file of `_atomic.atomic_write` for a target named `step-...`."""
_DELETING = ".trainrec-del"
"""A directory checkpoint being deleted by retention: `.{name}` + this."""


@dataclass(frozen=True)
class KeepBest:
    """Keep the `k` steps with the best value of `metric`: the lowest (`mode="min"`) or
    the highest (`"max"`). Ties go to the newer step; a NaN ranks after every number.

    Raises `TypeError` / `ValueError` for a metric that is not a non-empty str, a mode
    other than "min" or "max", or a `k` that is not an int >= 1."""

    metric: str
    mode: Literal["min", "max"]
    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"KeepBest.metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"KeepBest.k must be an int >= 1, got {self.k!r}")


class Preemption:
    """The flag `CheckpointManager.preemption()` yields: true once one of its signals
    arrived (`signal` says which). Check it in the training loop."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None

    def __repr__(self) -> str:
        name = None if self.signal is None else signal.Signals(self.signal).name
        return f"Preemption(signal={name})"


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
    Steps only grow: `save` refuses a step not greater than every step saved or found.
    One manager, in one thread, writes to a directory at a time. Also a context manager:
    leaving it waits for the save in flight and raises its error.

    Raises `TypeError` / `ValueError` for bad arguments, `RecorderError` when `directory`
    is not a directory or cannot be created."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        recorder: Recorder | None = None,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        best: KeepBest | tuple[str, Literal["min", "max"], int] | None = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
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
        self.directory = Path(directory)
        self._suffix = suffix
        self._name = re.compile(_STEP.pattern + re.escape(suffix))
        self._is_dir = getattr(recorder, "is_directory", False) is True
        leftovers = getattr(recorder, "temp_suffixes", ())
        if isinstance(leftovers, str) or not all(isinstance(x, str) and x for x in leftovers):
            raise TypeError(f"{type(recorder).__name__}.temp_suffixes must be a tuple of name "
                            f"endings, got {leftovers!r}")
        self._leftovers = tuple(leftovers)
        if self.directory.exists() and not self.directory.is_dir():
            raise RecorderError("the checkpoint directory is a file, not a directory",
                                source=str(self.directory))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecorderError(f"cannot create the checkpoint directory: {e}",
                                source=str(self.directory)) from e
        self._worker: threading.Thread | None = None
        self._outcome = _Outcome()
        self._finalizer = weakref.finalize(self, _report_unraised, self._outcome)
        latest = self.latest_step()
        self._newest = -1 if latest is None else latest

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.directory)!r}, {self.recorder!r}, "
                f"keep_last={self.keep_last}, keep_every={self.keep_every}, best={self.best})")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.wait()
        elif self._worker is not None:
            self._worker.join()  # the loop's own error goes on; ours stays for the next call

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
        the directory, or metrics without the `best` metric; the write's own errors
        (`RecorderError`, e.g. `LossyPrecisionError`) are raised by the next call or
        `wait()`."""
        step = _step_arg(step)
        if not isinstance(record, TrainingRecord):
            raise TypeError(
                f"save takes a captured TrainingRecord (TrainingRecord.capture(...)), got "
                f"{type(record).__name__}")
        values = _metrics_arg(metrics, self.best)
        self.wait()
        if step <= self._newest:
            raise ValueError(
                f"step {step} is not after step {self._newest}, the newest saved in "
                f"{str(self.directory)!r}: steps only grow (a step is never replaced)")
        self._newest = step
        self._worker = threading.Thread(
            target=self._write, args=(step, record, values), name=f"trainrec-save-{step}")
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

    close = wait

    def _raise_pending(self) -> None:
        if self._worker is not None and not self._worker.is_alive():
            self._worker.join()
            self._worker = None
        error, self._outcome.error = self._outcome.error, None
        if error is not None:
            latest = self._complete_steps()
            self._newest = latest[-1] if latest else -1  # the failed step may be saved again
            raise error

    def _write(self, step: int, record: TrainingRecord[Any], values: dict[str, float]) -> None:
        try:
            doc = json.dumps({"step": step, "metrics": values}, sort_keys=True).encode()
            with atomic_write(self._metrics_path(step)) as f:
                f.write(doc)
            path = self._path(step)
            record.save(self.recorder, path)  # the commit: the step is listed from here on
            self._retain(step, path)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._outcome.error = e

    def _retain(self, newest: int, newest_path: Path) -> None:
        steps = self._complete_steps()
        keep = self._kept(steps, newest)
        doomed = [s for s in steps if s not in keep and s < newest]
        if doomed:
            _make_durable(newest_path)  # the recorder may be durable=False
        for s in doomed:
            with contextlib.suppress(FileNotFoundError):
                self._delete_checkpoint(self._path(s))  # first: the step is gone at once
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._metrics_path(s))
        self._sweep(newest)

    def _delete_checkpoint(self, path: Path) -> None:
        if not self._is_dir:
            os.unlink(path)
            return
        doomed = path.with_name(f".{path.name}{_DELETING}")
        os.rename(path, doomed)  # one step: the step is no longer listed
        shutil.rmtree(doomed, ignore_errors=True)

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
        newest) and temp files of our own names whose writer is gone."""
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
                        os.unlink(self.directory / name)
            elif (m := _TEMP.fullmatch(name)) is not None:
                target = m.group(1)
                ours = self._name.fullmatch(target) or (
                    target.endswith(_METRICS_SUFFIX)
                    and self._step_of(target[: -len(_METRICS_SUFFIX)]) is not None)
                if ours and sys.platform != "win32":  # no flock there: nothing tells a live writer
                    _remove_if_orphaned(str(self.directory / name))
            elif self._is_dir:
                self._sweep_directory_leftover(name, newest)

    def _sweep_directory_leftover(self, name: str, newest: int) -> None:
        """Remove a directory checkpoint that retention was deleting, or what a killed save
        of a step older than `newest` left (the recorder's `temp_suffixes`)."""
        target: str | None
        if name.startswith(".") and name.endswith(_DELETING):
            target = name[1 : -len(_DELETING)]
            stale = True
        else:
            found = (re.fullmatch(rf"(.+){re.escape(x)}(-\d+)?", name) for x in self._leftovers)
            target = next((m.group(1) for m in found if m is not None), None)
            stale = False
        if target is None or not self._name.fullmatch(target):
            return
        s = self._step_of(target[: -len(self._suffix)])
        if s is not None and (stale or s <= newest):  # saves run one at a time: none is live
            shutil.rmtree(self.directory / name, ignore_errors=True)

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
        try:
            doc = json.loads(self._metrics_path(step).read_bytes())
            values = doc["metrics"]
            if not isinstance(values, dict):
                raise ValueError("metrics is not a map")
            return {str(k): float(v) for k, v in values.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"trainrec: unreadable metrics of step {step} "
                          f"({self._metrics_path(step)}): {e}; the step is treated as having none",
                          stacklevel=3)
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
                    if self._name.fullmatch(entry.name) and self._is_complete(entry):
                        s = self._step_of(entry.name[: -len(self._suffix)])
                        if s is not None:
                            steps.append(s)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise RecorderError(f"cannot list the checkpoint directory: {e}",
                                source=str(self.directory)) from e
        return sorted(steps)

    def _is_complete(self, entry: os.DirEntry[str] | Path) -> bool:
        """Whether a checkpoint of this manager's recorder is there: a file, or a
        directory for a recorder whose checkpoints are directories."""
        return entry.is_dir() if self._is_dir else entry.is_file()

    def _missing(self, step: int) -> FileMissingError:
        steps = self._complete_steps()
        shown = ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "")
        return FileMissingError(
            f"no complete checkpoint for step {step}; the steps there are: {shown or 'none'}",
            source=str(self.directory))


class _Outcome:
    """The error of the latest background save, until the caller's thread raises it."""

    error: BaseException | None = None


def _report_unraised(outcome: _Outcome) -> None:
    if outcome.error is not None:
        print(f"trainrec: a background checkpoint save failed and its error was never raised "
              f"(call CheckpointManager.wait()): {outcome.error!r}", file=sys.stderr)


def _step_arg(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError("a step is a non-negative int, got a bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"a step is a non-negative int, got {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"a step is a non-negative int, got {value}")
    return value


def _positive_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


def _metrics_arg(metrics: Metrics | None, best: KeepBest | None) -> dict[str, float]:
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of str to numbers, got {type(metrics).__name__}")
    values: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names are str, got {k!r}")
        if isinstance(v, bool):
            raise TypeError(f"metric {k!r} is a bool, not a number")
        try:
            values[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a real number, got {type(v).__name__}") from None
    if best is not None and best.metric not in values:
        raise ValueError(f"metrics must hold {best.metric!r}, the metric best= ranks by; got "
                         f"{sorted(values)}")
    return values


def _rank(value: float, mode: str) -> tuple[int, float]:
    if math.isnan(value):
        return (1, 0.0)
    return (0, value if mode == "min" else -value)


def _make_durable(path: Path) -> None:
    """fsync a checkpoint (a file, or a directory with every file and folder in it) and
    the directory that holds it."""
    paths = [path]
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            paths += [Path(root, n) for n in (*dirs, *files)]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(path.parent)
