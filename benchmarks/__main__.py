"""Checkpoint speed against the raw limit and peers, in one process on one state.

    python -m benchmarks --size 1GiB [--repeats 3] [--json out.json]

Rows: save and full load with trainrec's NamedMpk recorders, raw `file.write` /
`readinto` of the same bytes (the limit), and `torch.save` / `torch.load(weights_only=True)`
when torch is installed; lazy load (open a file with `mmap=True` and read one small tensor).
Every row prints the median seconds, GB/s and the ratio to the raw limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import trainrec
from trainrec import NamedMpkFileRecorder, NativePrecisionSettings, TensorData


def parse_size(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def training_state(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """~100 f32 tensors of mixed sizes: parameters, AdamW moments and pending gradients."""
    rng = np.random.default_rng(seed)
    n_params = 25
    weights = rng.pareto(1.0, n_params) + 0.05
    per_param = total_bytes // 4 // 4  # params, exp_avg, exp_avg_sq, grads
    sizes = np.maximum(1, (weights / weights.sum() * per_param).astype(np.int64))
    state: dict[str, np.ndarray] = {}
    for i, n in enumerate(sizes):
        for part in ("param", "exp_avg", "exp_avg_sq", "grad"):
            state[f"layers.{i}.{part}"] = rng.standard_normal(int(n), dtype=np.float32)
    return state


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write files (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    size = parse_size(a.size)
    state = training_state(size)
    nbytes = sum(v.nbytes for v in state.values())
    item = {k: TensorData.from_array(v, copy=False) for k, v in state.items()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        tmp = Path(d)

        def add(name: str, op: str, seconds: float) -> None:
            rows.append({"name": name, "op": op, "seconds": seconds, "gbps": nbytes / seconds / 1e9})

        raw_path = tmp / "raw.bin"

        def raw_write() -> None:
            with open(raw_path, "wb") as f:
                for v in state.values():
                    f.write(v.data)
                f.flush()
                os.fsync(f.fileno())

        def raw_read() -> None:
            buf = np.empty(nbytes, np.uint8)
            with open(raw_path, "rb") as f:
                f.readinto(buf.data)

        add("raw write+fsync", "save", timed(raw_write, a.repeats))
        add("raw readinto", "load", timed(raw_read, a.repeats))

        rec = NamedMpkFileRecorder(NativePrecisionSettings())
        mpk = tmp / "state.mpk"
        add("trainrec NamedMpk", "save", timed(lambda: rec.save_item(item, mpk), a.repeats))
        add("trainrec NamedMpk", "load", timed(lambda: rec.load_item(mpk), a.repeats))

        def lazy_one() -> None:
            loaded = rec.load_item(mpk, mmap=True)
            assert isinstance(loaded, dict)
            small = min(loaded, key=lambda k: loaded[k].nbytes)  # type: ignore[union-attr]
            _ = loaded[small].array  # type: ignore[union-attr]

        lazy = timed(lazy_one, a.repeats)
        rows.append({"name": "trainrec mmap open + one small tensor", "op": "lazy", "seconds": lazy,
                     "gbps": None})

        try:
            import torch
        except ImportError:
            torch = None  # type: ignore[assignment]
        if torch is not None:
            tstate = {k: torch.from_numpy(v) for k, v in state.items()}
            pt = tmp / "state.pt"
            add("torch.save", "save", timed(lambda: torch.save(tstate, pt), a.repeats))
            add("torch.load(weights_only)", "load",
                timed(lambda: torch.load(pt, weights_only=True), a.repeats))

    raw = {r["op"]: r["seconds"] for r in rows if r["name"].startswith("raw")}
    print(f"state: {len(state)} tensors, {nbytes / 2**20:.0f} MiB, trainrec {trainrec.__version__}, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"{'row':44} {'op':5} {'seconds':>9} {'GB/s':>7} {'vs raw':>7}")
    for r in rows:
        ratio = raw[r["op"]] / r["seconds"] if r["op"] in raw else None
        r["vs_raw"] = ratio
        gbps = f"{r['gbps']:7.2f}" if r["gbps"] else "      -"
        print(f"{r['name']:44} {r['op']:5} {r['seconds']:9.4f} {gbps} "
              f"{'' if ratio is None else f'{ratio:6.2f}x':>7}")
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes": nbytes, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
