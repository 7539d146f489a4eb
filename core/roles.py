"""The processes of an exact-continuation run: `python -m trainrec.roles ROLE ...`.

Each role runs a `Workload` in a process of its own, so that a resume starts from
nothing but the checkpoint file:

- `reference`: train all micro-steps without stopping and save the final record;
- `checkpoint`: train to micro-step K, save a TrainingRecord, exit;
- `train`: as `checkpoint`, then keep training until killed (`trainrec demo` kills it);
- `resume`: load the checkpoint, restore, train to the end, save the final record
  (`--drop-pending` restores without the pending gradients, to show that they matter).
  Given several checkpoints (and as many `--out` files), it resumes each in turn into
  objects freshly built from the seed: the process has trained nothing when the first
  one loads, and no resume starts from objects an earlier one touched.

`trainrec demo` and the conformance suite's fresh-process test run these; their final
records are compared with `trainrec.items.tree.compare_items`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .precision import NativePrecisionSettings
from .recorders.namedmpk import NamedMpkBytesRecorder, NamedMpkFileRecorder
from .training.accumulator import GradientsAccumulator
from .training.record import TrainingRecord
from .workload.loop import Parts, Workload, load_workload, recorders_for, train_until

__all__ = ["checkpoint_path", "role_command", "run_role"]


def checkpoint_path(base: Path, at: int, recorder: str) -> Path:
    """Where a `checkpoint` role given several micro-steps or recorders writes each file."""
    return base.with_name(f"{base.name}-{at}-{recorder}")


def role_command(backend: str, role: str, **options: Any) -> list[str]:
    """The command line of one role: `options` as flags (`drop_pending=True` is
    `--drop-pending`; None and False leave a flag out)."""
    cmd = [sys.executable, "-m", "trainrec.roles", role, "--backend", backend]
    for k, v in options.items():
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            cmd.append(flag)
        elif isinstance(v, (list, tuple)):
            cmd += [flag, *map(str, v)]
        elif v is not None and v is not False:
            cmd += [flag, str(v)]
    return cmd


def _save(workload: Workload, record: TrainingRecord[Any], recorder_name: str, path: Path) -> None:
    recorder = recorders_for(workload)[recorder_name]
    if isinstance(recorder, NamedMpkBytesRecorder):
        path.write_bytes(record.save(recorder, None))
    else:
        record.save(recorder, path)


def _load(workload: Workload, recorder_name: str, path: Path) -> TrainingRecord[Any]:
    recorder = recorders_for(workload)[recorder_name]
    args: Any = path.read_bytes() if isinstance(recorder, NamedMpkBytesRecorder) else path
    return TrainingRecord.load(recorder, args, workload.device, state_type=workload.state_type)


def _capture(workload: Workload, parts: Parts) -> TrainingRecord[Any]:
    workload.before_capture(parts)
    return TrainingRecord.capture(
        parts.model, parts.optimizer, parts.scheduler, parts.accumulator, parts.state
    )


def run_role(argv: Sequence[str] | None = None) -> int:
    """Entry point of the per-process roles (`python -m trainrec.roles ROLE ...`)."""
    p = argparse.ArgumentParser(prog="python -m trainrec.roles")
    p.add_argument("role", choices=["reference", "checkpoint", "train", "resume"])
    p.add_argument("--backend", required=True, help="an adapter name or a module:attr workload")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--at", type=int, nargs="+", default=[0],
                   help="micro-steps to checkpoint after (several: one file each)")
    p.add_argument("--recorder", nargs="+", default=["mpk"],
                   help="recorders to checkpoint with (resume: one for every checkpoint, or one each)")
    p.add_argument("--variant", default="default")
    p.add_argument("--checkpoint", type=Path, nargs="+", default=[],
                   help="where to checkpoint (resume: the checkpoints to resume, one after another)")
    p.add_argument("--out", type=Path, nargs="+", default=[],
                   help="the final record (resume: one for each checkpoint)")
    p.add_argument("--drop-pending", type=int, nargs="*", metavar="INDEX",
                   help="resume without the pending gradients (the checkpoints at these indices; none: all)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.role == "resume":
        if not a.checkpoint or len(a.out) != len(a.checkpoint):
            p.error("resume needs --checkpoint and as many --out files as checkpoints")
        if len(a.recorder) not in (1, len(a.checkpoint)):
            p.error("resume needs one --recorder, or one for each checkpoint")
        if any(not 0 <= i < len(a.checkpoint) for i in a.drop_pending or []):
            p.error(f"--drop-pending indices must be below {len(a.checkpoint)}")
    else:
        if len(a.checkpoint) > 1 or len(a.out) > 1:
            p.error(f"{a.role} takes one --checkpoint and one --out")
        if a.drop_pending is not None:
            p.error(f"--drop-pending is for resume, not {a.role}")
        if not (a.out if a.role == "reference" else a.checkpoint):
            p.error(f"{a.role} needs {'--out' if a.role == 'reference' else '--checkpoint'}")
    workload = load_workload(a.backend, a.variant)
    unknown = [r for r in a.recorder if r not in recorders_for(workload)]
    if unknown:
        p.error(f"--recorder must be among {sorted(recorders_for(workload))}, not {unknown}")
    final = NamedMpkFileRecorder(NativePrecisionSettings())
    if a.role == "resume":
        recorders = a.recorder * len(a.checkpoint) if len(a.recorder) == 1 else a.recorder
        drop = set(range(len(a.checkpoint)) if a.drop_pending == [] else a.drop_pending or [])
        for i, (checkpoint, out, recorder) in enumerate(zip(a.checkpoint, a.out, recorders)):
            _resume(workload, a, checkpoint, out, recorder, i in drop, final)
        return 0
    parts = workload.build(a.seed)

    if a.role == "reference":
        train_until(workload, parts, a.steps, a.window)
        _capture(workload, parts).save(final, a.out[0])
        return 0
    if a.role in ("checkpoint", "train"):
        several = len(a.at) > 1 or len(a.recorder) > 1
        for at in sorted(a.at):
            train_until(workload, parts, at, a.window)
            for name in a.recorder:
                path = checkpoint_path(a.checkpoint[0], at, name) if several else a.checkpoint[0]
                t0 = time.perf_counter()
                _save(workload, _capture(workload, parts), name, path)
                print(json.dumps({"checkpointed": at, "recorder": name,
                                  "save_s": time.perf_counter() - t0}), flush=True)
        if a.role == "train":
            train_until(workload, parts, a.steps, a.window)
            while True:  # wait to be killed, as a training job would be
                time.sleep(0.05)
        return 0
    raise AssertionError(a.role)  # argparse allows no other role


def _resume(workload: Workload, a: argparse.Namespace, checkpoint: Path, out: Path, recorder: str,
            drop_pending: bool, final: NamedMpkFileRecorder) -> None:
    """One resume into objects built afresh from the seed: load, restore, train to the
    end, save the final record to `out`."""
    parts = workload.build(a.seed)
    t0 = time.perf_counter()
    record = _load(workload, recorder, checkpoint)
    restored = record.restore(parts.model, parts.optimizer, parts.scheduler, workload.device)
    load_s = time.perf_counter() - t0
    parts.state = restored.state
    parts.accumulator = GradientsAccumulator() if drop_pending else restored.accumulator
    workload.after_restore(parts)
    train_until(workload, parts, a.steps, a.window)
    _capture(workload, parts).save(final, out)
    print(json.dumps({"load_s": load_s, "resumed_at": record.state.micro, "out": str(out)}), flush=True)


if __name__ == "__main__":
    sys.exit(run_role())
