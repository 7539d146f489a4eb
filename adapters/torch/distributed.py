"""`DistributedRecorder`: one checkpoint of a data-parallel (DDP) run, every rank's part
in one directory, committed once.

A save is collective: every rank of the process group calls `record.save(recorder, path)`
with its own captured `TrainingRecord`. What is the same on every rank is written once, and
what is a rank's own is written by that rank:

- `replicated{suffix}`, by rank 0: its model state (parameters, buffers), optimizer and
  scheduler, which DDP keeps equal on every rank;
- `rank-{r:05d}-of-{n:05d}{suffix}`, by rank r: its pending gradients (the model's `.grad`
  left by `no_sync()` micro-steps, and the accumulator's), its caller state (counters,
  `TorchRngRecord`), and every leaf of the replicated part that differs on this rank from
  rank 0's (BatchNorm statistics of a DDP with `broadcast_buffers=False`, say), found by
  comparing per-leaf digests (SHA-1), so a resume is exact even where ranks drifted apart;
- `manifest.json`, by rank 0, last: format, version, world size, the save's id (which every
  part repeats), the part names and how many leaves each rank overrides.

The commit (spec/PROTOCOLS.md, "Distributed records"): rank 0 makes a temp directory
`.{name}.{token}.trainrec-dist-tmp` next to `path` and holds a `flock` on its `.lock`;
every rank writes its part there with the inner recorder's atomic, durable save; all ranks
gather each other's outcome (a barrier); only when every part is durable does rank 0
write the manifest, fsync, and rename the directory to `path` (then fsync the parent).
`path` exists exactly when the checkpoint is complete. A rank that fails or dies before
the barrier leaves no `path`: the other ranks raise `RecorderError` (the collective fails
when a peer's connection drops, or at the process group's timeout) and rank 0 removes the
temp directory; one a killed rank 0 leaves is removed by a later save into the same
folder, once its lock is free.

With `timeout=t`, every save and collective load starts with the ranks meeting in the
process group's store (`meet`): a rank that has not come within t seconds (a `save` called
under `if rank == 0:`) fails the others before anything is written or read, instead of at
the group's timeout in their first collective.

A load reads `replicated` and this rank's part, and refuses another world size: pending
gradients and caller state are per rank, and no rule maps them onto another number of
ranks. `read(path, rank=r)` reads rank r's view in any process (inspection, tools).

A recorder of `torch.distributed.checkpoint` directories can reuse the same commit
(`_Commit`): DCP writes its files into the temp directory, the commit renames it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import numbers
import os
import re
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

import trainrec
from trainrec import (
    CorruptRecordError,
    FileMissingError,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    TensorData,
    UnsupportedVersionError,
)
from trainrec.adapter_kit import Header, Item, RecorderBase, atomic_write, path_arg

if sys.platform != "win32":
    import fcntl

__all__ = ["DistributedRecorder"]

FORMAT = "trainrec.distributed"
VERSION = (1, 0)
MANIFEST = "manifest.json"
_LOCK = ".lock"
_TEMP_SUFFIX = ".trainrec-dist-tmp"
_TEMP = re.compile(r"\..+\.[0-9a-f]{12}" + re.escape(_TEMP_SUFFIX))
_TRAINING = "TrainingRecord"
_TORCH_MODULE = "torch.nn.Module"
_PART = "trainrec.distributed.part"
_REPLICATED = "trainrec.distributed.replicated"

Path_ = tuple[str | int, ...]


class DistributedRecorder(RecorderBase):
    """Saves a data-parallel run's checkpoint as one directory (args: its path, which must
    not exist yet; output: the `Path`), every rank's part written by that rank and
    committed by rank 0 once all are durable; see the module docstring for the layout.

    `recorder` writes each part (default `NamedMpkFileRecorder(NativePrecisionSettings())`,
    every dtype kept; any file recorder with a `suffix`); its precision settings are this
    recorder's. `group` is the process group whose ranks save together (default: the
    world; without an initialized process group the run is one rank).

    Every rank calls `save` / `record` (collective: the ranks meet three times; a rank
    that never arrives fails the others at once when its process is gone, else at the
    process group's timeout) and `load` / `read` (collective with several ranks). Loading
    refuses a checkpoint of another world size.

    `timeout` (seconds, or a `datetime.timedelta`; default None: the process group's own):
    before a save or a collective load touches anything, every rank of `group` meets in
    the group's store, and when a rank has not joined within `timeout` the ranks that did
    raise `RecorderError` naming it, having written or loaded nothing (`save` called on
    some ranks only, say under `if rank == 0:`, then fails in seconds instead of waiting
    out the group's timeout, 30 minutes by default). Any backend (gloo, NCCL).

    Example::

        rec = TrainingRecord.capture(ddp_model, optimizer, scheduler, acc, state)
        rec.save(DistributedRecorder(), root / f"step-{step:08d}")   # on every rank
        ...
        record = TrainingRecord.load(DistributedRecorder(), path, device, state_type=State)
    """

    def __init__(self, recorder: RecorderBase | None = None, *, group: Any = None,
                 timeout: float | datetime.timedelta | None = None) -> None:
        inner = NamedMpkFileRecorder(NativePrecisionSettings()) if recorder is None else recorder
        suffix = getattr(inner, "suffix", None)
        if not isinstance(inner, RecorderBase) or not isinstance(suffix, str) or not suffix:
            raise TypeError(
                "DistributedRecorder writes each rank's part with a file recorder (one with a "
                f"`suffix` such as '.mpk'), got {type(inner).__name__}")
        super().__init__(inner.settings)
        self.recorder = inner
        self.group = group
        self.timeout = timeout_seconds(timeout)
        self._suffix = suffix

    def __repr__(self) -> str:
        shown = "" if self.timeout is None else f", timeout={self.timeout:g}"
        return f"DistributedRecorder({self.recorder!r}{shown})"

    def native_name(self) -> str:
        return f"DistributedRecorder({self.recorder.native_name()})"

    # -- save ------------------------------------------------------------------------------

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path:
        """Collective: write this rank's part of `item` into the checkpoint `args` and
        return its `Path` once rank 0 committed it. Every rank raises `RecorderError` when
        any rank failed (its own error on the rank that failed), and nothing is committed.
        With a `timeout`, a rank that does not join within it fails the others first."""
        path = path_arg(args)
        meet(self.group, self.timeout, "DistributedRecorder.save", path)
        rank, world = _rank_world(self.group)
        commit = _Commit(path, rank, world, self.group)
        early: Exception | None = None  # raised after the ranks met: they must hear of it
        replicated: dict[str, Item] | None = None
        ours: Any = None
        try:
            replicated, local = _split(item, record_type)
        except Exception as e:  # noqa: BLE001
            early = e
        if rank == 0:
            commit.prepare()  # the temp directory; an error is told to every rank in `begin`
        with ThreadPoolExecutor(max_workers=1) as pool:
            # with one rank there is nobody to differ from; rank 0 hashes while it writes
            # the replicated part, the biggest write, so the digests cost it next to nothing
            digests = (pool.submit(_digests, replicated)
                       if replicated is not None and world > 1 else None)
            if rank == 0 and commit.token and replicated is not None and early is None:
                try:
                    rep: dict[str, Item] = {**replicated, "save_id": commit.token}
                    self.recorder.save_item(rep, commit.temp / f"replicated{self._suffix}",
                                            _REPLICATED, allow_lossy=allow_lossy)
                except Exception as e:  # noqa: BLE001
                    early = e
            try:
                ours = None if digests is None else digests.result()
            except Exception as e:  # noqa: BLE001
                early = early or e
        theirs = commit.begin(ours)  # rank 0's digests, on every rank
        overrides = 0
        try:
            if early is not None:
                raise early
            if replicated is not None:
                local["overrides"] = _overrides(replicated, ours, theirs)
                overrides = len(local["overrides"])  # type: ignore[arg-type]
            local.update(rank=rank, world_size=world, save_id=commit.token)
            self.recorder.save_item(local, commit.temp / _part_name(rank, world, self._suffix),
                                    _PART, allow_lossy=allow_lossy)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, then it is raised
            commit.fail(e)
        else:
            commit.wrote(overrides)
        manifest = {
            "format": FORMAT, "version": list(VERSION), "trainrec": trainrec.__version__,
            "record": record_type, "world_size": world, "save_id": commit.token,
            "parts": [_part_name(r, world, self._suffix) for r in range(world)],
            "replicated": None if replicated is None else f"replicated{self._suffix}",
        }
        commit.finish(manifest)
        return path

    # -- load ------------------------------------------------------------------------------

    def read(self, args: Any, *, mmap: bool = False, rank: int | None = None) -> tuple[Header, Item]:
        """Header and item of this rank's view of the checkpoint `args` (the record it
        saved, whole). `rank=r` reads rank r's view in any process, without checking the
        world size. Raises `FileMissingError` when there is no committed checkpoint,
        `RecordMismatchError` for another world size (or rank out of range; `TypeError`
        for a rank that is not an int), and
        `CorruptRecordError` for a damaged or mixed-up directory.

        Without `rank`, reading is collective when the group has several ranks: every rank
        calls it, and when any rank's read fails every rank raises (the others a
        `RecorderError` naming that rank and its error), so no rank restores and then waits
        at its next collective for one that could not. With a `timeout`, a rank that does
        not join within it fails the others before any reads."""
        if rank is not None or _rank_world(self.group)[1] == 1:
            return self._read(args, mmap, rank)
        meet(self.group, self.timeout, "DistributedRecorder.load", path_arg(args))
        failure: Exception | None = None
        try:
            out: tuple[Header, Item] | None = self._read(args, mmap, None)
        except Exception as e:  # every rank learns of it before any restores
            failure, out = e, None
        agree(failure, self.group, str(path_arg(args)))
        assert out is not None
        return out

    def _read(self, args: Any, mmap: bool, rank: int | None) -> tuple[Header, Item]:
        path = path_arg(args)
        manifest = _read_manifest(path)
        world = manifest["world_size"]
        if rank is None:
            rank, live = _rank_world(self.group)
            if live != world:
                raise RecordMismatchError(
                    f"the checkpoint was saved by {world} rank(s), this run has {live}: each "
                    "rank's pending gradients and caller state (counters, RNG) are its own, "
                    f"and no rule maps them onto another number of ranks; resume with {world} "
                    "rank(s) (e.g. torchrun --nproc-per-node "
                    f"{world}), or read one rank's view with read(path, rank=r)",
                    source=str(path))
        elif isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        elif not 0 <= rank < world:
            raise RecordMismatchError(f"rank must be in [0, {world}): the checkpoint has "
                                      f"{world} rank(s), got {rank}", source=str(path))
        header, local = _read_part(path / manifest["parts"][rank], _PART, mmap)
        _expect_part(local, {"rank": rank, "world_size": world, "save_id": manifest["save_id"]},
                     path / manifest["parts"][rank])
        if manifest["replicated"] is None:
            if "item" not in local:
                raise CorruptRecordError(
                    f"{MANIFEST} names no replicated part, but this rank's part is one of a "
                    "TrainingRecord split into replicated and per-rank parts (the manifest was "
                    "edited)", source=str(path / MANIFEST), key="replicated")
            item = local.get("item")
        else:
            rep_path = path / manifest["replicated"]
            _, rep = _read_part(rep_path, _REPLICATED, mmap)
            _expect_part(rep, {"save_id": manifest["save_id"]}, rep_path)
            item = _merge(rep, local, rep_path)
        return dataclasses.replace(header, record_type=manifest["record"]), item


def read_distributed(path: Path, mmap: bool = False) -> tuple[Header, Item]:
    """The `trainrec.distributed` format's reader (`trainrec inspect` / `verify`, and
    `trainrec.read_file`): reads and checks every rank's view (each part's checksums, its
    rank and save id) and returns rank 0's."""
    recorder = DistributedRecorder()
    world = _read_manifest(Path(path))["world_size"]
    views = [recorder.read(path, mmap=mmap, rank=r) for r in range(world)]
    return dataclasses.replace(views[0][0], format=FORMAT, version=VERSION), views[0][1]


