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
they were.

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
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.utils import _create_file_view

import trainrec
from trainrec import (
    ChecksumError,
    CorruptRecordError,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    StateRecord,
)
from trainrec.adapter_kit import (
    Header,
    Item,
    crc32,
    expect_kind,
    field_changes,
    for_component,
    kind_mismatches,
    parse_changes,
    path_arg,
    settle,
)

from .bindings import TorchLrScheduler, TorchOptimizer, encode
from .dcp_metadata import METADATA, check_chunks, file_digest, open_regular, read_metadata
from .dcp_state import (
    Backup,
    group_names,
    has_state,
    load_optimizer,
    optimizer_target,
    state_dicts,
    write_model,
)
from .distributed import (
    _Commit,
    _rank_world,
    _safe_name,
    agree,
    meet,
    read_manifest,
    timeout_seconds,
)
from .identity import hyperparameter_fields, take_live_hyperparameters
from .wrappers import is_dtensor, named_parameters

__all__ = ["DCPRecorder", "DCPRestored", "read_dcp"]

FORMAT = "trainrec.dcp"
VERSION = (3, 0)  # 2.0: every shard file's size and CRC-32 in the manifest; 3.0: the
# .metadata's size and CRC-32 and the optimizer's class too
MANIFEST = "manifest.json"
DCP_DIR = "dcp"
_PART = "trainrec.dcp.part"
_META = "trainrec"  # the DCP entry that repeats the manifest's facts
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
        self._pending: Future[Path] | None = None

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
        The future raises what the save would have raised."""
        path = path_arg(path)
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
        commit = _Commit(path, rank, world, self.group)
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

        def finish() -> Path:
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
            return Path(path)

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
        naming it, on every other rank: none waits for it until the group's timeout."""
        if self._pending is not None:  # an async save's commit: its collectives run on this
            wait([self._pending])  # group, and the load may be of that very checkpoint
        # with a timeout, the ranks first meet in the group's store: a rank that never calls
        # load fails the others here, before any collective (`meet`)
        where = Path(str(path))  # for messages: `_prepare` checks the argument itself
        meet(self.group, self.timeout, "DCPRecorder.load", where)
        plan: _Load | None = None
        try:
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


def refuse_unsynced_gradients(model: nn.Module) -> None:
    """Raise `RecorderError` when an FSDP2 module holds gradients accumulated with
    `set_requires_gradient_sync(False)`: they live unsharded inside FSDP, where no public
    API reads or writes them, so no checkpoint can keep them."""
    for name, module in model.named_modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if (getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
                    or (unsharded is not None and unsharded.grad is not None)):
                raise RecorderError(
                    f"FSDP module {name or '<root>'!r} holds gradients accumulated with "
                    "set_requires_gradient_sync(False): they stay unsharded inside FSDP, and no "
                    "public API reads or restores them, so a checkpoint would lose them. "
                    "Checkpoint after the window's last (synced) backward, or accumulate with "
                    "gradient sync on (the default: each micro-step's gradient is "
                    "reduce-scattered into the sharded .grad, which DCPRecorder saves)",
                    key=f"model.{name}")


def _groups(osd: Any) -> list[list[str]]:
    """The parameter names of each param group of `get_state_dict`'s optimizer state dict."""
    return [sorted(str(n) for n in g.get("params", ())) for g in osd.get("param_groups", ())]


