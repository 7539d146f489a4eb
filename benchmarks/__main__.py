"""trainrec against its peers, in one run, on one training state.

    python -m benchmarks --size 1GiB [--repeats 3] [--json results.json] [--png results.png]

Rows (each peer on the same state of ~100 f32 torch tensors: parameters, AdamW moments,
pending gradients):
- save to a file and load back, fully materialized as torch tensors: trainrec
  DefaultRecorder / TorchFileRecorder / NamedMpkGzFileRecorder, torch.save /
  torch.load(weights_only=True), safetensors, flax msgpack, orbax, and raw
  write+fsync / readinto of the same bytes (the limit);
- lazy load: open the file and read its smallest tensor; and `Recorder.load(mmap=True)` of
  a `@trainrec.record` holding the whole state as one array field and a 3-element one,
  reading the small field;
- peak resident memory above the state during save and load (own subprocess each);
- `GradientsAccumulator.accumulate` vs a hand-written `torch._foreach_add_`;
- on JAX (`accumulate`): `accumulate` vs a jitted `jax.tree.map(jnp.add)` over the same
  trees, 20 and 200 leaves of 64x64 f32 and 20 of 512x512, per call; `jax-loop`: the
  README's loop, `acc.accumulate(model, trj.grads_from(grads, model))`, at 200 leaves;
  `TrainingRecord.capture` vs `copy.deepcopy` of the state dicts;
- on CUDA: the time `capture_async` blocks the training thread vs `capture`;
- `Recorder.load` of a `@trainrec.record` of 128 f32 arrays (half the state), 20 loads:
  median and p95, against a raw `readinto` of the same file;
- small saves (1, 2, 10 MB): NamedMpk `durable=False` vs `torch.save`;
- background saves: the training thread's time per save and back-to-back throughput of
  `CheckpointManager` vs capture alone and a synchronous save, orbax `AsyncCheckpointer`
  and `CheckpointManager`, torch DCP `async_save` (one process).
`--rows` picks groups of rows (e.g. `--rows manager,small`).
Every row prints the median seconds, GB/s, and ratios to the raw limit and the best peer;
the targets of the benchmark issue are checked at the end. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.accumulate import jax_accumulate_rows, jax_loop_rows
from benchmarks.peers import PEERS, lazy_rows
from benchmarks.state import parse_size, sizes, training_state

SLOW = {"trainrec NamedMpkGzFileRecorder"}
GROUPS = ("files", "lazy", "record-load", "small", "manager", "compute", "accumulate", "jax-loop", "memory")  # single repeat: gzip of random floats is slow


def _once(fn: Callable[[], Any]) -> float:
    """Seconds of one call; the page cache's dirty pages are flushed first (outside the
    timing), so no row pays for the previous row's writeback."""
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    return statistics.median(_once(fn) for _ in range(repeats))


