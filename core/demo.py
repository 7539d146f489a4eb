"""`trainrec demo` and the exact-continuation harness it shares with the test suite.

A `Workload` (one per adapter, in `trainrec.adapters.<name>.demo`) builds a small
model, optimizer, scheduler and caller state, and runs one micro-step of gradient
accumulation. The roles below each run in their own process:

- `reference`: train all micro-steps without stopping and save the final record;
- `checkpoint`: train to micro-step K, save a TrainingRecord, exit;
- `train`: as `checkpoint`, then keep training until killed (the demo kills it);
- `resume`: load the checkpoint in a fresh process, restore, train to the end, save the
  final record (`--drop-pending` restores without the pending gradients, to show that
  they matter).

The final records are compared tensor by tensor, bitwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .accumulator import GradientsAccumulator
from .items import Item
from .precision import NativePrecisionSettings
from .protocols import Recorder
from .recorders import (
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    read_file,
)
from .tensor import TensorData
from .training import TrainingRecord

__all__ = ["Parts", "Workload", "compare_items", "run_demo", "run_role"]


@dataclass
class Parts:
    """The live objects of one training run."""

    model: Any
    optimizer: Any
    scheduler: Any
    state: Any
    accumulator: GradientsAccumulator[Any] = field(default_factory=GradientsAccumulator)
    extras: dict[str, Any] = field(default_factory=dict)


class Workload(Protocol):
    """What an adapter provides for the demo and the continuation tests.

    `state` (in `Parts`) must have an int field `micro`. `micro_step` draws a batch,
    computes gradients and accumulates them; `apply_window` takes the accumulated
    gradients and steps the optimizer and scheduler. `before_capture` /
    `after_restore` move framework RNG into / out of the caller's state.
    """

    name: str
    device: Any
    state_type: type[Any]

    def build(self, seed: int) -> Parts: ...
    def micro_step(self, parts: Parts) -> None: ...
    def apply_window(self, parts: Parts, window: int) -> None: ...
    def before_capture(self, parts: Parts) -> None: ...
    def after_restore(self, parts: Parts) -> None: ...


RECORDERS: dict[str, Recorder] = {
    "mpk": NamedMpkFileRecorder(NativePrecisionSettings()),
    "mpk-full": NamedMpkFileRecorder(),
    "gz": NamedMpkGzFileRecorder(NativePrecisionSettings()),
    "bytes": NamedMpkBytesRecorder(NativePrecisionSettings()),
}


def load_workload(backend: str, variant: str = "default") -> Workload:
    """The adapter's workload: `WORKLOADS[variant]` of `trainrec.adapters.<backend>.demo`,
    or, for `backend` of the form `"module:attr"`, that object (a class is instantiated):
    a conformance `Harness` of any adapter."""
    if ":" in backend:
        module_name, _, attr = backend.partition(":")
        found = getattr(importlib.import_module(module_name), attr)
        workload: Workload = found() if isinstance(found, type) else found
        return workload
    module = importlib.import_module(f"trainrec.adapters.{backend}.demo")
    workloads: dict[str, Workload] = getattr(module, "WORKLOADS", {"default": module.WORKLOAD})
    if variant not in workloads:
        raise ValueError(f"{backend} has no workload {variant!r}; it has {sorted(workloads)}")
    return workloads[variant]


def recorders_for(workload: Workload) -> dict[str, Recorder]:
    """The core recorders plus any the workload's adapter offers (`recorders` attribute)."""
    return {**RECORDERS, **getattr(workload, "recorders", {})}


def best_backend() -> str:
    """torch if it and its adapter are installed, else JAX, else the numpy reference."""
    for name, needs in (("torch", "torch"), ("jax", "jax")):
        if importlib.util.find_spec(needs) is not None:
            try:
                if importlib.util.find_spec(f"trainrec.adapters.{name}.demo") is not None:
                    return name
            except ModuleNotFoundError:
                continue
    return "numpy"


def checkpoint_path(base: Path, at: int, recorder: str) -> Path:
    """Where a `checkpoint` role given several micro-steps or recorders writes each file."""
    return base.with_name(f"{base.name}-{at}-{recorder}")


