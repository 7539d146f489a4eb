"""`DCPRecorder`: one checkpoint of a sharded (FSDP2, `fully_shard`) run, written through
`torch.distributed.checkpoint` (DCP) and committed once.

A save is collective: every rank calls `DCPRecorder().save(path, model, optimizer,
scheduler, state)`. The directory holds

- `dcp/`: one DCP checkpoint (`.metadata` and `__{rank}_0.distcp` files), written by
  `dcp.save` from `{"model": ..., "optim": ..., "grads": ...}`: the model's and optimizer's
  state dicts from `torch.distributed.checkpoint.state_dict.get_state_dict` (sharded
  `DTensor`s under the plain model's parameter names), and the pending gradients, each
  parameter's `.grad` (a sharded `DTensor` that FSDP2 reduce-scatters and accumulates
  every micro-step), under the same names;
- `rank-{r:05d}-of-{n:05d}.mpk`, by rank r (`NamedMpkFileRecorder`, every dtype kept): the
  scheduler's state and the caller's state (counters, `TorchRngRecord`), each rank's own;
- `manifest.json`, by rank 0, last: format `trainrec.dcp`, version, world size, the save's id
  (which every part repeats), the part names, the parameters with a pending gradient,
  whether the optimizer had state, and the CRC-32 of every entry DCP wrote (`shards`; DCP
  keeps no checksums of its own).

The commit is `DistributedRecorder`'s (`_Commit`, spec/PROTOCOLS.md, "Distributed
records"): DCP and the parts are written into a temp directory next to `path`, and rank 0
renames it to `path` only when every rank's writes succeeded. `path` exists exactly when the
checkpoint is complete; a rank that fails or dies mid-save leaves earlier checkpoints as
they were. At a store URL each rank writes into a private local temporary folder and
uploads its files, and rank 0 writes one commit object last (`_UrlCommit`); a load
downloads the committed checkpoint, checked, and loads from there.

A load is collective too (`dcp.load` plans with the other ranks). Every rank checks what
it can first; in DCP's planning step each rank checks the CRC-32 of every entry it will
read and the non-tensor entries (unpickled as plain values only), and DCP raises any
rank's failure on every rank; only then does DCP read the tensors, in place, into the live state (as a
plain `dcp.load` does; an entry whose bytes are exactly its live CPU tensor's is read
straight into it, without DCP's new tensor and copy), so a rejected load changes nothing on
any rank. Model, optimizer
and pending gradients are read into the live run's own sharding, so a checkpoint of n
ranks loads into m ranks with every value unchanged (resharding). The scheduler is
replicated (the same on every rank). The caller's state is each rank's own, and nothing maps
n ranks' states onto m: at another world size `load` refuses unless `rank_state` says what
to do (`"drop"`: no caller state; an int r: rank r's state on every rank).

`save(..., async_save=True)` copies the state, starts `dcp.async_save` and returns a
`Future`; a background thread waits for DCP's write, then meets the other ranks and commits,
on a process group of its own (the group DCP itself asks for its `async_save`).

`set_requires_gradient_sync(False)` keeps the micro-steps' gradients unsharded inside FSDP
(`FSDPParam`'s unsharded gradient), which no public API reads or writes: a save then is
refused, saying how to accumulate instead.

This module is the recorder itself (`DCPRecorder.save` / `load` and the rollback); each
thing it is built from is a module of its own beside it: `dcp_layout` (the directory's
names, manifest and parts; `read_dcp`, re-exported here), `dcp_checks` (the live objects
and what DCP read, checked against each other), `dcp_checksum` (the CRC-32 of every entry),
`dcp_reader` (the two-pass reader), `dcp_zip` (the in-place read of a tensor entry),
`dcp_unpickle` (the restricted unpicklers), `dcp_metadata` (DCP's `.metadata`, bounded)
and `dcp_state` (the state dicts and the backup a failed read is rolled back from).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import trainrec
from trainrec import (
    CorruptRecordError,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    StateRecord,
)
from trainrec.adapter_kit import (
    expect_kind,
    folders,
    for_component,
    location,
    parse_changes,
    path_arg,
)

from .bindings import TorchLrScheduler, TorchOptimizer
from .dcp_checks import (
    _check_hyperparameters,
    _check_meta,
    _check_objects,
    _check_param_groups,
    _check_shapes,
    _groups,
    _refuse_plain_gradients,
    refuse_unsynced_gradients,
)
from .dcp_checksum import _checksums, _Writer
from .dcp_layout import (
    _META,
    _PART,
    DCP_DIR,
    FORMAT,
    MANIFEST,
    VERSION,
    _checked_metadata,
    _part_name,
    _read_manifest,
    _read_part,
    read_dcp,
)
from .dcp_metadata import METADATA, file_digest
from .dcp_reader import _Reader
from .dcp_state import (
    Backup,
    group_names,
    has_state,
    load_optimizer,
    optimizer_target,
    state_dicts,
    write_model,
)
from .dcp_unpickle import _Planner
from .distributed_collectives import _rank_world, agree, meet, timeout_seconds
from .distributed_commit import commit_for
from .identity import take_live_hyperparameters
from .wrappers import is_dtensor, named_parameters

__all__ = ["DCPRecorder", "DCPRestored", "read_dcp"]

_NATIVE = NativePrecisionSettings()

U = TypeVar("U")


@dataclass
class DCPRestored(Generic[U]):
    """What `DCPRecorder.load` returns: the caller's state (None when the checkpoint has none,
    or `rank_state="drop"`) and the world size the checkpoint was saved with."""

    state: U | None
    saved_world_size: int


class DCPRecorder:
    """Saves and loads an FSDP2 (`fully_shard`) run's checkpoint through
    `torch.distributed.checkpoint`: model, optimizer and pending `.grad` as DCP (sharded,
    resharded on load), the scheduler and each rank's caller state beside it, one commit.

    `group`: the process group whose ranks save together (default: the world). `timeout`
    (seconds or a `datetime.timedelta`; default None: the group's own): before `save` and
    `load` touch anything, the ranks meet, and when one has not joined within `timeout`
    the others raise `RecorderError` naming it, nothing written or loaded (as
    `DistributedRecorder`'s `timeout`; the meeting is in the calling thread, also for
    `async_save=True`).

    Example::

        rec = trt.DCPRecorder()
        state.rng = trt.TorchRngRecord.capture()
        rec.save(root / f"step-{micro:08d}", model, optimizer, scheduler, state)  # every rank
        ...
        state = rec.load(path, model, optimizer, scheduler, state_type=State).state
        state.rng.apply()

    `save(..., async_save=True)` returns a `Future` of the path once the state is copied:
    `dcp.async_save` writes it and the commit follows in a background thread, on a process
    group of its own (`DCPRecorder(group=dist.new_group(backend="gloo"))`; see `save`).
    """

    def __init__(self, *, group: Any = None,
                 timeout: float | datetime.timedelta | None = None) -> None:
        self.group = group
        self.timeout = timeout_seconds(timeout)
        self._pending: Future[Path | str] | None = None

    def __repr__(self) -> str:
        return "DCPRecorder()" if self.timeout is None else f"DCPRecorder(timeout={self.timeout:g})"

    # -- save ------------------------------------------------------------------------------

    def save(self, path: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, state: Any = None, *, async_save: bool = False) -> Any:
        """Collective: write the checkpoint `path` (a directory that must not exist yet) and
        return it once rank 0 committed it. Every rank raises `RecorderError` when any rank
        failed, and nothing is committed.

        `async_save=True` returns a `concurrent.futures.Future` of the `Path` as soon as the
        state is staged (copied; training may go on and change it) and this rank's part is
        written: `dcp.async_save` writes the shards in a background thread, which then meets
        the other ranks and commits. Its collectives run on `group`, which must then be a
        process group of its own, not one training uses (e.g. `dist.new_group(backend="gloo")`,
        as DCP asks for its own `async_save`); a second save first waits for the previous one.
        The future raises what the save would have raised.

        `path` may be a store URL (`s3://...`, `memory://...`): every rank stages its files
        in a private local temporary folder and uploads them, and rank 0 writes the commit
        object `.trainrec-commit` last (spec/PROTOCOLS.md, "Checkpoints on object stores");
        the `Path` returned is then the URL (a `str`)."""
        path = location(path)
        _check_objects(model, optimizer, scheduler)
        if state is not None and not hasattr(state, "into_item"):
            raise TypeError(f"state must be a Record (e.g. a @trainrec.record dataclass) or "
                            f"None, got {type(state).__name__}")
        rank, world = _rank_world(self.group)
        if async_save and world > 1 and self.group is None:
            raise ValueError(
                "async_save=True runs the commit's collectives in a background thread: give "
                "DCPRecorder a process group of its own, DCPRecorder(group=dist.new_group("
                "backend='gloo')), so they never interleave with training's")
        refuse_unsynced_gradients(model)
        if world > 1:
            _refuse_plain_gradients(model)
        if self._pending is not None:
            wait([self._pending])  # its outcome is its own future's
        meet(self.group, self.timeout, "DCPRecorder.save", path)
        commit = commit_for(path, rank, world, self.group)
        if rank == 0:
            commit.prepare()
        commit.begin(None)
        params = dict(named_parameters(model))
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        had_state = has_state(optimizer)
        kind = TorchOptimizer(optimizer).kind
        upload: Future[Any] | None = None
        failed: BaseException | None = None
        writer = _Writer(commit.temp / DCP_DIR, commit.token)
        try:
            msd, osd = state_dicts(model, optimizer)
            part = {
                "rank": rank, "world_size": world, "save_id": commit.token,
                "scheduler": None if scheduler is None
                else TorchLrScheduler(scheduler).into_record().into_item(_NATIVE),
                "state": None if state is None else state.into_item(_NATIVE),
            }
            NamedMpkFileRecorder(_NATIVE).save_item(
                part, commit.temp / _part_name(rank, world), _PART)
            # what the manifest says, inside DCP's own files too: a load checks the two
            # agree (a manifest edited, or the dcp/ directory of another save swapped in)
            meta = json.dumps({"save_id": commit.token, "grads": sorted(grads),
                               "optimizer_state": had_state, "optimizer": kind,
                               "param_groups": _groups(osd)}, sort_keys=True)
            tree = {"model": msd, "optim": osd, "grads": grads, _META: meta}
            if async_save:
                # staged here: DCP's stager refuses FSDP2's parameter storages ("invalid
                # python storage", torch 2.13), and a copy is what staging makes anyway
                tree = _copy(tree)
                upload = dcp_async_save(tree, storage_writer=writer,  # type: ignore[assignment]
                                        process_group=self.group)  # a Future: no async_stager given
            else:
                dcp_save(tree, storage_writer=writer, process_group=self.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must hear of
            failed = e  # it, then it is raised (DCP's CheckpointException is a BaseException)
        manifest = {
            "format": FORMAT, "version": list(VERSION), "trainrec": trainrec.__version__,
            "record": "TrainingRecord", "world_size": world, "save_id": commit.token,
            "parts": [_part_name(r, world) for r in range(world)], "dcp": DCP_DIR,
            "grads": sorted(grads), "optimizer_state": had_state, "optimizer": kind,
            "scheduler": scheduler is not None, "state": state is not None,
        }

        def finish() -> Path | str:
            error = failed
            shards: dict[str, Any] = {}
            if error is None:
                try:
                    if upload is not None:
                        upload.result()
                    shards = _checksums(commit.temp / DCP_DIR, writer.items)
                    if rank == 0:  # DCP's coordinator wrote it: which bytes are which entry
                        manifest["metadata"] = file_digest(commit.temp / DCP_DIR / METADATA)
                except (Exception, CheckpointException) as e:  # noqa: BLE001
                    error = e
            if error is None:
                commit.wrote(shards)
            elif isinstance(error, Exception):
                commit.fail(error)
            else:
                commit.fail(RecorderError(f"torch.distributed.checkpoint could not save: {error}",
                                          source=str(path)))
            commit.finish(manifest, "shards")  # each rank's shard files' sizes and CRC-32s
            done: Path | str = path  # a URL's save: the URL
            return done

        if not async_save:
            return finish()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainrec-dcp-commit")
        self._pending = pool.submit(finish)
        pool.shutdown(wait=False)  # the thread ends with `finish`
        return self._pending

    # -- load ------------------------------------------------------------------------------

    def load(self, path: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, *, state_type: type[U] | None = None,
             rank_state: str | int = "own", verify: bool = True,
             allow_changes: Iterable[str] | None = None) -> DCPRestored[U]:
        """Collective: restore the checkpoint `path` into the live (sharded) `model`,
        `optimizer` and `scheduler`, pending `.grad` included, and return the caller's state
        rebuilt as `state_type` (the raw item tree without one).

        At the saved world size every rank gets its own state. At another world size model,
        optimizer and gradients are resharded, and `rank_state` chooses the caller state:
        `"own"` (default) refuses with `RecordMismatchError`, `"drop"` returns none, an int r
        gives every rank rank r's (its RNG too: the ranks then draw alike unless the caller
        reseeds). Everything is checked before the live objects change: a rejected load
        leaves them as they were. The optimizer must be of the saved one's class
        (`RecordMismatchError` naming both), and gets the saved state whatever its own
        `state` holds (entries made by reading `opt.state[p]` included). A failure after
        the checks (in DCP's read, or while the optimizer or scheduler take their state) is
        a `RecorderError` on every rank, and every rank's live objects are rolled back to
        what they held (from a host copy of the model's state tensors taken just before
        the read).

        The schedule's constructor arguments and functions and the optimizer's
        hyperparameters are compared with the live ones as `TrainingRecord.restore` compares
        them: a difference is a `RecordMismatchError` naming it before anything changes,
        unless `allow_changes` (e.g. `{"scheduler.T_max", "optimizer.weight_decay"}`)
        names it; an allowed field keeps its live value.

        After `save(..., async_save=True)` on this recorder, `load` first waits for that save
        to commit (its outcome is its future's).

        `verify` (default True): check the CRC-32 of every entry this rank reads before
        reading any into the live state; a changed byte is then a `ChecksumError` and
        nothing changes. It reads those bytes twice (from the page cache the second time,
        when they fit). `verify=False` checks only the non-tensor entries' and trusts the
        tensors' bytes, as a plain `dcp.load` does: a changed byte inside a tensor then
        loads as a wrong value, or fails DCP's read (rolled back); `trainrec verify DIR`
        checks every entry offline.

        What is wrong on one rank only (its part, its arguments) is raised on that rank and,
        naming it, on every other rank: none waits for it until the group's timeout.

        A store URL's checkpoint is downloaded first, every rank the whole of it, into a
        private local temporary folder (each object checked against its commit entry as it
        streams in; deleted after the load), and read there; errors name the URLs."""
        if self._pending is not None:  # an async save's commit: its collectives run on this
            wait([self._pending])  # group, and the load may be of that very checkpoint
        # with a timeout, the ranks first meet in the group's store: a rank that never calls
        # load fails the others here, before any collective (`meet`)
        where = Path(str(path))  # for messages: `_prepare` checks the argument itself
        meet(self.group, self.timeout, "DCPRecorder.load", where)
        url = location(path) if isinstance(path, str) else None
        if not isinstance(url, str):
            return self._load(path, model, optimizer, scheduler, state_type, rank_state, verify,
                              allow_changes, None)
        with contextlib.ExitStack() as stack:
            early: Exception | None = None
            local: Any = where
            urls = {str(where): url}
            try:
                local, urls = stack.enter_context(folders.staged(url))
            except Exception as e:  # noqa: BLE001 - told to every rank in DCP's planning step
                early = e
            try:
                return self._load(local, model, optimizer, scheduler, state_type, rank_state,
                                  verify, allow_changes, early)
            except RecorderError as e:
                raise folders.renamed(e, urls) from e.__cause__
        raise AssertionError("unreachable")  # pragma: no cover

    def _load(self, path: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: Any, state_type: type[U] | None, rank_state: str | int, verify: bool,
              allow_changes: Iterable[str] | None, early: Exception | None) -> DCPRestored[U]:
        """`load` once the ranks met (`early`: what already failed on this rank)."""
        where = Path(str(path))
        plan: _Load | None = None
        try:
            if early is not None:
                raise early
            plan = self._prepare(path, model, optimizer, scheduler, state_type, rank_state,
                                 verify, parse_changes(allow_changes))
            reader = plan.reader
        except Exception as e:  # noqa: BLE001 - every rank learns of it before any reads
            if _rank_world(self.group)[1] == 1:
                raise
            # a rank that cannot load still takes part in DCP's collectives, with nothing
            # to read, and fails DCP's planning step (`_Reader.prepare_local_plan`), which
            # DCP tells every rank, instead of leaving them waiting until the group's timeout
            reader = _Reader.refusing(e, self.group, where)
        source = str(reader.folder.parent)
        try:
            dcp_load({} if plan is None else plan.target, storage_reader=reader,
                     planner=_Planner(), process_group=self.group)
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            if reader.error is not None:
                raise reader.error from None  # a check refused it: nothing was read
            refused = _refused_elsewhere(e)
            if refused is not None and not reader.reading:
                rank, error = refused
                raise RecorderError(f"rank {rank} could not load its part of the checkpoint "
                                    f"({type(error).__name__}: {error}); no rank restores "
                                    "from it", source=source) from None
            if not reader.reading:
                raise RecorderError(f"torch.distributed.checkpoint could not load the model, "
                                    f"optimizer and pending gradients: {e}", source=source) from e
            back = _roll_back(reader.backup)
            if not verify:
                raise RecorderError(
                    f"torch.distributed.checkpoint failed while reading the tensors: {e}. With "
                    "verify=False their bytes are not checked before the read, so a damaged "
                    f"entry fails only here; {back}. Load with verify=True (the default), which "
                    "refuses a damaged entry before anything changes, or run `trainrec verify` "
                    "on the checkpoint", source=source) from e
            raise RecorderError(
                "torch.distributed.checkpoint failed while reading the tensors, after every "
                f"check had passed (were the files changed during the load?): {e}; {back}",
                source=source) from e
        assert plan is not None and reader.backup is not None  # a refusing reader raised
        failure: Exception | None = None
        try:
            _write_live(plan, model, optimizer, scheduler)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, then roll back
            failure = e
        except BaseException as e:  # an interrupt: never leave a mix
            _roll_back(reader.backup)
            raise e from None
        try:  # every rank hears whether every other's went well: all keep it, or none
            agree(failure, self.group, source)
        except Exception as e:  # noqa: BLE001 - ours, another rank's, or a rank died
            failure = failure or e
        if failure is not None:
            back = _roll_back(reader.backup)
            raise RecorderError(
                "the live model, optimizer and scheduler could not take the checkpoint's state "
                f"({type(failure).__name__}: {failure}); {back}", source=source) from failure
        return DCPRestored(plan.state, plan.manifest["world_size"])

    def _prepare(self, path: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, state_type: Any, rank_state: str | int, verify: bool,
                 allow: frozenset[str] = frozenset()) -> _Load:
        """This rank's checks, before the ranks meet: the manifest, the optimizer's class,
        its part, the caller state and scheduler rebuilt, DCP's metadata (its checksum)
        against the live shapes; and what DCP reads into (the live model's tensors
        themselves, as a plain dcp.load does; new tensors for the optimizer state and the
        pending gradients; `_Reader` reads only after its checks)."""
        if type(verify) is not bool:
            raise TypeError(f"verify must be True or False, got {verify!r}")
        path = path_arg(path)
        _check_objects(model, optimizer, scheduler)
        if scheduler is None and for_component(allow, "scheduler"):
            raise ValueError("allow_changes names scheduler fields but scheduler=None was given")
        manifest = _read_manifest(path)
        try:  # the class, as `TrainingRecord.restore` checks it
            expect_kind(StateRecord(manifest["optimizer"], None), TorchOptimizer(optimizer).kind,
                        "optimizer")
        except RecordMismatchError as e:
            said = str(e).removesuffix(" (key 'optimizer')")
            raise RecordMismatchError(
                f"the checkpoint's {said}: build the "
                "optimizer the run that saved it had (its state and hyperparameters are of that "
                "class)", key="optimizer", source=str(path)) from None
        saved = manifest["world_size"]
        rank, world = _rank_world(self.group)
        if rank_state == "own":
            if saved != world:
                raise RecordMismatchError(
                    f"the checkpoint was saved by {saved} rank(s), this run has {world}: the "
                    "model, optimizer and pending gradients reshard, but each rank's caller "
                    "state (counters, RNG) is its own and no rule maps it onto another number "
                    "of ranks; pass rank_state='drop' (no caller state) or rank_state=r (rank "
                    f"r's on every rank), or resume with {saved} rank(s)", source=str(path))
            source: int | None = rank
        elif rank_state == "drop":
            source = None
        elif type(rank_state) is int:
            if not 0 <= rank_state < saved:
                raise ValueError(f"rank_state must be a rank in [0, {saved}), got {rank_state}")
            source = rank_state
        else:
            raise ValueError(f"rank_state must be 'own', 'drop' or a rank (int), got {rank_state!r}")
        # the scheduler is replicated: rank 0's part holds it when ours is not read
        part = _read_part(path, manifest, 0 if source is None else source)
        params = dict(named_parameters(model))
        missing = [n for n in manifest["grads"] if n not in params]
        if missing:
            raise RecordMismatchError("pending gradient for a parameter the model lacks",
                                      key=f"grads.{missing[0]}", source=str(path))
        sched_record = None
        if scheduler is None and part.get("scheduler") is not None:
            held = part["scheduler"]
            kind = held.get("kind") if isinstance(held, dict) else None
            raise RecordMismatchError(f"the checkpoint holds the state of an LR scheduler ({kind}) "
                                      "but scheduler=None was given: build the scheduler on the "
                                      "optimizer as the run that saved it did (it sets each param "
                                      "group's initial_lr) and pass it", key="scheduler",
                                      source=str(path))
        if scheduler is not None:
            if part.get("scheduler") is None:
                raise RecordMismatchError("the checkpoint holds no scheduler state, a scheduler "
                                          "was given", key="scheduler", source=str(path))
            sched_record = StateRecord.from_item(part["scheduler"], None, key="scheduler")
            TorchLrScheduler(scheduler).check_record(
                sched_record, allow_changes=for_component(allow, "scheduler"))
        state: Any = None
        if source is not None and part.get("state") is not None:
            device = _local_device(model)
            item = part["state"]
            try:
                state = item if state_type is None else state_type.from_item(item, device)
            except RecorderError:
                raise
            except (TypeError, ValueError, KeyError) as e:
                raise CorruptRecordError(f"caller state does not rebuild: {e}", key="state",
                                         source=str(path)) from e
        folder = path / manifest["dcp"]
        metadata, crcs = _checked_metadata(path, manifest)
        msd, osd = state_dicts(model, optimizer)
        names = group_names(osd)
        by_name = {n: params[n] for group in names for n in group if n in params}
        optim_state = optimizer_target(metadata, osd, by_name, path)
        if bool(optim_state) != manifest["optimizer_state"]:
            raise CorruptRecordError(
                f"{MANIFEST} says the optimizer {'had' if manifest['optimizer_state'] else 'had no'}"
                f" state, DCP's .metadata holds {'none' if not optim_state else 'some'}: the "
                f"manifest was edited, or the {manifest['dcp']}/ directory is another save's",
                source=str(path), key="optimizer_state")
        target = {"model": msd, "optim": {"state": optim_state, "param_groups": osd["param_groups"]},
                  "grads": {n: torch.empty_like(params[n].detach()) for n in manifest["grads"]},
                  _META: ""}
        _check_shapes(metadata, target, path)
        live_groups = _groups(osd)
        # DCP reads the non-tensor entries into `osd` itself: the live values, kept apart
        live_hyper = [dict(g) for g in osd.get("param_groups", ())]
        accepted: set[str] = set()  # hyperparameters allowed to differ: they stay live

        def check(loaded: dict[str, Any]) -> None:
            _check_meta(loaded.get(_META), manifest, path)
            saved_groups = json.loads(loaded[_META])["param_groups"]
            if saved_groups != live_groups:
                raise RecordMismatchError(
                    f"the optimizer's param groups differ: the checkpoint's hold {saved_groups}, "
                    f"the live optimizer's {live_groups}; build the optimizer with the same "
                    "param groups as the run that saved it", key="optimizer.param_groups",
                    source=str(path))
            _check_param_groups(loaded, live_hyper, path)
            accepted.update(_check_hyperparameters(loaded, live_hyper, for_component(allow, "optimizer"),
                                                   TorchOptimizer(optimizer).kind, path))

        def backup() -> Backup:
            return Backup(msd, params, optimizer, scheduler)

        return _Load(path, manifest, params, target, names, state, sched_record,
                     _Reader(folder, metadata, crcs, self.group, check, verify, backup),
                     for_component(allow, "scheduler"), accepted, live_hyper)


@dataclass
class _Load:
    """What `DCPRecorder._prepare` found and made, for `load`."""

    path: Path
    manifest: dict[str, Any]
    params: dict[str, Any]
    target: dict[str, Any]
    names: list[list[str]]  # each live param group's parameter names, in order
    state: Any
    scheduler: StateRecord | None
    reader: _Reader
    scheduler_changes: frozenset[str]  # the scheduler's fields allowed to differ
    accepted: set[str]  # the hyperparameters allowed to differ (once the reader checked)
    live_hyper: list[dict[str, Any]]  # the live param groups before the read


def _write_live(plan: _Load, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any) -> None:
    """After DCP's read (the model's tensors are read in place): the model's state dict,
    the optimizer's state, the pending `.grad`s (None where none was saved), the scheduler."""
    write_model(model, plan.target["model"])
    for gi, (group, live) in enumerate(zip(plan.target["optim"]["param_groups"], plan.live_hyper)):
        take_live_hyperparameters(group, live, frozenset(plan.accepted), f"optimizer.param_groups.{gi}")
    load_optimizer(optimizer, plan.target["optim"], plan.names)
    for n, p in plan.params.items():
        p.grad = plan.target["grads"].get(n)
    if scheduler is not None and plan.scheduler is not None:
        TorchLrScheduler(scheduler).load_record(plan.scheduler, allow_changes=plan.scheduler_changes)


def _roll_back(backup: Backup | None) -> str:
    """Put the live objects back as `backup` kept them; what happened, for the message."""
    if backup is None:
        return "nothing had been read into the live objects"
    try:
        backup.restore()
    except Exception as e:  # noqa: BLE001 - said in the message
        return (f"the rollback failed too ({type(e).__name__}: {e}): the model, optimizer, "
                "pending gradients and scheduler may be partly restored")
    return "the live model, optimizer, pending gradients and scheduler were rolled back"


def _local_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.to_local().device if is_dtensor(p) else p.device  # type: ignore[attr-defined]
    return torch.device("cpu")


def _copy(tree: Any) -> Any:
    """The state dict with every tensor copied (a DTensor stays one, its shard copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _refused_elsewhere(error: BaseException) -> tuple[int, BaseException] | None:
    """The first rank that failed, and its error, of DCP's `CheckpointException`, or None."""
    failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
    for rank, wrapped in sorted((failures or {}).items()):
        return rank, (wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    return None
