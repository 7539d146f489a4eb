"""Shared harness for exact-continuation tests: reference runs, checkpoints and resumes
of `python -m trainrec.roles` roles, two processes at a time. The resumes of a variant
run in one fresh process that has trained nothing when it loads the first, each resume
into objects built afresh (torch and JAX processes cost seconds each to start)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _zygote import Zygote

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


def run_all(cmds: list[list[str]], env: dict | None = None, envs: list[dict | None] | None = None,
            zygotes: dict[int, Zygote] | None = None) -> None:
    """Run `cmds` two at a time, in `env` (or each in its entry of `envs`); with `zygotes`
    (see `_zygotes`), each forked from the zygote of its environment."""
    envs = envs or [env] * len(cmds)

    def check(c: list[str], res: subprocess.CompletedProcess[str]) -> None:
        if res.returncode:
            raise RuntimeError(f"{' '.join(c[3:])} failed:\n{res.stderr}")

    if zygotes is not None:
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(envs):
            groups.setdefault(id(e), []).append(i)
        for key, members in groups.items():  # two at a time in all
            zygotes[key].submit([{"argv": cmds[i][1:]} for i in members], parallel=max(1, 2 // len(groups)))
        for key, members in groups.items():
            for i, res in zip(members, zygotes[key].collect()):
                check(cmds[i], res)
        return

    def one(c: list[str], e: dict | None) -> None:
        check(c, subprocess.run(c, capture_output=True, text=True, env=e))

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, cmds, envs))


def _zygotes(preload: list[str], envs: list[dict | None]) -> dict[int, Zygote]:
    """A zygote that imported `preload` for each environment (by identity) of `envs`."""
    out: dict[int, Zygote] = {}
    for e in envs:
        if id(e) not in out:
            out[id(e)] = Zygote(preload, env=e)
    return out


def continuation_results(backend: str, cases: list[tuple[str, int, str]],
                         no_pending: list[tuple[str, int]], tmp: Path,
                         env: dict | None = None, reference_env: dict | None = None,
                         preload: list[str] | None = None) -> dict:
    """{(variant, position, recorder or "drop"): (reference item, resumed item)}: one
    reference (in `reference_env` if given), one checkpointing and one resuming process
    per variant.

    With `preload` (the modules every role imports: torch's cost seconds of CPU a process)
    each process is forked from a zygote (tests/_zygote.py) that imported them, instead of
    a fresh interpreter: one per environment for the references and checkpoints, and
    another for the resumes, so that a resume never shares an interpreter (its hash seed)
    with the process that wrote its checkpoint, nor with its reference."""
    variants = sorted({c[0] for c in cases} | {v for v, _ in no_pending})
    envs = [reference_env or env, env]
    # the resumes' zygote starts now: it imports while the first processes run
    first_zygotes = _zygotes(preload, envs) if preload else None
    second_zygotes = _zygotes(preload, [env]) if preload else None
    try:
        return _continuation_results(backend, cases, no_pending, tmp, env, reference_env, variants,
                                     first_zygotes, second_zygotes)
    finally:
        for z in [*(first_zygotes or {}).values(), *(second_zygotes or {}).values()]:
            z.close()


def _continuation_results(backend: str, cases: list[tuple[str, int, str]],
                          no_pending: list[tuple[str, int]], tmp: Path, env: dict | None,
                          reference_env: dict | None, variants: list[str],
                          first_zygotes: dict[int, Zygote] | None,
                          second_zygotes: dict[int, Zygote] | None) -> dict:
    first, first_envs = [], []
    for variant in variants:
        ats = sorted({WINDOW + pos for v, pos, _ in cases if v == variant}
                     | {WINDOW + pos for v, pos in no_pending if v == variant})
        recs = sorted({r for v, _, r in cases if v == variant} | {"mpk"})
        first.append(cmd(backend, "reference", variant, out=tmp / f"{variant}-ref.mpk"))
        first.append(cmd(backend, "checkpoint", variant, at=ats, recorder=recs, checkpoint=tmp / variant))
        first_envs += [reference_env or env, env]
    run_all(first, envs=first_envs, zygotes=first_zygotes)
    resumes = {}  # (variant, position, recorder or "drop") -> (checkpoint, recorder, out)
    for variant, pos, rec in cases:
        resumes[(variant, pos, rec)] = (checkpoint_path(tmp / variant, WINDOW + pos, rec), rec,
                                        tmp / f"{variant}-{pos}-{rec}.out")
    for variant, pos in no_pending:
        resumes[(variant, pos, "drop")] = (checkpoint_path(tmp / variant, WINDOW + pos, "mpk"), "mpk",
                                           tmp / f"{variant}-{pos}-drop.out")
    second = []
    for variant in variants:
        keys = [k for k in resumes if k[0] == variant]
        second.append(cmd(backend, "resume", variant, checkpoint=[resumes[k][0] for k in keys],
                          recorder=[resumes[k][1] for k in keys], out=[resumes[k][2] for k in keys],
                          **({"drop_pending": [i for i, k in enumerate(keys) if k[2] == "drop"]}
                             if any(k[2] == "drop" for k in keys) else {})))
    run_all(second, env, zygotes=second_zygotes)
    refs = {v: read_file(tmp / f"{v}-ref.mpk")[1] for v in variants}
    return {key: (refs[key[0]], read_file(out)[1]) for key, (_, _, out) in resumes.items()}


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