def timed_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of `a` and of `b`, run alternately after one untimed run of each,
    so both meet the same allocator and page-cache state (whichever runs first after the
    file rows would otherwise pay for reclaiming the page cache)."""
    a(), b()
    pairs = [(_once(a), _once(b)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def _drop(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def save_load_rows(state: dict[str, Any], nbytes: int, tmp: Path, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i, (name, make) in enumerate(PEERS.items()):
        rows += _peer_rows(name, make, state, tmp / f"bench-{i}", 1 if name in SLOW else repeats)
    for r in rows:
        if "seconds" in r:
            r["gbps"] = nbytes / r["seconds"] / 1e9
    return rows


def _peer_rows(name: str, make: Callable[[], Any], state: dict[str, Any], path: Path,
               repeats: int) -> list[dict[str, Any]]:
    import torch

    try:
        save, load = make()
    except ImportError as e:
        return [{"name": name, "op": "save", "skipped": f"not installed ({e.name})"}]
    loaded: dict[str, Any] = {}

    def load_all() -> None:
        loaded.clear()
        loaded.update(load(path))
        for t in loaded.values():  # materialize: a lazily mapped load must read every page
            flat = t.reshape(-1).view(torch.uint8)
            int(flat[:: 4096].sum()) if flat.numel() else None

    try:
        t_save = timed(lambda: save(state, path), repeats)
        t_load = timed(load_all, repeats)
        files = [path] if path.is_file() else list(path.rglob("*"))
        size = sum(p.stat().st_size for p in files if p.is_file())
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), f"{name} lost data"
    except Exception as e:  # a peer that breaks is reported, not fatal
        return [{"name": name, "op": "save", "skipped": f"{type(e).__name__}: {e}"}]
    finally:
        _drop(path)
    return [{"name": name, "op": "save", "seconds": t_save, "file_bytes": size},
            {"name": name, "op": "load", "seconds": t_load, "file_bytes": size}]


def memory_rows(size: int, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for name in PEERS:
        if name in SLOW:
            continue
        for op in ("save", "load"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.memory", name, op, str(size), str(tmp)],
                                 capture_output=True, text=True)
            if out.returncode:
                rows.append({"name": name, "op": f"peak extra memory, {op}",
                             "skipped": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"})
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"name": name, "op": f"peak extra memory, {op}", "bytes": r["extra_bytes"],
                         "largest_tensor": r["largest_tensor"]})
        for p in tmp.glob("mem-*"):
            _drop(p)
    return rows


def compute_rows(size: int, repeats: int) -> list[dict[str, Any]]:
    """accumulate vs _foreach_add_, capture vs deepcopy, and (CUDA) capture_async."""
    import torch

    rows: list[dict[str, Any]] = []
    for dev in ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []):
        rows += _device_rows(dev, size, repeats)
    return rows


@functools.cache
def _state_type() -> Any:
    """The caller state the benchmark's `TrainingRecord`s carry."""
    import trainrec

    @trainrec.record
    class State:
        micro: int

    return State


def _training(size: int, dev: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """A model of `size` / 4 bytes of f32 parameters on `dev`, AdamW after one step, and
    a GradientsAccumulator holding pending gradients mid-window: (model, optimizer,
    accumulator, the gradients it was given)."""
    import torch

    import trainrec

    model = torch.nn.Module()
    for i, n in enumerate(sizes(size)):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(n, device=dev)))
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters())
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    opt.step()
    # mid-window, as a loop that accumulates with trainrec leaves it: the pending gradients
    # live in the accumulator and `.grad` is None, so both sides below copy the same tensors
    opt.zero_grad(set_to_none=True)
    acc: trainrec.GradientsAccumulator[Any] = trainrec.GradientsAccumulator()
    acc.accumulate(model, trainrec.GradientsParams(grads))
    return model, opt, acc, grads


def _device_rows(dev: str, size: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    import trainrec

    State = _state_type()  # noqa: N806 - a class
    model, opt, acc, grads = _training(size, dev)
    pending = [g.clone() for g in grads.values()]
    incoming = list(grads.values())

    def sync() -> None:
        if dev != "cpu":
            torch.cuda.synchronize()

    def ours() -> None:
        acc.accumulate(model, trainrec.GradientsParams(grads))
        sync()

    def foreach() -> None:
        torch._foreach_add_(pending, incoming)
        sync()

    def capture() -> Any:
        return trainrec.TrainingRecord.capture(model, opt, None, acc, State(1))

    def deepcopy_dicts() -> Any:
        return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                              "grads": list(grads.values())})

    async def blocked() -> float:
        t0 = time.perf_counter()
        task = asyncio.ensure_future(trainrec.TrainingRecord.capture_async(model, opt, None, acc, State(1)))
        await asyncio.sleep(0)  # the training loop gets control back here
        t_blocked = time.perf_counter() - t0
        await task
        return t_blocked

    gbytes = sum(g.numel() * 4 for g in incoming)
    t_acc, t_for = timed_pair(ours, foreach, max(repeats, 5))
    t_cap, t_dc = timed_pair(capture, deepcopy_dicts, max(repeats, 5))
    rows = [
        {"name": f"trainrec accumulate ({dev})", "op": "accumulate", "seconds": t_acc,
         "gbps": gbytes / t_acc / 1e9, "vs_peer": t_for / t_acc},
        {"name": f"torch._foreach_add_ ({dev})", "op": "accumulate", "seconds": t_for,
         "gbps": gbytes / t_for / 1e9},
        {"name": f"TrainingRecord.capture ({dev})", "op": "capture", "seconds": t_cap,
         "gbps": 4 * gbytes / t_cap / 1e9, "vs_peer": t_dc / t_cap},
        {"name": f"copy.deepcopy of state dicts ({dev})", "op": "capture", "seconds": t_dc,
         "gbps": 4 * gbytes / t_dc / 1e9},
    ]
    if dev != "cpu":
        rows.append({"name": "capture_async: training thread blocked (cuda)", "op": "capture",
                     "seconds": statistics.median(asyncio.run(blocked()) for _ in range(repeats))})
    return rows