class Steps(Protocol):
    """The part of a `Workload` (or conformance `Harness`) that trains."""

    def micro_step(self, parts: Parts) -> None: ...
    def apply_window(self, parts: Parts, window: int) -> None: ...


def train_until(workload: Steps, parts: Parts, until: int, window: int) -> None:
    """Micro-steps until `parts.state.micro == until`, stepping the optimizer at the end of
    every window of `window` micro-steps."""
    while parts.state.micro < until:
        workload.micro_step(parts)
        parts.state.micro += 1
        if parts.state.micro % window == 0:
            workload.apply_window(parts, window)


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
    """Entry point of the per-process roles (`python -m trainrec.demo ROLE ...`)."""
    p = argparse.ArgumentParser(prog="python -m trainrec.demo")
    p.add_argument("role", choices=["reference", "checkpoint", "train", "resume"])
    p.add_argument("--backend", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--at", type=int, nargs="+", default=[0],
                   help="micro-steps to checkpoint after (several: one file each)")
    p.add_argument("--recorder", nargs="+", default=["mpk"],
                   help="recorders to checkpoint with (resume: the first)")
    p.add_argument("--variant", default="default")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--drop-pending", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    workload = load_workload(a.backend, a.variant)
    unknown = [r for r in a.recorder if r not in recorders_for(workload)]
    if unknown:
        p.error(f"--recorder must be among {sorted(recorders_for(workload))}, not {unknown}")
    parts = workload.build(a.seed)
    final = NamedMpkFileRecorder(NativePrecisionSettings())

    if a.role == "reference":
        train_until(workload, parts, a.steps, a.window)
        _capture(workload, parts).save(final, a.out)
        return 0
    if a.role in ("checkpoint", "train"):
        several = len(a.at) > 1 or len(a.recorder) > 1
        for at in sorted(a.at):
            train_until(workload, parts, at, a.window)
            for name in a.recorder:
                path = checkpoint_path(a.checkpoint, at, name) if several else a.checkpoint
                t0 = time.perf_counter()
                _save(workload, _capture(workload, parts), name, path)
                print(json.dumps({"checkpointed": at, "recorder": name,
                                  "save_s": time.perf_counter() - t0}), flush=True)
        if a.role == "train":
            train_until(workload, parts, a.steps, a.window)
            while True:  # wait to be killed, as a training job would be
                time.sleep(0.05)
        return 0
    t0 = time.perf_counter()
    record = _load(workload, a.recorder[0], a.checkpoint)
    restored = record.restore(parts.model, parts.optimizer, parts.scheduler, workload.device)
    load_s = time.perf_counter() - t0
    parts.state = restored.state
    parts.accumulator = GradientsAccumulator() if a.drop_pending else restored.accumulator
    workload.after_restore(parts)
    train_until(workload, parts, a.steps, a.window)
    _capture(workload, parts).save(final, a.out)
    print(json.dumps({"load_s": load_s, "resumed_at": record.state.micro}), flush=True)
    return 0


def compare_items(a: Item, b: Item, path: str = "") -> tuple[bool, float, list[str]]:
    """(bitwise equal, max |a - b| over float tensors, paths that differ)."""
    if isinstance(a, TensorData) and isinstance(b, TensorData):
        if a.shape != b.shape or a.dtype is not b.dtype:
            return False, float("inf"), [path]
        same = a.array.tobytes() == b.array.tobytes()
        diff = 0.0
        if not same and a.dtype.is_float and a.numel:
            x, y = a.array.astype(np.float64), b.array.astype(np.float64)
            diff = float(np.nanmax(np.abs(x - y)))
        return same, diff, [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return False, float("inf"), [path]
        results = [compare_items(a[k], b[k], f"{path}.{k}" if path else k) for k in a]
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return False, float("inf"), [path]
        results = [compare_items(x, y, f"{path}.{i}" if path else str(i)) for i, (x, y) in enumerate(zip(a, b))]
    else:
        same = type(a) is type(b) and repr(a) == repr(b)
        return same, 0.0, [] if same else [path]
    paths = [p for r in results for p in r[2]]
    return all(r[0] for r in results), max((r[1] for r in results), default=0.0), paths


def _role_cmd(backend: str, role: str, **kw: Any) -> list[str]:
    cmd = [sys.executable, "-m", "trainrec.demo", role, "--backend", backend]
    for k, v in kw.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v is not None and v is not False:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def _run(cmd: list[str]) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} failed:\n{out.stderr}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    return result