def _check_param_groups(loaded: dict[str, Any], live: list[dict[str, Any]], path: Path) -> None:
    """`RecordMismatchError` for the first param group entry DCP read (`optim.param_groups.
    {i}.{key}`) that set_state_dict would give the live optimizer although it does not fit:
    a `params` list other than the live group's (the group's hyperparameters would go to
    other parameters) or a hyperparameter of another kind than the live one's (an lr that
    is a str)."""
    prefix = "optim.param_groups."
    for name, value in sorted(loaded.items()):
        if not name.startswith(prefix):
            continue
        index, _, key = name.removeprefix(prefix).partition(".")
        at = f"optimizer.param_groups.{index}.{key}"
        group = live[int(index)] if index.isdigit() and int(index) < len(live) else None
        if group is None or key not in group:
            continue  # DCP reads only the live state dict's keys: one inside a nested value
        if key == "params":
            fits = isinstance(value, list) and sorted(map(str, value)) == sorted(
                map(str, group[key]))
            problems = [] if fits else [f"{at}: {value!r:.200} in the checkpoint, "
                                        f"{group[key]!r:.200} live"]
        else:
            try:
                like = encode(group[key], key)
            except (TypeError, ValueError, RecorderError):
                continue  # a live value that is no plain data: nothing to compare with
            try:
                problems = kind_mismatches(encode(value, key), like, at)
            except (TypeError, ValueError, RecorderError) as e:
                problems = [f"{at}: {type(value).__name__} in the checkpoint ({e})"]
        if problems:
            raise RecordMismatchError(
                f"the optimizer's param group entry does not fit the live optimizer: "
                f"{'; '.join(problems)}", key=at, source=str(path))


def _check_hyperparameters(loaded: dict[str, Any], live: list[dict[str, Any]], allow: frozenset[str],
                           kind: str, path: Path) -> frozenset[str]:
    """The hyperparameters DCP read (`optim.param_groups.{i}.{key}`) against the live
    groups', as `TorchOptimizer` compares them: the paths `allow` allows to differ;
    `RecordMismatchError` for any other difference."""
    prefix = "optim.param_groups."
    recorded: dict[int, dict[str, Item]] = {}
    for name, value in loaded.items():
        index, _, key = name.removeprefix(prefix).partition(".")
        if name.startswith(prefix) and index.isdigit() and key and "." not in key and key != "params":
            recorded.setdefault(int(index), {})[key] = encode(value, key)
    recorded_fields: dict[str, Item] = {}
    live_fields: dict[str, Item] = {}
    for gi, group in enumerate(live):
        at = f"optimizer.param_groups.{gi}"
        live_item = {k: encode(v, k) for k, v in group.items() if k != "params"}
        recorded_fields.update(hyperparameter_fields(recorded.get(gi, {}), at))
        live_fields.update(hyperparameter_fields(live_item, at))
    try:
        return settle(field_changes(recorded_fields, live_fields),
                      set(recorded_fields) | set(live_fields), allow,
                      f"the hyperparameters of the live {kind}",
                      "Build the optimizer with the hyperparameters of the run that saved it.")
    except RecordMismatchError as e:
        raise RecordMismatchError(str(e).removesuffix(f" (key {e.key!r})"), key=e.key,
                                  source=str(path)) from None


def _check_meta(meta: Any, manifest: dict[str, Any], path: Path) -> None:
    """Raise `CorruptRecordError` unless the facts saved inside the DCP checkpoint are the
    manifest's (the same save, the same pending gradients, optimizer state or none)."""
    try:
        doc = json.loads(meta)
        saved = {k: doc[k] for k in ("save_id", "grads", "optimizer_state", "optimizer",
                                     "param_groups")}
    except (TypeError, ValueError, KeyError):
        raise CorruptRecordError(f"the DCP checkpoint's {_META!r} entry is malformed",
                                 source=str(path / manifest["dcp"]), key=_META) from None
    for key in ("save_id", "grads", "optimizer_state", "optimizer"):
        if saved[key] != manifest[key]:
            raise CorruptRecordError(
                f"the DCP checkpoint says {key} {saved[key]!r}, {MANIFEST} says "
                f"{manifest[key]!r}: the manifest was edited, or the {manifest['dcp']}/ "
                "directory is another save's", source=str(path), key=key)


def _refuse_plain_gradients(model: nn.Module) -> None:
    """Raise `RecorderError` when, at world size > 1, a pending `.grad` is a plain tensor
    (DistributedDataParallel, or a model that is not sharded): DCP takes a plain tensor for
    the same on every rank and writes it once, but inside a `no_sync()` window each rank's
    partial sum is its own, so every rank would get one rank's back."""
    for name, p in named_parameters(model):
        if p.grad is not None and not is_dtensor(p.grad):
            raise RecorderError(
                f"the pending gradient of {name!r} is a plain tensor, not a sharded DTensor: "
                "DCP saves a plain tensor once, as if it were the same on every rank, but "
                "each rank's gradients inside an accumulation window (DDP's no_sync) are its "
                "own. Save a DistributedDataParallel run with trainrec.adapters.torch."
                "DistributedRecorder (each rank's pending gradients kept), or with "
                "DCPRecorder after the optimizer step (no pending .grad)",
                key=f"grads.{name}")


