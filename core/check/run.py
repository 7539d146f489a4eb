"""The processes of `trainrec check`: `python -m trainrec.check.run ROLE ...`.

Each role reports, besides its result, its start-up: the seconds from its launch
(`--launched`) until the workload was imported (the interpreter, trainrec, the framework).

- `reference`: trains the workload without stopping for `--steps` micro-steps; from the
  first `--at` on it writes a snapshot of the whole training state after every micro-step
  (model, optimizer, scheduler, pending gradients, caller state, the batch the micro-step
  reported), and at each `--at K` it also saves a checkpoint with the chosen recorder (the
  same capture as the snapshot: a checkpoint does not change the run).
- `resume`: a fresh process that builds the workload, restores the checkpoint of `--at K`
  (through the recorder, or the workload's own `load_checkpoint`), runs `after_restore`,
  and compares its training state with the reference's snapshot right after the restore
  and after every following micro-step; writes what differs, component by component, as
  JSON. `--drop-pending` restores without the pending gradients (the curve `--plot` draws
  beside the real one).

Under `trainrec check --nproc N` every role runs as N ranks, each with the environment
`torchrun` gives (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); each
rank compares its own state with the same rank's reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..items.tree import Item
from ..precision import NativePrecisionSettings
from ..recorders.namedmpk import NamedMpkBytesRecorder
from ..training.accumulator import GradientsAccumulator
from ..training.record import TrainingRecord
from ..workload.fingerprint import fingerprint
from ..workload.loop import Parts, Workload
from .state import (
    COLLECTIVE,
    as_map,
    compare,
    components_of,
    named_recorder,
    rng_fields,
)

__all__ = ["run_role"]

_NATIVE = NativePrecisionSettings()
_SNAPSHOTS = NamedMpkBytesRecorder(_NATIVE)
"""Snapshots are scratch files, written plainly (no fsync, no rename): the reference's
result file, written last, is what tells a resume that all of them are there."""
_MAX_KEYS = 24  # differing keys kept per micro-step (the maximum is over all of them)


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# -- the roles ------------------------------------------------------------------------------


def _capture(workload: Workload, parts: Parts) -> TrainingRecord[Any]:
    workload.before_capture(parts)
    return TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                  parts.accumulator, parts.state)


def _snapshot(workload: Workload, parts: Parts, record: TrainingRecord[Any],
              batches: list[Item]) -> dict[str, Item]:
    parts_item = components_of(record.into_item(_NATIVE), rng_fields(workload, parts.state))
    parts_item["data"] = batches
    return parts_item


def _extras(parts: Parts) -> dict[str, Item]:
    return {"values": {str(k): fingerprint(v, ids=False) for k, v in parts.extras.items()},
            "types": {str(k): type(v).__name__ for k, v in parts.extras.items()}}


def _step(workload: Workload, parts: Parts, window: int) -> tuple[list[Item], float]:
    """One micro-step as `train_until` runs it; the batches it reported and its time."""
    parts.batches.clear()
    t0 = time.perf_counter()
    workload.micro_step(parts)
    parts.state.micro += 1
    if parts.state.micro % window == 0:
        workload.apply_window(parts, window)
    took = time.perf_counter() - t0
    return list(parts.batches), took


def _checkpoint_path(workdir: Path, at: int, recorder: Any) -> Path:
    rank, world = _rank_world()
    shared = world == 1 or type(recorder).__name__ in COLLECTIVE
    return workdir / "ckpt" / (f"{at}" if shared else f"{at}-r{rank}")


def _save(workload: Workload, parts: Parts, record: TrainingRecord[Any], recorder: Any,
          path: Path) -> None:
    own = getattr(workload, "save_checkpoint", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    if callable(own):
        own(parts, path)
    elif hasattr(recorder, "save_item"):
        if isinstance(recorder, NamedMpkBytesRecorder):
            path.write_bytes(record.save(recorder, None))
        else:
            record.save(recorder, path)
    else:  # a recorder of live objects (DCPRecorder)
        recorder.save(path, parts.model, parts.optimizer, parts.scheduler, parts.state)


def _restore(workload: Workload, parts: Parts, recorder: Any, path: Path,
             drop_pending: bool) -> Item:
    """Restore the checkpoint into `parts`; the record as loaded (None when the workload's
    own `load_checkpoint` or a recorder of live objects did the load)."""
    own = getattr(workload, "load_checkpoint", None)
    if callable(own):
        own(parts, path)
        if drop_pending:
            parts.accumulator = GradientsAccumulator()
        return None
    if not hasattr(recorder, "save_item"):
        restored_live = recorder.load(path, parts.model, parts.optimizer, parts.scheduler,
                                      state_type=workload.state_type)
        parts.state = restored_live.state
        workload.after_restore(parts)
        return None
    args: Any = path.read_bytes() if isinstance(recorder, NamedMpkBytesRecorder) else path
    record = TrainingRecord.load(recorder, args, workload.device, state_type=workload.state_type)
    loaded = record.into_item(_NATIVE)
    restored = record.restore(parts.model, parts.optimizer, parts.scheduler, workload.device)
    parts.model = restored.model
    parts.state = restored.state
    parts.accumulator = GradientsAccumulator() if drop_pending else restored.accumulator
    workload.after_restore(parts)
    return loaded


def _snapshot_path(workdir: Path, micro: int) -> Path:
    rank, _ = _rank_world()
    return workdir / "ref" / f"r{rank}" / f"{micro}.mpk"


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(tmp, path)


def _reference(workload: Workload, a: argparse.Namespace, recorder: Any) -> dict[str, Any]:
    parts = workload.build(a.seed)
    first, ats = min(a.at), set(a.at)
    train_s = snap_s = save_s = 0.0
    batches: list[Item] = []
    extras: dict[str, Item] = {}
    while True:
        micro = parts.state.micro
        if micro >= first:
            t0 = time.perf_counter()
            record = _capture(workload, parts)
            path = _snapshot_path(a.workdir, micro)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_SNAPSHOTS.save_item(_snapshot(workload, parts, record, batches),
                                                  None, "CheckSnapshot"))
            snap_s += time.perf_counter() - t0
            if micro in ats:
                extras[str(micro)] = _extras(parts)
                t0 = time.perf_counter()
                _save(workload, parts, record, recorder, _checkpoint_path(a.workdir, micro, recorder))
                save_s += time.perf_counter() - t0
        if micro >= a.steps:
            break
        batches, took = _step(workload, parts, a.window)
        train_s += took
    return {"train_s": train_s, "snapshot_s": snap_s, "save_s": save_s, "extras": extras,
            "steps": a.steps, "window": a.window, "at": a.at}


def _wait_for_reference(after: Path, pids: list[int]) -> None:
    """Wait until the same rank's uninterrupted run has written its result (then every
    snapshot and checkpoint is in place); raise when it failed or ended without one."""
    rank, _ = _rank_world()
    out = after.with_name(f"{after.name}-r{rank}.json")
    pid = pids[rank] if rank < len(pids) else None
    while not out.exists():
        if pid is not None and not _alive(pid):
            if out.exists():
                break
            raise RuntimeError("the uninterrupted run ended without a result")
        time.sleep(0.05)
    if "error" in json.loads(out.read_text(encoding="utf-8")):
        raise RuntimeError("the uninterrupted run failed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - another user's process took the pid
        return True
    try:  # a child of another process that has ended but not been waited for
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _resume(workload: Workload, a: argparse.Namespace, recorder: Any) -> dict[str, Any]:
    (at,) = a.at
    parts = workload.build(a.seed)
    if a.after is not None:
        _wait_for_reference(a.after, a.after_pid)
    t0 = time.perf_counter()
    loaded = _restore(workload, parts, recorder, _checkpoint_path(a.workdir, at, recorder),
                      a.drop_pending)
    restore_s = time.perf_counter() - t0
    if parts.state.micro != at:
        raise RuntimeError(f"the restored state's micro is {parts.state.micro}, the checkpoint "
                           f"was taken after micro-step {at}")
    steps: list[dict[str, Any]] = []
    saved: list[tuple[str, str, float]] = []
    extras = _extras(parts)
    batches: list[Item] = []
    train_s = 0.0
    while True:
        micro = parts.state.micro
        _, ref = _SNAPSHOTS.read(_snapshot_path(a.workdir, micro).read_bytes())
        assert isinstance(ref, dict)
        if loaded is not None:  # what the checkpoint holds, before after_restore ran
            rng = rng_fields(workload, parts.state)
            saved = [r for r in compare(ref, components_of(loaded, rng))
                     if r[0] not in ("data",)]
            loaded = None
        got = _snapshot(workload, parts, _capture(workload, parts), batches)
        if micro == at:
            got["data"] = ref.get("data")  # no batch consumed since the restore
        rows = compare(ref, got)
        worst: dict[str, float] = {}
        for component, _, gap in rows:
            worst[component] = max(worst.get(component, 0.0), gap)
        steps.append({"micro": micro, "diffs": rows[:_MAX_KEYS], "worst": worst,
                      "pending": [len(as_map(ref.get("pending"))), len(as_map(got.get("pending")))],
                      "reported": bool(batches) and micro > at,
                      "data": [ref.get("data"), got.get("data")] if any(r[0] == "data" for r in rows) else None})
        if micro >= a.steps:
            break
        batches, took = _step(workload, parts, a.window)
        train_s += took
    return {"at": at, "saved": saved, "steps": steps, "extras": extras, "train_s": train_s,
            "restore_s": restore_s,
            "own_checkpoint": callable(getattr(workload, "load_checkpoint", None))}


def run_role(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m trainrec.check.run ROLE ...`; writes its result as JSON to
    `--out` (an `{"error": ...}` with the traceback when the workload raised, exit 3)."""
    p = argparse.ArgumentParser(prog="python -m trainrec.check.run")
    p.add_argument("role", choices=["reference", "resume"])
    p.add_argument("--workload", required=True, help="module:attr naming the workload")
    p.add_argument("--steps", type=int, help="default: three windows")
    p.add_argument("--window", type=int, help="default: the workload's")
    p.add_argument("--at", nargs="+", required=True,
                   help="micro-steps, or `default` (trainrec.check.resume.default_ats); the role "
                        "writes what it resolved to OUT's stem + .resolved.json once the "
                        "workload is imported, or a refusal (`usage`, exit 2) to OUT")
    p.add_argument("--recorder", default="mpk")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop-pending", action="store_true")
    p.add_argument("--after", type=Path, help="resume: wait for the uninterrupted run's "
                   "result (AFTER-r{rank}.json) before the restore")
    p.add_argument("--after-pid", type=int, nargs="+", default=[],
                   help="the uninterrupted run's process of each rank (one that ended without a "
                        "result fails the resume)")
    p.add_argument("--launched", type=float, help="time.time() when the driver started this")
    a = p.parse_args(argv)
    rank, world = _rank_world()
    from .resume import _load, settle

    try:
        try:
            workload = _load(a.workload)
            recorder = named_recorder(workload, a.recorder)
            a.steps, a.window, a.at = settle(
                workload, None if a.at == ["default"] else [int(k) for k in a.at], a.steps,
                a.window, a.recorder)
        except (ValueError, TypeError) as e:  # what check_resume refuses: exit 2 there
            _write_json(a.out, {"error": f"{type(e).__name__}: {e}", "usage": str(e),
                                "usage_type": type(e).__name__, "traceback": ""})
            return 2
        _write_json(a.out.with_name(a.out.stem + ".resolved.json"),
                    {"steps": a.steps, "window": a.window, "at": a.at})
        startup = {} if a.launched is None else {"startup_s": time.time() - a.launched}
        result = {**(_reference if a.role == "reference" else _resume)(workload, a, recorder),
                  **startup}
    except BaseException as e:  # the workload's own failure, reported to the driver
        import traceback

        _write_json(a.out, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        code = 3
    else:
        _write_json(a.out, {**result, "rank": rank})
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    if world > 1:  # gloo can abort a rank at interpreter teardown (see tests/ddp_run.py)
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(run_role())