def run_demo(
    *, backend: str = "auto", steps: int = 24, window: int = 4, checkpoint_at: int | None = None,
    workdir: str | None = None, as_json: bool = False,
) -> int:
    """The README's main job; returns the exit code (0 only for a bitwise-exact resume)."""
    if backend == "auto":
        backend = best_backend()
    at = checkpoint_at if checkpoint_at is not None else (steps // 2 // window) * window + window // 2
    if not 0 < at < steps or window < 1:
        print("trainrec demo: need 0 < --checkpoint-at < --steps and --window >= 1", file=sys.stderr)
        return 2
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="trainrec-demo-")
    wd = Path(workdir or tmp.name)  # type: ignore[union-attr]
    wd.mkdir(parents=True, exist_ok=True)
    ckpt, ref, res, nop = (wd / n for n in ("checkpoint.mpk", "reference.mpk", "resumed.mpk", "no-pending.mpk"))
    common = {"steps": steps, "window": window}
    t_start = time.perf_counter()
    try:
        print(f"trainrec demo: backend {backend}, {steps} micro-steps, window {window}, "
              f"checkpoint after micro-step {at} ({at % window} of {window} pending)", flush=True)
        trainer = subprocess.Popen(
            _role_cmd(backend, "train", at=at, checkpoint=ckpt, **common),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        if not line.startswith("{"):
            trainer.kill()
            raise RuntimeError(f"training process failed:\n{trainer.communicate()[1]}")
        save_s = json.loads(line)["save_s"]
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.communicate()
        print(f"  killed the training process (pid {trainer.pid}) after its checkpoint", flush=True)
        resumed = _run(_role_cmd(backend, "resume", checkpoint=ckpt, out=res, **common))
        _run(_role_cmd(backend, "resume", checkpoint=ckpt, out=nop, drop_pending=True, **common))
        _run(_role_cmd(backend, "reference", out=ref, **common))
        ref_item, res_item, nop_item = (read_file(p)[1] for p in (ref, res, nop))
        exact, max_diff, paths = compare_items(ref_item, res_item)
        nop_exact, nop_diff, _ = compare_items(ref_item, nop_item)
        results = {
            "backend": backend,
            "micro_steps": steps,
            "window": window,
            "checkpoint_at": at,
            "pending_at_checkpoint": at % window,
            "checkpoint_bytes": ckpt.stat().st_size,
            "save_s": save_s,
            "load_restore_s": resumed["load_s"],
            "max_abs_diff": max_diff,
            "bitwise_identical": exact,
            "differing": paths[:10],
            "without_pending_max_abs_diff": nop_diff,
            "without_pending_identical": nop_exact,
            "wall_s": time.perf_counter() - t_start,
        }
    finally:
        if tmp is not None:
            tmp.cleanup()
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        rows = [
            ("micro-steps (window)", f"{steps} ({window})"),
            ("checkpoint after micro-step", f"{at} ({at % window} gradients pending)"),
            ("checkpoint size", f"{results['checkpoint_bytes']:,} B"),
            ("save time", f"{save_s * 1e3:.1f} ms"),
            ("load + restore time", f"{resumed['load_s'] * 1e3:.1f} ms"),
            ("max |resumed - uninterrupted|", f"{max_diff:.3g}"),
            ("bitwise identical", "yes" if exact else f"NO: {', '.join(paths[:5])}"),
            ("same resume without pending grads", f"max diff {nop_diff:.3g}"
             + (" (identical?!)" if nop_exact else " (not identical)")),
        ]
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
        print("RESULT: exact resume" if exact else "RESULT: resume is NOT exact")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(run_role())
