"""The conformance harness: how the suite drives an adapter's `Workload`.

It starts runs in the middle of an accumulation window (`midway`), snapshots every
tensor and scalar of a run (`snapshot`), and runs the exact-continuation scenario in
fresh processes (`continuation`, through the roles of `trainrec.roles`: one process
resumes every checkpoint, one after another, each into freshly built objects). `Workload`
and `Parts` live in `trainrec.workload.loop`; `Harness` is the name `Workload` had here
before, kept so that adapters written against it still run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..items.tree import Item
from ..precision import NativePrecisionSettings
from ..recorders.namedmpk import NamedMpkBytesRecorder
from ..recorders.read import read_file
from ..roles import checkpoint_path, role_command
from ..training.record import TrainingRecord
from ..workload.loop import Parts, Workload, train_until

__all__ = ["Harness", "Parts", "Workload", "continuation", "midway", "run", "snapshot"]

Harness = Workload
"""The former name of `Workload`."""

_NATIVE = NativePrecisionSettings()


def run(w: Workload, parts: Parts, micro_steps: int) -> None:
    """`micro_steps` more micro-steps, in windows of the workload's `window`."""
    train_until(w, parts, parts.state.micro + micro_steps, w.window)


def midway(w: Workload) -> Parts:
    """A run in the middle of its second accumulation window: optimizer state exists and
    gradients are pending (the `parts` every test starts from)."""
    parts = w.build(0)
    run(w, parts, w.window + 2)
    return parts


def snapshot(w: Workload, parts: Parts) -> bytes:
    """Every tensor and scalar of the live objects and the caller state, as bytes."""
    w.before_capture(parts)
    rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                 parts.accumulator, parts.state)
    data: bytes = rec.save(NamedMpkBytesRecorder(_NATIVE))
    return data


def continuation(w: Workload, tmp: Path) -> tuple[Item, dict[int, Item], Item]:
    """The final records of a run that never stopped, of runs checkpointed at each
    position of the second window and resumed in a fresh process (by position), and of
    one resumed mid-window without its pending gradients. Three processes: the
    uninterrupted run, one that writes every checkpoint, and one that has trained nothing
    when it resumes them, each into objects built afresh. Raises AssertionError naming
    the role when a process fails."""
    steps = 3 * w.window
    common = {"steps": steps, "window": w.window}
    ats = [w.window + p for p in range(w.window)]

    def role(name: str, **options: object) -> None:
        cmd = role_command(w.ref, name, **options, **common)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise AssertionError(f"{name} failed in a fresh process:\n{out.stderr}")

    role("reference", out=tmp / "ref.mpk")
    role("checkpoint", at=ats, recorder=["mpk", "bytes"], checkpoint=tmp / "ckpt")
    recorders = ["mpk" if p % 2 == 0 else "bytes" for p in range(w.window)] + ["mpk"]
    mid = w.window + w.window // 2
    checkpoints = [checkpoint_path(tmp / "ckpt", at, rec) for at, rec in zip([*ats, mid], recorders)]
    outs = [tmp / f"res{p}.mpk" for p in range(w.window)] + [tmp / "drop.mpk"]
    role("resume", recorder=recorders, checkpoint=checkpoints, out=outs, drop_pending=[w.window])
    resumed = {p: read_file(outs[p])[1] for p in range(w.window)}
    return read_file(tmp / "ref.mpk")[1], resumed, read_file(tmp / "drop.mpk")[1]