# -- what is replicated and what is a rank's own ---------------------------------------------


def _split(item: Item, record_type: str) -> tuple[dict[str, Item] | None, dict[str, Item]]:
    """(replicated part or None, this rank's part). A `TrainingRecord`'s model state,
    optimizer and scheduler are replicated; the model's pending `.grad`, the accumulator's
    pending gradients and the caller state are the rank's. Any other record is the rank's
    whole."""
    if record_type != _TRAINING or not isinstance(item, list) or len(item) != 5:
        return None, {"item": item}
    model, optimizer, scheduler, grads, state = item
    model_grads: Item = None
    if isinstance(model, dict) and model.get("kind") == _TORCH_MODULE:
        inner = model.get("state")
        if isinstance(inner, dict) and "grads" in inner:
            model_grads = inner["grads"]
            model = {**model, "state": {**inner, "grads": {}}}
    return ({"model": model, "optimizer": optimizer, "scheduler": scheduler},
            {"model_grads": model_grads, "grads": grads, "state": state})


def _merge(rep: dict[str, Item], local: dict[str, Item], source: Path) -> Item:
    if set(rep) != {"model", "optimizer", "scheduler", "save_id"} or not {
            "model_grads", "grads", "state", "overrides"} <= set(local):
        raise CorruptRecordError("a part of a distributed TrainingRecord lacks components",
                                 source=str(source))
    tree: Item = {k: rep[k] for k in ("model", "optimizer", "scheduler")}
    overrides = local["overrides"]
    if not isinstance(overrides, list):
        raise CorruptRecordError("overrides must be a list", source=str(source))
    for entry in overrides:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and all(isinstance(k, str) or type(k) is int for k in entry[0])):
            raise CorruptRecordError("an override must be [path of keys and indices, value]",
                                     source=str(source))
        at: Path_ = tuple(k for k in entry[0] if isinstance(k, (str, int)))
        tree = _set(tree, at, entry[1], at, source)
    if not (isinstance(tree, dict) and {"model", "optimizer", "scheduler"} <= set(tree)):
        raise CorruptRecordError("the overrides leave no model, optimizer and scheduler",
                                 source=str(source))
    model = tree["model"]
    if local["model_grads"] is not None:
        if not (isinstance(model, dict) and isinstance(model.get("state"), dict)):
            raise CorruptRecordError("the replicated model holds no state map", source=str(source))
        model = {**model, "state": {**model["state"], "grads": local["model_grads"]}}  # type: ignore[dict-item]
    return [model, tree["optimizer"], tree["scheduler"], local["grads"], local["state"]]


