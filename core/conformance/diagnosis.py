"""What the conformance suite's gradient tests use to say where two runs parted
(`_first_divergence`, `_when`, `_same_arrays`) and to plant known values in a run
(`_pattern`, `_overwrites`, `_write`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..items.tree import compare_items
from ..recorders.namedmpk import NamedMpkBytesRecorder
from ..workload.loop import Workload
from .contract import _NATIVE, _expect
from .harness import Parts, run, snapshot


def _first_divergence(h: Workload, parts: Parts, runs: dict[str, Parts]) -> dict[str, tuple[int, list[str]]]:
    """Train `parts` and each of `runs` micro-step by micro-step for one window, side by
    side, each snapshotted right before its own micro-step (so a run whose RNG state another
    run's step moved shows it); for each run that differs from `parts`, the micro-step after
    which it first did (0: before training) and the key paths that differed then."""
    r = NamedMpkBytesRecorder(_NATIVE)
    first: dict[str, tuple[int, list[str]]] = {}
    for step in range(h.window + 1):
        reference = r.load_item(snapshot(h, parts))
        if step < h.window:
            run(h, parts, 1)
        for name, p in runs.items():
            if name not in first:
                same, _, paths = compare_items(reference, r.load_item(snapshot(h, p)))
                if not same:
                    first[name] = (step, paths)
            if step < h.window:
                run(h, p, 1)
    return first


def _when(step: int) -> str:
    return "right after the restore, before a micro-step of its own," if step == 0 else f"after micro-step {step}"


def _pattern(shape: Any, scale: float) -> np.ndarray[Any, Any]:
    """Float32 values every float dtype holds exactly: (1..7) * scale, in `shape`."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 7 + 1) * scale).astype(np.float32).reshape(tuple(shape))


def _same_arrays(got: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    """What differs between two maps of host arrays, one phrase per ParamId."""
    got = got or {}
    problems = [f"{pid} is missing (dropped)" for pid in expected if pid not in got]
    problems += [f"{pid} is there, but none was expected" for pid in got if pid not in expected]
    problems += [f"{pid} differs" for pid in expected if pid in got and not (
        np.shape(got[pid]) == np.shape(expected[pid])
        and np.array_equal(np.asarray(got[pid], np.float64), expected[pid].astype(np.float64)))]
    return problems


def _overwrites(h: Workload, parts: Parts, tensor: Any, array: np.ndarray[Any, Any]) -> bool:
    """`h.overwrite`, checked: when it says it wrote, the tensor holds `array`."""
    if not h.overwrite(parts, tensor, array):
        return False
    _expect(np.array_equal(h.backend(parts).to_host(tensor), array), "workload.overwrite",
            "writes the array into the tensor in place when it returns True")
    return True


def _write(tmp: Path, data: bytes) -> Path:
    path = tmp / "damaged"
    path.write_bytes(data)
    return path