def _check_objects(model: Any, optimizer: Any, scheduler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ours = {id(p) for p in model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in ours for p in group["params"]):
            raise TypeError(f"param group {i} of the optimizer holds a parameter that is not "
                            "in the model: build the optimizer from model.parameters()")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise TypeError(f"scheduler must be a torch LR scheduler or None, got {type(scheduler).__name__}")


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


# -- checksums and safe reading ------------------------------------------------------------

_CHUNK = 8 << 20


class _Writer(FileSystemWriter):
    """DCP's file writer, remembering where it wrote each entry (file, offset, length):
    their checksums go into the manifest. DCP's `.metadata` names the save (`save_id`,
    DCP's own a random uuid): a `dcp/` folder of another save is told by it."""

    def __init__(self, folder: Path, save_id: str) -> None:
        super().__init__(str(folder))
        self.items: list[tuple[str, int, int]] = []
        self._save_id = save_id

    def storage_meta(self) -> Any:
        meta = super().storage_meta()
        if meta is not None:
            meta.save_id = self._save_id
        return meta

    def write_data(self, plan: Any, planner: Any) -> Any:
        done = super().write_data(plan, planner)
        done.wait()  # FileSystemWriter writes before it returns; this raises what failed
        self.items = sorted({(str(r.storage_data.relative_path), int(r.storage_data.offset),
                              int(r.storage_data.length)) for r in done.value()})
        return done


def _range_crc(f: Any, offset: int, length: int, buffer: memoryview) -> int:
    """CRC-32 of `length` bytes of the open file `f` from `offset`, read through `buffer`
    (`CorruptRecordError` when the file ends before)."""
    f.seek(offset)
    crc, left = 0, length
    while left:
        n = f.readinto(buffer[:min(left, len(buffer))])
        if not n:
            raise CorruptRecordError(f"ends {left} bytes before the entry at offset {offset} "
                                     f"of {length} bytes", source=str(f.name))
        crc = crc32(buffer[:n], crc)
        left -= n
    return crc


def _checksums(folder: Path, items: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """{file: {"size": bytes, "items": [[offset, length, CRC-32], ...]}} of the entries
    `items` (file, offset, length) this rank wrote into `folder`."""
    buffer = memoryview(bytearray(_CHUNK))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in sorted(set(items)):
        by_file.setdefault(name, []).append((offset, length))
    out: dict[str, Any] = {}
    for name, entries in by_file.items():
        with open(folder / name, "rb", buffering=0) as f:  # once a file, not once an entry
            out[name] = {"size": os.fstat(f.fileno()).st_size,
                         "items": [[o, n, _range_crc(f, o, n, buffer)] for o, n in entries]}
    return out


def _check_checksums(folder: Path, items: Iterable[tuple[str, int, int]],
                     shards: dict[str, dict[tuple[int, int], int]]) -> None:
    """`CorruptRecordError` for the first entry of `items` (file, offset, length) whose
    bytes are not those the save wrote (the manifest's CRC-32 of that entry)."""
    buffer = memoryview(bytearray(_CHUNK))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in set(items):
        by_file.setdefault(name, []).append((offset, length))
    for name in sorted(by_file):
        try:
            with open(folder / name, "rb", buffering=0) as f:
                for offset, length in sorted(by_file[name]):
                    want = shards.get(name, {}).get((offset, length))
                    if want is None:
                        raise CorruptRecordError(
                            f"DCP's .metadata points to {length} bytes at offset {offset} of "
                            f"shard file {name}, an entry the save did not write",
                            source=str(folder / name))
                    crc = _range_crc(f, offset, length, buffer)
                    if crc != want:
                        raise ChecksumError(
                            f"shard file {name} is damaged: the {length} bytes at offset "
                            f"{offset} have CRC-32 {crc:08x}, the save wrote {want:08x}",
                            source=str(folder / name))
        except FileNotFoundError as e:
            raise CorruptRecordError(f"shard file {name} is missing", source=str(folder / name)) from e
        except OSError as e:  # permissions, I/O: the file is not known to be damaged
            raise RecorderError(f"shard file {name} cannot be read: {type(e).__name__}: {e}",
                                source=str(folder / name)) from e


def _shards(manifest: dict[str, Any], path: Path) -> tuple[dict[str, int], dict[str, dict[tuple[int, int], int]]]:
    """The manifest's per-rank shard checksums as ({file: size}, {file: {(offset, length):
    CRC-32}}), each file named by one rank only."""
    sizes: dict[str, int] = {}
    crcs: dict[str, dict[tuple[int, int], int]] = {}
    for part in manifest["shards"]:
        for name, entry in part.items():
            if name in sizes:
                raise CorruptRecordError(f"{MANIFEST} lists shard file {name} twice",
                                         source=str(path), key="shards")
            sizes[name] = entry["size"]
            crcs[name] = {(o, n): c for o, n, c in entry["items"]}
    return sizes, crcs


def _well_formed_shards(doc: dict[str, Any]) -> bool:
    shards = doc.get("shards")
    return isinstance(shards, list) and len(shards) == doc.get("world_size") and all(
        isinstance(part, dict) and all(
            isinstance(name, str) and _safe_name(name) and isinstance(entry, dict)
            and set(entry) == {"size", "items"} and type(entry["size"]) is int
            and isinstance(entry["items"], list) and all(
                isinstance(i, list) and len(i) == 3 and all(type(v) is int and v >= 0 for v in i)
                for i in entry["items"])
            for name, entry in part.items())
        for part in shards)


class _Reader(FileSystemReader):
    """DCP's file reader, in two passes, so that a rejected load changes nothing live.

    In DCP's planning step (`prepare_local_plan`), every entry this rank will read
    (`verify=False`: every non-tensor entry) is checked against the CRC-32 the save
    recorded of its bytes, and the non-tensor entries are unpickled as plain values and
    `check`ed; DCP gathers every rank's failure and raises it on every rank before any
    reads. Only then are the entries read, the tensors into the live state, once `backup`
    has made the `Backup` a failure from there on is rolled back from. `error` keeps
    what refused the load on this rank (DCP wraps it in a `CheckpointException`);
    `reading` says the second pass began."""

    def __init__(self, folder: Path, metadata: Any, shards: dict[str, dict[tuple[int, int], int]],
                 group: Any, check: Callable[[dict[str, Any]], None], verify: bool = True,
                 backup: Callable[[], Backup] | None = None) -> None:
        super().__init__(str(folder))
        self.folder, self.metadata, self.shards = folder, metadata, shards
        self.group, self.check, self.verify = group, check, verify
        self.make_backup = backup
        self.backup: Backup | None = None
        self.error: Exception | None = None
        self.refused: Exception | None = None
        self.reading = False
        self.plain: dict[str, Any] = {}  # the non-tensor entries, checked, for `_Planner`

    @classmethod
    def refusing(cls, error: Exception, group: Any, path: Path) -> _Reader:
        """The reader of a rank whose own checks failed (`error`): DCP plans nothing for it
        (an empty state dict and metadata), and its `read_data` tells the other ranks."""
        reader = cls(path / DCP_DIR, Metadata(state_dict_metadata={}, storage_data={}), {}, group,
                     lambda loaded: None)
        reader.refused = reader.error = error
        return reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata  # read once, without unpickling anything but DCP's metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP calls this on every rank with what the rank will read, in its planning step,
        whose failures DCP gathers and raises on every rank before any rank reads: the
        checks go here, and need no round of their own."""
        try:
            if self.refused is not None:
                raise self.refused
            items: list[ReadItem] = list(plan.items)
            raw = [i for i in items if i.type == LoadItemType.BYTE_IO]
            where = [self.storage_data[i.storage_index] for i in (items if self.verify else raw)]
            _check_checksums(self.folder, {(str(w.relative_path), int(w.offset), int(w.length))
                                           for w in where}, self.shards)
            self.plain = self._plain_values(raw)
            self.check(self.plain)
        except Exception as e:
            self.error = e  # DCP raises a CheckpointException; `load` raises this instead
            raise
        return super().prepare_local_plan(plan)

    def _plain_values(self, items: list[ReadItem]) -> dict[str, Any]:
        """The non-tensor entries `items` by name, unpickled as plain values only."""
        out: dict[str, Any] = {}
        files: dict[str, list[ReadItem]] = {}
        for item in items:
            files.setdefault(str(self.storage_data[item.storage_index].relative_path), []).append(item)
        for name, some in files.items():
            with open(self.folder / name, "rb") as f:
                for item in some:
                    where = self.storage_data[item.storage_index]
                    f.seek(int(where.offset))
                    out[item.dest_index.fqn] = _plain_load(io.BytesIO(f.read(int(where.length))),
                                                           item.dest_index.fqn)
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        """DCP's read, except that a tensor entry whose bytes are exactly its live target's
        (`_read_in_place`) is read straight into it, where DCP would `torch.load` it into a
        new tensor and copy that; and that the non-tensor entries are the values checked
        in the planning step, not read again."""
        if self.make_backup is not None:
            self.backup = self.make_backup()  # nothing live changed yet when this fails
        self.reading = True  # every rank's checks passed: now into the live state
        if isinstance(planner, _Planner):
            planner.plain = self.plain
        rest: list[ReadItem] = []
        files: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                if isinstance(planner, _Planner) and item.dest_index.fqn in self.plain:
                    planner.load_bytes(item, io.BytesIO())  # the checked value
                else:
                    rest.append(item)
            else:
                where = self.storage_data[item.storage_index]
                files.setdefault(str(where.relative_path), []).append(item)
        for name, items in files.items():
            with open(self.folder / name, "rb") as f:
                rest.extend(i for i in items
                            if not _read_in_place(f, self.storage_data[i.storage_index], i, planner))
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


_LEGACY_STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128}
"""The storage classes `torch.save` names for these dtypes (its `persistent_id`); others are
saved as `torch.storage.UntypedStorage` with `_rebuild_tensor_v3` and the dtype."""


@dataclass(frozen=True)
class _Layout:
    """Where a tensor saved by `torch.save` keeps its bytes: storage `key` of `nbytes`
    bytes, and the tensor's dtype, storage offset, shape and strides in it."""

    dtype: torch.dtype
    key: str
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Untyped:
    """`torch.storage.UntypedStorage`, as named in the pickle (nothing is built)."""


@dataclass(frozen=True)
class _Typed:
    """A typed storage class of `_LEGACY_STORAGES`, as named in the pickle: its dtype (a
    dtype named where the pickle names a storage class is refused, as `torch.load` does)."""

    dtype: torch.dtype


class _LayoutUnpickler(pickle._Unpickler):
    """Reads the pickle `torch.save` writes for one plain tensor,
    `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` (or `_v3`,
    which adds the dtype), into a `_Layout`, building nothing; any other global is refused,
    and the entry goes DCP's way. Python's unpickler, whose memo is a dict: C's grows an
    array to twice the index a memo opcode names (a 40-byte pickle asks gigabytes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _layout_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _layout_v3
        if module == "torch" and name in _LEGACY_STORAGES:
            return _Typed(_LEGACY_STORAGES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _Untyped
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise _ForbiddenError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel): checked by `_layout`


def _layout_v2(storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any,
               hooks: Any, metadata: Any = None) -> _Layout:
    """`torch._utils._rebuild_tensor_v2`'s arguments, as a `_Layout`."""
    return _layout(storage, None, offset, shape, stride, hooks, metadata)


def _layout_v3(storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any,
               hooks: Any, dtype: Any, metadata: Any = None) -> _Layout:
    """`torch._utils._rebuild_tensor_v3`'s arguments (a dtype the storage does not name)."""
    return _layout(storage, dtype, offset, shape, stride, hooks, metadata)


def _layout(storage: Any, dtype: Any, offset: Any, shape: Any, stride: Any, hooks: Any,
            metadata: Any) -> _Layout:
    def sizes(v: Any) -> bool:
        return isinstance(v, tuple) and all(type(i) is int and i >= 0 for i in v)

    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"
            and type(storage[2]) is str and type(storage[4]) is int and storage[4] >= 0
            and type(offset) is int and sizes(shape) and sizes(stride)
            and len(shape) == len(stride) and not hooks and not metadata):
        raise _ForbiddenError("not a plain tensor")
    kind = storage[1]
    if kind is _Untyped and isinstance(dtype, torch.dtype):
        nbytes = storage[4]  # an untyped storage counts bytes
    elif isinstance(kind, _Typed) and dtype is None:
        dtype, nbytes = kind.dtype, storage[4] * kind.dtype.itemsize  # a typed one, elements
    else:
        raise _ForbiddenError("not a plain tensor")
    return _Layout(dtype, storage[2], nbytes, offset, shape, stride)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _read_in_place(f: Any, where: Any, item: ReadItem, planner: LoadPlanner) -> bool:
    """Read the tensor entry `item`, stored at `where` in the open file `f`, straight into
    its live target and return True, when the entry's bytes are exactly the target's: one
    whole tensor saved by `torch.save` (no DCP transform), contiguous, in this machine's
    byte order, of the target's dtype and shape, the target a contiguous plain CPU tensor.
    Else return False, having read nothing into it: DCP reads that entry its own way (and
    raises what is wrong with it)."""
    if getattr(where, "transform_descriptors", None) or any(item.storage_offsets):
        return False
    target = planner.resolve_tensor(item).detach()
    if (type(target) is not torch.Tensor or target.device.type != "cpu"
            or target.layout != torch.strided or not target.is_contiguous() or target.is_conj()
            or target.is_neg() or target.is_quantized or target.is_inference()
            or tuple(item.lengths) != tuple(target.shape)):
        return False
    begin, length = int(where.offset), int(where.length)
    try:
        zipped = torch._C.PyTorchFileReader(cast(Any, _create_file_view(f, begin, length)))  # torch.load's
        if zipped.get_record("byteorder") != sys.byteorder.encode():
            return False  # torch.load swaps such bytes
        layout = _LayoutUnpickler(io.BytesIO(zipped.get_record("data.pkl"))).load()
        record = f"data/{layout.key}"
        start = cast(Any, zipped).get_record_offset(record)  # as torch.load(mmap=True) finds it
        size = zipped.get_record_size(record)
        header = cast(Any, zipped).get_record_header_offset(record)
        f.seek(begin + header)
        local = f.read(_LOCAL_HEADER)
    except Exception:  # noqa: BLE001 - not one plain tensor as torch.save writes it
        return False
    if not _stored_at(local, header, start):
        return False  # torch.load inflates a compressed record; this would read it raw
    nbytes = target.numel() * target.element_size()
    if (not isinstance(layout, _Layout) or layout.dtype != target.dtype
            or layout.shape != tuple(target.shape) or layout.offset != 0
            or layout.stride != _contiguous_strides(layout.shape) or layout.nbytes != nbytes
            or size != nbytes
            or type(start) is not int or start < 0 or start + nbytes > length):
        return False
    f.seek(begin + start)
    into = target.reshape(-1).view(torch.uint8).numpy().data  # the target's own bytes
    done = 0
    while done < nbytes:
        n = f.readinto(into[done:])
        if not n:
            raise CorruptRecordError(f"ends {nbytes - done} bytes before the end of the tensor "
                                     f"entry {item.dest_index.fqn!r}", source=str(f.name))
        done += n
    torch.autograd.graph.increment_version(target)  # as `copy_` does: a saved graph sees it
    planner.commit_tensor(item, target)
    return True


_LOCAL_HEADER = 30
"""The bytes of a zip local file header before its name and extra field."""


def _stored_at(local: bytes, header: int, start: int) -> bool:
    """Whether `local`, the zip local file header at `header`, is one of a record stored
    as it is (not compressed, not encrypted) whose bytes begin at `start`."""
    if type(header) is not int or len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        return False
    flags, method = int.from_bytes(local[6:8], "little"), int.from_bytes(local[8:10], "little")
    name, extra = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    return not flags & 1 and method == 0 and header + _LOCAL_HEADER + name + extra == start


def _refused_elsewhere(error: BaseException) -> tuple[int, BaseException] | None:
    """The first rank that failed, and its error, of DCP's `CheckpointException`, or None."""
    failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
    for rank, wrapped in sorted((failures or {}).items()):
        return rank, (wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    return None


def _plain_load(value: io.BytesIO, name: str) -> Any:
    """A DCP non-tensor entry's value, unpickled by `torch.load(weights_only=True)`."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler raises anything
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptRecordError(f"the DCP entry {name!r} holds something other than plain "
                                 f"values, refused unread ({reason})", key=name) from e


try:  # where DefaultLoadPlanner.load_bytes puts a value (torch 2.2 to 2.13)
    from torch.distributed.checkpoint._traverse import set_element as _set_element
except ImportError:  # pragma: no cover - then the value is pickled again for DCP's own
    _set_element = None  # type: ignore[assignment]


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor entries are the values `_Reader`
    unpickled with `torch.load(weights_only=True)` and checked (DCP's own `load_bytes`
    uses `weights_only=False`, which runs whatever a hostile file holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: dict[str, Any] = {}  # set by `_Reader`: the entries it unpickled and checked

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        # the value `_Reader` checked, not DCP's second read of its bytes (a file changed
        # in between cannot bring another value in)
        obj = self.plain[name] if name in self.plain else _plain_load(value, name)
        if _set_element is not None and self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[name], obj)
            return
        safe = io.BytesIO()
        torch.save(obj, safe)  # DCP unpickles this, made from the checked value
        safe.seek(0)
        super().load_bytes(read_item, safe)


class _ForbiddenError(Exception):
    pass


def read_dcp(path: Path, mmap: bool = False) -> tuple[Header, Item]:
    """The `trainrec.dcp` format's reader (`trainrec inspect` / `verify`, and
    `trainrec.read_file`), in one process without a process group: the manifest, every
    rank's part (scheduler and caller state; their checksums checked), and what DCP's
    `.metadata` says of each entry (dtype and shape, not the values: loading them needs
    `DCPRecorder().load`), after checking `.metadata` and every shard file against the size
    and CRC-32 the save recorded in the manifest (a missing, truncated or changed shard
    file is refused). `checked` says how many entries (and bytes) were checked."""
    del mmap
    path = Path(path)
    manifest = _read_manifest(path)
    parts = [_read_part(path, manifest, r) for r in range(manifest["world_size"])]
    header = dataclasses.replace(trainrec.read_file(path / manifest["parts"][0])[0],
                                 format=FORMAT, version=VERSION, record_type="TrainingRecord")
    metadata, crcs = _checked_metadata(path, manifest)
    where = {(str(w.relative_path), int(w.offset), int(w.length))
             for w in metadata.storage_data.values()}
    _check_checksums(path / manifest["dcp"], where, crcs)
    entries: dict[str, Item] = {}
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            entries[key] = f"{dtype}{list(meta.size)}"
        else:
            entries[key] = "bytes"
    fields = ("world_size", "save_id", "grads", "optimizer_state", "optimizer", "scheduler",
              "state")
    item: dict[str, Item] = {
        "manifest": {k: manifest.get(k) for k in fields},
        "dcp": entries,
        "parts": [{"scheduler": p.get("scheduler"), "state": p.get("state")} for p in parts],
        "checked": {"entries": len(where), "bytes": sum(n for _, _, n in where),
                    "metadata_bytes": manifest["metadata"]["size"]},
    }
    return header, item


def _checked_metadata(path: Path, manifest: dict[str, Any]) -> tuple[Any, dict[str, dict[tuple[int, int], int]]]:
    """DCP's `.metadata` of the checkpoint `path` (`dcp_metadata.read_metadata`: bounded,
    its size and CRC-32 the save's, DCP's classes only, every value of its kind) and the
    manifest's CRC-32 of each shard entry, after checking that the chunks tile every
    tensor, that every shard file it names exists, holds the bytes it points to and is one
    the manifest has the checksum of, of that size, and the reverse (`CorruptRecordError`).
    The bytes themselves are checked as they are read."""
    folder = path / manifest["dcp"]
    sizes, crcs = _shards(manifest, path)
    entries = sum(len(v) for v in crcs.values())
    metadata = read_metadata(folder, manifest["metadata"], manifest["save_id"], entries)
    check_chunks(metadata, folder)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = str(info.relative_path)
        if not (type(info.offset) is int and type(info.length) is int
                and info.offset >= 0 and info.length >= 0):
            # DCP slices the file with them: a float passed every check, then failed
            # DCP's read of the tensors after some live ones had changed
            raise CorruptRecordError(
                f"DCP's .metadata gives the entry in shard file {name!r} offset "
                f"{info.offset!r} and length {info.length!r}, not byte counts",
                source=str(folder))
        if not _safe_name(name):
            raise CorruptRecordError(f"DCP's .metadata names a shard file {name!r} outside "
                                     "the checkpoint", source=str(folder))
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        if name not in sizes:
            raise CorruptRecordError(f"shard file {name} has no checksum in {MANIFEST}",
                                     source=str(folder / name))
        fd = open_regular(folder / name, f"shard file {name}")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < end:
            raise CorruptRecordError(f"shard file {name} holds {size} bytes, DCP's .metadata "
                                     f"points to {end}", source=str(folder / name))
        if size != sizes[name]:
            raise CorruptRecordError(f"shard file {name} holds {size} bytes, the save wrote "
                                     f"{sizes[name]}", source=str(folder / name))
    unread = sorted(set(sizes) - set(ends))
    if unread:
        raise CorruptRecordError(f"{MANIFEST} lists shard file {unread[0]}, which DCP's "
                                 ".metadata does not name", source=str(folder))
    return metadata, crcs


def _check_shapes(metadata: Any, target: dict[str, Any], path: Path) -> None:
    """`RecordMismatchError` naming the first model parameter or pending gradient whose
    saved shape or dtype is not the live one's (DCP's own error is a traceback per rank)."""
    saved = metadata.state_dict_metadata
    for group in ("model", "grads"):
        for name, t in target[group].items():
            meta = saved.get(f"{group}.{name}")
            if not isinstance(t, torch.Tensor) or meta is None:
                continue  # DCP names a missing key itself
            if not isinstance(meta, TensorStorageMetadata):
                raise RecordMismatchError(f"{group}.{name} is not a tensor in the checkpoint",
                                          key=f"{group}.{name}", source=str(path))
            if tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
                raise RecordMismatchError(
                    f"{group}.{name} is {str(meta.properties.dtype).removeprefix('torch.')}"
                    f"{list(meta.size)} in the checkpoint, "
                    f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} in the live model: "
                    "build the model the run that saved it had", key=f"{group}.{name}",
                    source=str(path))


def _part_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.mpk"


def _read_manifest(path: Path) -> dict[str, Any]:
    doc = read_manifest(path, FORMAT, VERSION, "DCPRecorder", lambda doc: {
        "dcp": isinstance(doc.get("dcp"), str) and _safe_name(doc["dcp"]),
        "grads": isinstance(doc.get("grads"), list) and all(isinstance(g, str) for g in doc["grads"]),
        "optimizer_state": isinstance(doc.get("optimizer_state"), bool),
        "shards": _well_formed_shards(doc),
        "metadata": isinstance(doc.get("metadata"), dict) and set(doc["metadata"]) == {
            "size", "crc32"} and all(type(v) is int and v >= 0 for v in doc["metadata"].values()),
        "optimizer": isinstance(doc.get("optimizer"), str),
    })
    return doc


def _read_part(path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    file = path / manifest["parts"][rank]
    if not file.is_file():
        raise CorruptRecordError("a part the manifest lists is missing", source=str(file))
    header, item = trainrec.read_file(file)
    if header.record_type != _PART or not isinstance(item, dict):
        raise CorruptRecordError(f"holds a {header.record_type}, not a {_PART}", source=str(file))
    want = {"rank": rank, "world_size": manifest["world_size"], "save_id": manifest["save_id"]}
    for key, value in want.items():
        if item.get(key) != value:
            raise CorruptRecordError(
                f"{key} is {item.get(key)!r}, the manifest says {value!r} (a part of another "
                "save, or of another rank)", source=str(file), key=key)
    return item