def _leaves(item: Item, at: Path_ = ()) -> list[tuple[Path_, Item]]:
    """Every leaf (tensor, scalar, empty container) with its path of keys and indices."""
    if isinstance(item, dict) and item:
        return [leaf for k, v in item.items() for leaf in _leaves(v, (*at, k))]
    if isinstance(item, list) and item:
        return [leaf for i, v in enumerate(item) for leaf in _leaves(v, (*at, i))]
    return [(at, item)]


def _digest(leaf: Item) -> bytes:
    """SHA-1 of a leaf's kind, dtype, shape and bytes: told apart from rank 0's to find
    accidental divergence, not forgery (SHA-1 is hardware-accelerated on most CPUs and
    releases the GIL, so tensors are hashed on several threads)."""
    h = hashlib.sha1(usedforsecurity=False)
    if isinstance(leaf, TensorData):
        h.update(f"T{leaf.dtype.value}{leaf.shape}".encode())
        h.update(np.ascontiguousarray(leaf.array).reshape(-1).view(np.uint8).data)
    else:
        h.update(f"{type(leaf).__name__}:{leaf!r}".encode())
    return h.digest()


def _digests(replicated: dict[str, Item]) -> tuple[bytes, list[bytes]]:
    """(digest of the tree's structure, digest of each leaf in order)."""
    leaves = _leaves(replicated)
    shape = hashlib.sha1(repr([p for p, _ in leaves]).encode(), usedforsecurity=False).digest()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return shape, list(pool.map(_digest, [v for _, v in leaves]))


