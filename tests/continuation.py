"""Shared harness for exact-continuation tests: reference runs, checkpoints and resumes
of `python -m trainrec.roles` roles, each resume in a fresh process, two at a time."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainrec import read_file
from trainrec.items.tree import compare_items
from trainrec.roles import checkpoint_path

STEPS, WINDOW = 12, 4


def cmd(backend: str, role: str, variant: str, **kw) -> list[str]:
    out = [sys.executable, "-m", "trainrec.roles", role, "--backend", backend, "--variant", variant,
           "--steps", str(STEPS), "--window", str(WINDOW)]
    for k, v in kw.items():
        out.append(f"--{k.replace('_', '-')}")
        out += [] if v is True else [str(x) for x in (v if isinstance(v, list) else [v])]
    return out


def run_all(cmds: list[list[str]], env: dict | None = None) -> None:
    def one(c: list[str]) -> None:
        res = subprocess.run(c, capture_output=True, text=True, env=env)
        if res.returncode:
            raise RuntimeError(f"{' '.join(c[3:])} failed:\n{res.stderr}")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, cmds))


def continuation_results(backend: str, cases: list[tuple[str, int, str]],
                         no_pending: list[tuple[str, int]], tmp: Path,
                         env: dict | None = None) -> dict:
    """{(variant, position, recorder or "drop"): (reference item, resumed item)}: one
    reference and one checkpointing process per variant, one fresh process per resume."""
    variants = sorted({c[0] for c in cases} | {v for v, _ in no_pending})
    first = []
    for variant in variants:
        ats = sorted({WINDOW + pos for v, pos, _ in cases if v == variant}
                     | {WINDOW + pos for v, pos in no_pending if v == variant})
        recs = sorted({r for v, _, r in cases if v == variant} | {"mpk"})
        first.append(cmd(backend, "reference", variant, out=tmp / f"{variant}-ref.mpk"))
        first.append(cmd(backend, "checkpoint", variant, at=ats, recorder=recs, checkpoint=tmp / variant))
    run_all(first, env)
    resumes = {}
    for variant, pos, rec in cases:
        ckpt = checkpoint_path(tmp / variant, WINDOW + pos, rec)
        resumes[(variant, pos, rec)] = cmd(backend, "resume", variant, recorder=rec, checkpoint=ckpt,
                                           out=tmp / f"{variant}-{pos}-{rec}.out")
    for variant, pos in no_pending:
        ckpt = checkpoint_path(tmp / variant, WINDOW + pos, "mpk")
        resumes[(variant, pos, "drop")] = cmd(backend, "resume", variant, checkpoint=ckpt,
                                              drop_pending=True, out=tmp / f"{variant}-{pos}-drop.out")
    run_all(list(resumes.values()), env)
    refs = {v: read_file(tmp / f"{v}-ref.mpk")[1] for v in variants}
    return {key: (refs[key[0]], read_file(c[c.index("--out") + 1])[1]) for key, c in resumes.items()}


def assert_exact(results: dict, key: tuple) -> None:
    reference, resumed = results[key]
    exact, diff, paths = compare_items(reference, resumed)
    assert exact, f"{key}: differs at {paths[:5]} (max {diff})"


def assert_detects_dropped_pending(results: dict, key: tuple) -> None:
    reference, resumed = results[key]
    exact, diff, _ = compare_items(reference, resumed)
    assert not exact and diff > 0, f"{key}: a resume without the pending gradients went unnoticed"


def assert_all(results: dict) -> None:
    """Every resume exact, every resume without pending gradients detected."""
    for key in results:
        (assert_detects_dropped_pending if key[2] == "drop" else assert_exact)(results, key)
