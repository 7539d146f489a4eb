"""`trainrec demo`: kill a training process mid-window, resume it in a fresh one, and
show that the result is bitwise identical to a run that never stopped.

The processes are the roles of `trainrec.roles`, running an adapter's `Workload`
(`trainrec.workload.loop`); the final records are compared with `compare_items`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..items.tree import compare_items
from ..recorders.read import read_file
from ..roles import role_command
from ..workload.loop import load_workload, workload_modules

# `load_workload` is named here too: `trainrec demo --backend module:attr` checks the
# workload it names before starting any process (cli.py)
__all__ = ["best_backend", "load_workload", "run_demo"]


def best_backend() -> str:
    """torch if it and its adapter are installed, else JAX, else the numpy reference."""
    for name, needs in (("torch", "torch"), ("jax", "jax")):
        if importlib.util.find_spec(needs) is not None:
            try:
                if importlib.util.find_spec(workload_modules()[name]) is not None:
                    return name
            except (ModuleNotFoundError, KeyError):
                continue
    return "numpy"


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
            role_command(backend, "train", at=at, checkpoint=ckpt, **common),
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
        resumed = _run(role_command(backend, "resume", checkpoint=ckpt, out=res, **common))
        _run(role_command(backend, "resume", checkpoint=ckpt, out=nop, drop_pending=True, **common))
        _run(role_command(backend, "reference", out=ref, **common))
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