def _overrides(replicated: dict[str, Item], ours: Any, theirs: Any) -> Item:
    """The leaves of this rank's replicated state that differ from rank 0's, as
    `[[path...], value]` pairs; the whole tree at the root path when its structure differs."""
    if ours == theirs:
        return []
    if ours[0] != theirs[0]:
        return [[[], dict(replicated)]]
    return [[list(p), v] for (p, v), a, b in zip(_leaves(replicated), ours[1], theirs[1]) if a != b]


def _set(tree: Item, at: Path_, value: Item, whole: Path_, source: Path) -> Item:
    """`tree` with the node at `at` replaced by `value` (`whole`: the override's path)."""
    if not at:
        return value
    head, rest = at[0], at[1:]
    if isinstance(tree, dict) and isinstance(head, str) and head in tree:
        return {**tree, head: _set(tree[head], rest, value, whole, source)}
    if isinstance(tree, list) and type(head) is int and 0 <= head < len(tree):
        return [*tree[:head], _set(tree[head], rest, value, whole, source), *tree[head + 1:]]
    raise CorruptRecordError(f"an override's path {list(whole)!r} is not in the replicated state",
                             source=str(source))


# -- the commit ----------------------------------------------------------------------------


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
        self._outcome: tuple[str, Any] = ("ok", 0)

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
        self.temp = self.path.parent / f".{self.path.name}.{self.token}{_TEMP_SUFFIX}"
        return payload

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
                    self._commit(manifest)
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

    def _commit(self, manifest: dict[str, Any]) -> None:
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