def lazy(state: dict[str, Any], tmp: Path, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, fn in lazy_rows(state, tmp).items():
        rows.append({"name": name, "op": "lazy one tensor", "seconds": timed(fn, repeats)})
    return rows


def record_load_rows(size: int, tmp: Path, loads: int = 20) -> list[dict[str, Any]]:
    """`Recorder.load` of a `@trainrec.record` of 128 f32 arrays (the eager path: one read
    into the load's own buffer, the arrays views of it), `loads` times, alternating with a
    raw `readinto` of the same file into a new buffer."""
    import trainrec

    @trainrec.record
    class Arrays:
        arrays: dict[str, np.ndarray]

    rng = np.random.default_rng(0)
    n = max(1, size // 128 // 4)
    path = tmp / "record.mpk"
    recorder = trainrec.NamedMpkFileRecorder()
    recorder.record(Arrays({f"a{i}": rng.standard_normal(n, dtype=np.float32) for i in range(128)}), path)

    def raw() -> Any:
        buf = np.empty(path.stat().st_size, np.uint8)
        with open(path, "rb") as f:
            f.readinto(buf.data)
        return buf

    def ours() -> Any:
        return recorder.load(path, None, Arrays)

    ours(), raw()  # the page cache holds the file from here on, for both
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for _ in range(loads):
        for name, fn in (("ours", ours), ("raw", raw)):
            t0 = time.perf_counter()
            fn()  # the result is dropped at once, as a loop that restores and moves on does
            times[name].append(time.perf_counter() - t0)
    _drop(path)
    nbytes = 128 * n * 4
    rows = []
    for name, key in (("trainrec Recorder.load of a @record (128 arrays)", "ours"),
                      ("raw readinto of the same file", "raw")):
        t = times[key]
        med, p95 = statistics.median(t), statistics.quantiles(t, n=20, method="inclusive")[-1]
        rows.append({"name": name, "op": f"load record, {loads} loads", "seconds": med, "p95": p95,
                     "gbps": nbytes / med / 1e9})
    rows[0]["vs_peer"] = rows[1]["seconds"] / rows[0]["seconds"]
    return rows


SMALL_MB = (1, 2, 10)


def small_save_rows(tmp: Path, repeats: int) -> list[dict[str, Any]]:
    """Saves of 1, 2 and 10 MB states (~100 tensors each): trainrec's NamedMpk file with
    `durable=False` (like torch.save: no fsync) against `torch.save`, alternating, one
    after the other as a loop that checkpoints often does (no sync in between)."""
    from benchmarks.peers import torch_pickle, trainrec_recorder

    rows = []
    for mb in SMALL_MB:
        state = training_state(mb * 10**6)
        ours, theirs = trainrec_recorder("nofsync")[0], torch_pickle()[0]
        calls = {"ours": functools.partial(ours, state, tmp / "small.mpk"),
                 "torch": functools.partial(theirs, state, tmp / "small.pt")}
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for i in range(3 + max(repeats, 30)):
            for key, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                if i >= 3:  # after three untimed saves each
                    times[key].append(time.perf_counter() - t0)
        t_ours, t_torch = statistics.median(times["ours"]), statistics.median(times["torch"])
        rows += [{"name": f"trainrec NamedMpk durable=False, {mb} MB", "op": "small save", "seconds": t_ours,
                  "vs_peer": t_torch / t_ours, "mb": mb},
                 {"name": f"torch.save, {mb} MB", "op": "small save", "seconds": t_torch, "mb": mb}]
    for p in tmp.glob("small.*"):
        _drop(p)
    return rows


def manager_rows(size: int, tmp: Path, repeats: int) -> list[dict[str, Any]]:
    """The training thread's time per background save and back-to-back saves' throughput:
    `CheckpointManager` against orbax's `AsyncCheckpointer` and `CheckpointManager` and
    torch DCP's `async_save`, on one CPU state (parameters, AdamW moments, pending
    gradients). Between the saves of the blocked-time rows the training thread sleeps
    1.5x a synchronous save (a loop bound by its accelerator leaves the CPUs to the
    writer), and each save follows a `capture` alone, timed, to which it is compared; the
    back-to-back rows save `n` times without pause, then wait, and their time over `n` is
    compared with `n` synchronous captures and saves timed the same way (total over `n`)."""
    import trainrec
    from benchmarks import peers

    model, opt, acc, grads = _training(size, "cpu")
    state = _state_type()(1)
    n = max(repeats, 5)
    recorder = trainrec.NamedMpkFileRecorder(trainrec.NativePrecisionSettings())  # the manager's

    def capture() -> Any:
        return trainrec.TrainingRecord.capture(model, opt, None, acc, state)

    t_cap = timed(capture, n)
    # the synchronous throughput as the background rows measure theirs: one untimed save,
    # then n back to back, their total time over n (a median of single saves would leave
    # out the slow ones that the background rows' total includes)
    capture().save(recorder, tmp / "sync.mpk")
    os.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        capture().save(recorder, tmp / "sync.mpk")
    t_sync = (time.perf_counter() - t0) / n
    _drop(tmp / "sync.mpk")
    tensors = peers.flat_tensors(model, opt, list(grads.values()))
    makers: dict[str, Callable[[Path], peers.Async]] = {
        "trainrec CheckpointManager": lambda d: peers.trainrec_manager(model, opt, acc, state, d),
        "orbax AsyncCheckpointer": lambda d: peers.orbax_async(tensors, d),
        "orbax CheckpointManager (async)": lambda d: peers.orbax_manager(tensors, d),
        "torch DCP async_save (1 process)": lambda d: peers.torch_dcp_async(tensors, d),
    }
    rows: list[dict[str, Any]] = [
        {"name": "TrainingRecord.capture alone", "op": "blocked per save", "seconds": t_cap},
        {"name": "capture + save, on the training thread", "op": "back-to-back save", "seconds": t_sync}]
    for i, (name, make) in enumerate(makers.items()):
        d = tmp / f"async-{i}"
        d.mkdir()
        try:
            save, wait, close = make(d)
            try:
                save(0)  # untimed: a peer's first save sets itself up
                wait()
                blocked, alone = [], []
                for step in range(1, n + 1):
                    os.sync()
                    # capture alone, then the save, back to back: both meet the same
                    # machine (the previous save finished during the sleep)
                    t0 = time.perf_counter()
                    capture()
                    t1 = time.perf_counter()
                    save(step)
                    blocked.append(time.perf_counter() - t1)
                    alone.append(t1 - t0)
                    time.sleep(1.5 * t_sync)
                wait()
                os.sync()
                t0 = time.perf_counter()
                for step in range(n + 1, 2 * n + 1):
                    save(step)
                wait()
                per_save = (time.perf_counter() - t0) / n
            finally:
                close()
        except ImportError as e:
            rows.append({"name": name, "op": "blocked per save", "skipped": f"not installed ({e.name})"})
            continue
        except Exception as e:  # a peer that breaks is reported, not fatal
            rows.append({"name": name, "op": "blocked per save", "skipped": f"{type(e).__name__}: {e}"})
            continue
        finally:
            _drop(d)
        t_blocked = statistics.median(blocked)
        rows += [{"name": name, "op": "blocked per save", "seconds": t_blocked,
                  "vs_capture": t_blocked / statistics.median(alone)},
                 {"name": name, "op": "back-to-back save", "seconds": per_save, "vs_sync": t_sync / per_save}]
    return rows


def ratios(rows: list[dict[str, Any]]) -> None:
    for op in ("save", "load"):
        live = [r for r in rows if r["op"] == op and "seconds" in r]
        raw = next((r["seconds"] for r in live if r["name"].startswith("raw")), None)
        peers = [r["seconds"] for r in live if not r["name"].startswith(("raw", "trainrec"))]
        best = min(peers) if peers else None
        for r in live:
            r["vs_raw"] = raw / r["seconds"] if raw else None
            if r["name"].startswith("trainrec") and best:
                r["vs_best_peer"] = best / r["seconds"]


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    def row(name: str, op: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["name"] == name and r["op"] == op and "skipped" not in r), None)

    out: list[tuple[str, bool | None, str]] = []
    # like for like: none of the peers fsyncs, so the speed targets use durable=False
    ours_s, ours_l = row("trainrec NamedMpk durable=False", "save"), row("trainrec NamedMpk durable=False", "load")
    ts, tl = row("torch.save/load(weights_only)", "save"), row("torch.save/load(weights_only)", "load")
    fast = row("trainrec durable=False, mmap+verify load", "load")
    if fast and tl:
        sp = tl["seconds"] / fast["seconds"]
        out.append(("(mmap+verify) load >= 0.7x raw and >= 1.2x torch.load",
                    fast["vs_raw"] >= 0.7 and sp >= 1.2, f"{fast['vs_raw']:.2f}x raw, {sp:.2f}x torch.load"))
    if ours_s and ts:
        out.append(("save >= 0.8x raw write", ours_s["vs_raw"] >= 0.8, f"{ours_s['vs_raw']:.2f}x"))
        sp = ts["seconds"] / ours_s["seconds"]
        out.append(("save >= 1.5x torch.save", sp >= 1.5, f"{sp:.2f}x"))
    if ours_l and tl:
        out.append(("load >= 0.7x raw readinto", ours_l["vs_raw"] >= 0.7, f"{ours_l['vs_raw']:.2f}x"))
        sp = tl["seconds"] / ours_l["seconds"]
        out.append(("load >= 1.2x torch.load(weights_only)", sp >= 1.2, f"{sp:.2f}x"))
    lz = row("trainrec mmap=True", "lazy one tensor")
    if lz:
        out.append(("lazy load of one tensor < 50 ms", lz["seconds"] < 0.05, f"{lz['seconds'] * 1e3:.1f} ms"))
    lr = row("trainrec load(mmap=True) of a @record, one small field", "lazy one tensor")
    if lr:
        out.append(("a @record's small field, mmap=True, < 50 ms", lr["seconds"] < 0.05,
                    f"{lr['seconds'] * 1e3:.1f} ms"))
    mem = row("trainrec DefaultRecorder (durable: fsync)", "peak extra memory, save")
    if mem:
        bound = mem["largest_tensor"] + (64 << 20)
        out.append(("save peak extra memory <= largest tensor + 64 MiB", mem["bytes"] <= bound,
                    f"{mem['bytes'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)"))
    acc = row("trainrec accumulate (cpu)", "accumulate")
    if acc:
        out.append(("accumulate <= 1.2x _foreach_add_", 1 / acc["vs_peer"] <= 1.2, f"{1 / acc['vs_peer']:.2f}x"))
    rec = next((r for r in rows if r["name"].startswith("trainrec Recorder.load of a @record")
                and "seconds" in r), None)
    raw_rec = row("raw readinto of the same file", rec["op"]) if rec else None
    if rec and raw_rec:
        spread = rec["p95"] / rec["seconds"]
        out.append(("Recorder.load of a record: p95 of 20 loads <= 1.5x their median", spread <= 1.5,
                    f"{spread:.2f}x (median {rec['seconds']:.3f} s, {rec['vs_peer']:.2f}x raw readinto; "
                    f"raw readinto's own p95 {raw_rec['p95'] / raw_rec['seconds']:.2f}x its median)"))
    small = [r for r in rows if r["op"] == "small save" and "vs_peer" in r]
    if small:
        out.append(("small saves (durable=False) <= torch.save at 1, 2, 10 MB",
                    all(r["vs_peer"] >= 1 for r in small),
                    ", ".join(f"{r['mb']} MB {1 / r['vs_peer']:.2f}x" for r in small)))
    mgr_b = row("trainrec CheckpointManager", "blocked per save")
    if mgr_b:
        out.append(("training thread blocked per CheckpointManager.save <= 1.2x capture",
                    mgr_b["vs_capture"] <= 1.2, f"{mgr_b['vs_capture']:.2f}x"))
    mgr_t = row("trainrec CheckpointManager", "back-to-back save")
    if mgr_t:
        out.append(("back-to-back CheckpointManager saves >= 0.8x synchronous throughput",
                    mgr_t["vs_sync"] >= 0.8, f"{mgr_t['vs_sync']:.2f}x"))
    jacc = [r for r in rows if r["op"] == "accumulate (jax)" and "vs_peer" in r]
    if jacc:
        out.append(("accumulate on JAX <= 1.2x a jitted jax.tree.map(jnp.add)",
                    all(1 / r["vs_peer"] <= 1.2 for r in jacc),
                    ", ".join(f"{r['name'].split('(')[1][:-1]}: {1 / r['vs_peer']:.2f}x" for r in jacc)))
    cap = row("TrainingRecord.capture (cpu)", "capture")
    if cap:
        out.append(("capture <= 1.2x deepcopy", 1 / cap["vs_peer"] <= 1.2, f"{1 / cap['vs_peer']:.2f}x"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GiB", help="training state size (default 1GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write files (default: a temp dir)")
    p.add_argument("--json", default="bench-results/results.json")
    p.add_argument("--png", default="bench-results/results.png")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--rows", default=",".join(GROUPS),
                   help=f"which rows, comma-separated (default all: {','.join(GROUPS)})")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    size = parse_size(a.size)
    groups = set(a.rows.split(","))
    if groups - set(GROUPS):
        p.error(f"unknown rows {sorted(groups - set(GROUPS))}; choose from {','.join(GROUPS)}")
    state = training_state(size) if groups & {"files", "lazy"} else {}  # the others build their own
    nbytes = sum(t.numel() * 4 for t in state.values()) or size
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "processor": platform.processor() or platform.machine()}
    try:
        import torch

        machine["torch"] = torch.__version__
    except ImportError:
        pass
    print(f"state: {len(state)} tensors, {nbytes / 2**20:.0f} MiB; {machine}", flush=True)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        tmp = Path(d)
        rows = save_load_rows(state, nbytes, tmp, a.repeats) if "files" in groups else []
        rows += lazy(state, tmp, a.repeats) if "lazy" in groups else []
        del state
        rows += record_load_rows(size // 2, tmp) if "record-load" in groups else []
        rows += small_save_rows(tmp, a.repeats) if "small" in groups else []
        rows += manager_rows(size, tmp, a.repeats) if "manager" in groups else []
        rows += compute_rows(size, a.repeats) if "compute" in groups else []
        rows += jax_accumulate_rows(a.repeats) if "accumulate" in groups else []
        rows += jax_loop_rows(a.repeats) if "jax-loop" in groups else []
        if not a.skip_memory and "memory" in groups:
            rows += memory_rows(size, tmp)
    ratios(rows)
    print(f"\n{'row':44} {'op':28} {'seconds':>9} {'GB/s':>6} {'vs raw':>7} {'vs best peer':>12}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:44} {r['op']:28} skipped: {r['skipped']}")
        elif "bytes" in r:
            print(f"{r['name']:44} {r['op']:28} {r['bytes'] / 2**20:8.0f} MiB (largest tensor "
                  f"{r['largest_tensor'] / 2**20:.0f} MiB)")
        else:
            gb = f"{r['gbps']:6.2f}" if r.get("gbps") else "     -"
            vr = f"{r['vs_raw']:6.2f}x" if r.get("vs_raw") else ""
            vp = f"{r['vs_best_peer']:6.2f}x" if r.get("vs_best_peer") else (
                f"{r['vs_peer']:6.2f}x" if r.get("vs_peer") else "")
            for k, label in (("vs_capture", "x capture"), ("vs_sync", "x sync")):
                vp += f"{r[k]:6.2f}{label}" if r.get(k) else ""
            vp += f"  p95 {r['p95']:.4f}" if r.get("p95") else ""
            print(f"{r['name']:44} {r['op']:28} {r['seconds']:9.4f} {gb} {vr:>7} {vp:>12}")
    checks = targets(rows)
    print("\ntargets:")
    for text, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {text}: {value}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes": nbytes, "machine": machine, "rows": rows,
                               "targets": [{"target": t, "met": ok, "value": v} for t, ok, v in checks]},
                              indent=2))
    print(f"\nwrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 5))
        for ax, op in zip(axes, ("save", "load")):
            live = [r for r in rows if r["op"] == op and "gbps" in r]
            ax.barh([r["name"] for r in live], [r["gbps"] for r in live],
                    color=["tab:orange" if r["name"].startswith("trainrec") else "tab:gray" for r in live])
            ax.set_title(f"{op}, GB/s ({nbytes / 2**30:.1f} GiB state, log scale)")
            ax.set_xscale("log")
            ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(a.png, dpi=100)
        print(f"wrote {a.png}")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
