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

At a store URL (`s3://...`, `memory://...`) the same steps commit with objects
(`_UrlCommit`, spec/PROTOCOLS.md "Checkpoints on object stores"): every rank writes its
part into a private local temporary folder and uploads it, and rank 0 writes the manifest
and the one commit object `.trainrec-commit` last; a load downloads the manifest, the
replicated part and this rank's part, checked against the commit, and reads them there.

A recorder of `torch.distributed.checkpoint` directories reuses the same commit
(`commit_for`): DCP writes its files into the temp directory, the commit renames (or
uploads and commits) it.

This module is the recorder itself; what it is built from is beside it, one idea a
module: `distributed_replicated` (what is written once and what per rank),
`distributed_commit` (the all-or-nothing commit), `distributed_collectives` (the ranks'
outcomes gathered, `meet`) and `distributed_manifest` (the manifest and parts, read
bounded and checked).
"""

from __future__ import annotations

import dataclasses
import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import trainrec
from trainrec import (
    CorruptRecordError,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
)
from trainrec.adapter_kit import Header, Item, RecorderBase, folders, location

from .distributed_collectives import _rank_world, agree, meet, timeout_seconds
from .distributed_commit import commit_for
from .distributed_manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    _expect_part,
    _part_name,
    _read_manifest,
    _read_part,
)
from .distributed_replicated import _digests, _merge, _overrides, _split

__all__ = ["DistributedRecorder"]

_PART = "trainrec.distributed.part"
_REPLICATED = "trainrec.distributed.replicated"


class DistributedRecorder(RecorderBase):
    """Saves a data-parallel run's checkpoint as one directory (args: its path, which must
    not exist yet, or a store URL that holds no checkpoint yet; output: the `Path`, or the
    URL), every rank's part written by that rank and
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
    ) -> Path | str:
        """Collective: write this rank's part of `item` into the checkpoint `args` (a
        local path, or a store URL: committed by its `.trainrec-commit` object) and return
        it (a `Path`, or the URL) once rank 0 committed it. Every rank raises `RecorderError`
        when any rank failed (its own error on the rank that failed), and nothing is
        committed. With a `timeout`, a rank that does not join within it fails the others
        first."""
        path = location(args)
        meet(self.group, self.timeout, "DistributedRecorder.save", path)  # type: ignore[arg-type]
        rank, world = _rank_world(self.group)
        commit = commit_for(path, rank, world, self.group)
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
        meet(self.group, self.timeout, "DistributedRecorder.load", location(args))  # type: ignore[arg-type]
        failure: Exception | None = None
        try:
            out: tuple[Header, Item] | None = self._read(args, mmap, None)
        except Exception as e:  # every rank learns of it before any restores
            failure, out = e, None
        agree(failure, self.group, str(location(args)))
        assert out is not None
        return out

    def _read(self, args: Any, mmap: bool, rank: int | None) -> tuple[Header, Item]:
        where = location(args)
        if not isinstance(where, str):
            return self._read_local(where, mmap, rank)
        live = self._rank_of(rank)
        own = None if live is None else f"rank-{live:05d}-"

        def wanted(name: str) -> bool:  # this rank's part, not the others'
            return own is None or not name.startswith("rank-") or name.startswith(own)

        return folders.read_staged_folder(
            where, lambda local: self._read_local(local, False, rank), wanted)

    def _rank_of(self, rank: int | None) -> int | None:
        if rank is None:
            return _rank_world(self.group)[0]
        return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None

    def _read_local(self, path: Path, mmap: bool, rank: int | None) -> tuple[Header, Item]:
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