# -- collectives ---------------------------------------------------------------------------


def _rank_world(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _src(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _broadcast(message: list[Any], group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(message, src=_src(group), group=group)


def _all_gather(out: list[Any], value: Any, group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_gather_object(out, value, group=group)
    else:
        out[0] = value


def agree(failure: Exception | None, group: Any, source: str) -> None:
    """Collective, for loads: every rank tells the others whether its part went well. Raises
    this rank's own `failure`, else `RecorderError` naming the first rank that failed and
    its error, so that no rank restores while another cannot (and then waits for it at its
    next collective until the group's timeout)."""
    world = _rank_world(group)[1]
    outcomes: list[Any] = [None] * world
    if world > 1:
        _all_gather(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}",
                    group)
    if failure is not None:
        raise failure
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise RecorderError(f"rank {r} could not load its part of the checkpoint ({msg}); no "
                            "rank restores from it", source=source)


_NOT_COMMITTED = "nothing was committed, and earlier checkpoints are untouched"


def timeout_seconds(timeout: Any) -> float | None:
    """The distributed recorders' `timeout=`: seconds (a positive finite number or
    `datetime.timedelta`) as a float, or None. `TypeError` / `ValueError` otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError("timeout must be a number of seconds or a datetime.timedelta (or None: "
                        f"the process group's own timeout), got {type(timeout).__name__}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be positive and finite, got {timeout!r} (None waits as "
                         "long as the process group's own timeout)")
    return seconds


_meetings: dict[str, int] = {}  # group name -> meetings this process held on it


def meet(group: Any, timeout: float | None, what: str, path: Path) -> None:
    """With a `timeout` and several ranks: every rank of `group` meets before `what` (a save
    or load, e.g. "DCPRecorder.save") touches anything, in the group's store (not a
    collective: any backend, and never interleaved with the group's collectives). Returns
    once every rank arrived; raises `RecorderError` on every rank that arrived when one had
    not within `timeout` seconds of the first wait's start. The ranks agree on the outcome
    (the store's compare-and-set decides it once), so either all that arrived go on or all
    raise; one arriving after the others gave up raises at once.

    The ranks number their meetings on a group alike when every rank makes the same calls
    (after a failed one they are out of step, and every later one fails too); a meeting's
    keys are removed once the next one succeeded (every rank has left it by then)."""
    if timeout is None:
        return
    rank, world = _rank_world(group)
    if world == 1:
        return
    pg: Any = dist.group.WORLD if group is None else group
    name = str(pg.group_name)
    number = _meetings.get(name, 0)
    _meetings[name] = number + 1
    key = f"trainrec/meeting/{number}/{what}"
    outcome_key, arrived_key = f"{key}/outcome", f"{key}/arrived"
    try:
        get_store = getattr(pg, "get_group_store", None)
        store: Any = (get_store() if get_store is not None  # older torch: the private map
                      else dist.distributed_c10d._get_process_group_store(pg))
        store.set(f"{key}/rank/{rank}", "")
        if store.add(arrived_key, 1) == world:
            outcome = store.compare_set(outcome_key, "", "go")
        elif _appears(store, outcome_key, timeout):
            outcome = store.get(outcome_key)
        else:
            missing = [r for r in range(world) if not store.check([f"{key}/rank/{r}"])]
            outcome = store.compare_set(  # none missing: the last one is between its set and add
                outcome_key, "", "missing:" + ",".join(map(str, missing)) if missing else "go")
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if outcome == "go":  # every rank came here, so every rank has left the last meeting
            _forget_meeting(store, _previous.pop(name, None), rank)
            _previous[name] = key
            return
    except RuntimeError as e:  # the store is gone (its host, rank 0, died) or refuses
        raise RecorderError(f"the ranks could not meet before {what} in the process group's "
                            f"store: {e}", source=str(path)) from e
    missing = [int(r) for r in outcome.removeprefix("missing:").split(",") if r]
    done = ("nothing was written, and earlier checkpoints are untouched" if what.endswith("save")
            else "nothing was loaded: the live objects are unchanged")
    if rank in missing:
        happened = (f"this rank (rank {rank}) joined {what} more than {timeout:g} s after the "
                    "rank(s) waiting for it, which gave up")
    else:
        happened = (f"rank(s) {', '.join(map(str, missing))} of the process group did not "
                    f"join {what} within {timeout:g} s")
    raise RecorderError(
        f"{happened}: {what} is collective and must be called on every rank of the group (not "
        f"under `if rank == 0:`); {done}. The ranks are out of step now, and the process "
        "group may be unusable: restart the run", source=str(path))


_previous: dict[str, str] = {}  # group name -> the last meeting's keys, removed at the next


def _appears(store: Any, key: str, timeout: float) -> bool:
    """Whether `key` is in `store` within `timeout` seconds (polled: a store's own `wait`
    rounds a FileStore's timeout up to whole seconds, and a TCPStore logs each one)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.02)
    return True


def _forget_meeting(store: Any, key: str | None, rank: int) -> None:
    if key is None:
        return
    store.delete_key(f"{key}/rank/{rank}")
    if rank == 0:
        store.delete_key(f"{key}/arrived")
        store.delete_key(f"{key}/outcome")


def _collective(call: Any, path: Path, what: str, abandon: Any,
                outcome: str = _NOT_COMMITTED) -> None:
    """Run a collective; when it fails (a peer died, a timeout), `abandon` the save and
    raise `RecorderError` saying `outcome`."""
    try:
        call()
    except RuntimeError as e:  # gloo and NCCL errors (DistBackendError too) are RuntimeErrors
        abandon()
        raise RecorderError(
            f"the ranks could not meet while {what} (a rank died, or the process group timed "
            f"out: {e}); {outcome}", source=str(path)) from e


# -- reading -------------------------------------------------------------------------------


def _part_name(rank: int, world: int, suffix: str) -> str:
    return f"rank-{rank:05d}-of-{world:05d}{suffix}"


def _read_manifest(path: Path) -> dict[str, Any]:
    return read_manifest(path, FORMAT, VERSION, "DistributedRecorder", lambda doc: {
        "record": isinstance(doc.get("record"), str),
        "replicated": doc.get("replicated") is None or (
            isinstance(doc.get("replicated"), str) and _safe_name(doc["replicated"])),
    })


_OTHER_FORMATS = {
    "trainrec.distributed": "a DistributedRecorder checkpoint (DDP: whole tensors per rank): load "
                            "it with TrainingRecord.load(trainrec.adapters.torch.DistributedRecorder(), "
                            "path, device, state_type=...)",
    "trainrec.dcp": "a DCPRecorder checkpoint (sharded, torch.distributed.checkpoint): load it "
                    "with trainrec.adapters.torch.DCPRecorder().load(path, model, optimizer, scheduler)",
}


def read_manifest(
    path: Path, fmt: str, version: tuple[int, int], recorder: str,
    fields: Callable[[dict[str, Any]], dict[str, bool]],
) -> dict[str, Any]:
    """The manifest of the checkpoint directory `path` that `recorder` commits (format
    `fmt`), checked: the format and its major version, `world_size`, `save_id`, one safe
    part name per rank, and `fields(doc)` (each recorder's own: name -> well formed).
    `CorruptRecordError` naming the file and the field, or the recorder that reads a
    checkpoint of the other distributed format."""
    file = path / MANIFEST
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a folder above it we may not search
        raise RecorderError(f"cannot read the checkpoint: {type(e).__name__}: {e.strerror or e}",
                            source=str(path)) from e
    if not is_dir:
        raise FileMissingError(f"no committed {recorder} checkpoint here (a save commits its "
                               "directory by renaming it into place)", source=str(path))
    data = _read_json_bytes(file, path, recorder)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise CorruptRecordError(f"unreadable {MANIFEST}: {e}", source=str(file)) from e
    other = doc.get("format") if isinstance(doc, dict) else None
    if other != fmt and other in _OTHER_FORMATS:
        raise CorruptRecordError(f"this is {_OTHER_FORMATS[other]}, not a {recorder} one",
                                 source=str(path))
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CorruptRecordError(f"{MANIFEST} is not a {fmt} manifest", source=str(file))
    got = doc.get("version")
    if not (isinstance(got, list) and len(got) == 2 and all(type(v) is int for v in got)):
        raise CorruptRecordError("malformed version", source=str(file), key="version")
    if got[0] != version[0]:
        older = (" (written by an older trainrec, before the checks of format "
                 f"{version[0]}.0: load it with the trainrec that wrote it and save it again)"
                 if got[0] < version[0] else " (written by a newer trainrec: upgrade trainrec)")
        raise UnsupportedVersionError(f"format version {got[0]}.{got[1]}, this trainrec "
                                      f"reads {version[0]}.x{older}", source=str(file))
    world = doc.get("world_size")
    parts = doc.get("parts")
    checks = {
        "world_size": type(world) is int and world >= 1,
        "save_id": isinstance(doc.get("save_id"), str),
        "parts": isinstance(parts, list) and len(parts) == world and all(
            isinstance(p, str) and _safe_name(p) for p in parts),
        **fields(doc),
    }
    for key, ok in checks.items():
        if not ok:
            raise CorruptRecordError(f"malformed {key}" + (_parts_count(world, parts) if key == "parts" else ""),
                                     source=str(file), key=key)
    return doc


MANIFEST_LIMIT = 64 << 20
"""The largest `manifest.json` read (a DCP manifest holds about 60 bytes a shard entry:
about a million entries; a DDP one a few hundred bytes)."""


def _read_json_bytes(file: Path, path: Path, recorder: str) -> bytes:
    """The bytes of the manifest `file`, bounded: a FIFO or device is refused without
    blocking on it, a file larger than `MANIFEST_LIMIT` unread, and one with more than a
    container (`[`, `{`) in 8 bytes unparsed (each costs about 60 bytes parsed: a manifest
    holds one in about 40). A permission or I/O error is a `RecorderError` (not damage)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptRecordError(f"the directory holds no {MANIFEST}: it is not a checkpoint "
                                 f"{recorder} committed", source=str(path)) from None
    except OSError as e:
        raise RecorderError(f"{MANIFEST} cannot be opened: {type(e).__name__}: "
                            f"{e.strerror or e}", source=str(file)) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO blocked the read; /dev/zero never ended
            raise CorruptRecordError(f"{MANIFEST} is not a regular file", source=str(file))
        if info.st_size > MANIFEST_LIMIT:
            raise CorruptRecordError(f"{MANIFEST} holds {info.st_size} bytes, more than the "
                                     f"{MANIFEST_LIMIT} a manifest is read up to",
                                     source=str(file))
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            data = f.read(MANIFEST_LIMIT + 1)
    except OSError as e:
        raise RecorderError(f"{MANIFEST} cannot be read: {type(e).__name__}: {e.strerror or e}",
                            source=str(file)) from e
    finally:
        os.close(fd)
    if len(data) > MANIFEST_LIMIT:
        raise CorruptRecordError(f"{MANIFEST} holds more than {MANIFEST_LIMIT} bytes",
                                 source=str(file))
    if data.count(b"[") + data.count(b"{") > len(data) // 8 + 64:
        raise CorruptRecordError(f"{MANIFEST} holds more containers than a manifest does: "
                                 "refused unparsed", source=str(file))
    return data


def _parts_count(world: Any, parts: Any) -> str:
    """What is wrong when `parts` does not list one name per rank (else nothing)."""
    if type(world) is int and isinstance(parts, list) and len(parts) != world:
        return f": it lists {len(parts)} part(s), world_size says {world} (the manifest was edited)"
    return ""


def _safe_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _read_part(file: Path, record_type: str, mmap: bool) -> tuple[Header, dict[str, Item]]:
    if not file.is_file():
        raise CorruptRecordError("a part the manifest lists is missing", source=str(file))
    header, item = trainrec.read_file(file, mmap=mmap)
    if header.record_type != record_type or not isinstance(item, dict):
        raise CorruptRecordError(f"holds a {header.record_type}, not a {record_type}",
                                 source=str(file))
    return header, item


def _expect_part(item: dict[str, Item], fields: dict[str, Item], file: Path) -> None:
    for key, want in fields.items():
        if item.get(key) != want:
            raise CorruptRecordError(
                f"{key} is {item.get(key)!r}, the manifest says {want!r} (a part of another "
                "save, or of another rank)", source=str(file), key=key)
