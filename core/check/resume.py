"""`trainrec check`: prove that a training loop resumes exactly, and say what broke it.

`check_resume(workload)` runs the loop (a `trainrec.Workload`) without stopping, and for
each `at=K` checkpoints it after micro-step K, resumes in a process of its own and compares the
whole training state with the uninterrupted run's right after the restore (micro-step K)
and after every following micro-step: model, optimizer, scheduler, pending gradients, the
caller's state field by field, RNG states, and the batch each micro-step consumed where it
reports one (`Parts.report_batch`). The `ResumeReport` names the first divergence (micro-step,
component, key, max abs difference) and the likely cause with its fix, worked out from where
and when the divergence first appears (`trainrec.check.causes`).

The processes are the roles of `trainrec.check.run`: one reference run (it also writes the
checkpoints: a save does not change the run) and one process per `at`, two at a time, each
forked from a zygote (`trainrec.check.zygote`: the reference from one, the resumes from
another) or a fresh interpreter where forking is unsafe;
the first resumes start with the reference and import and build the workload while it
trains, then wait for it to end before they restore. Cost: the reference trains `steps`
micro-steps and each resume `steps - K`, so the check's wall time stays under (1 + len(at))
times the training time plus one process start-up each (`benchmarks/check.py`). A
workload named by a module this process has not imported (`trainrec check`) is not
imported here at all, which would add a start-up: the uninterrupted run imports it, refuses
what `settle` refuses and resolves the defaults, and this process reads those from it.
The reference keeps one snapshot of the training state per micro-step from the first `at` on,
in `workdir` (a temporary directory unless given): about (steps - min(at) + 1) times the
size of a checkpoint.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..workload.loop import Workload
from .causes import explain
from .forks import Forked, Zygote
from .report import Divergence, ResumeCheck, ResumeReport, WorkloadError
from .state import COMPONENTS, load_target, named_recorder

__all__ = [
    "Divergence",
    "ResumeCheck",
    "ResumeReport",
    "WorkloadError",
    "check_resume",
    "default_ats",
    "workload_ref",
]

_AT_RESTORE = ("pending", "model", "scheduler", "optimizer", "state", "rng", "data")
_AFTER = ("data", "rng", "state", "pending", "model", "optimizer", "scheduler")


# -- the check ------------------------------------------------------------------------------


def default_ats(steps: int, window: int) -> list[int]:
    """A mid-window micro-step (in the second window, where optimizer state exists), a
    window boundary and one two micro-steps before the end, each within 0 < K < steps."""
    mid = window + max(1, window // 2) if window > 1 else 1
    candidates = [mid, 2 * window, steps - 2]
    return sorted({k for k in candidates if 0 < k < steps})


def workload_ref(workload: Any) -> str:
    """The `module:attr` a fresh process imports `workload` by: the string itself, a
    class's own name, an instance's `ref`, or the name its module holds it under; for one
    defined in a script (`__main__`), `path/to/script.py:attr`. Raises `ValueError` when
    there is none (a class defined inside a function, or in an interactive session: a fresh
    process cannot import it)."""
    if isinstance(workload, str):
        return workload
    if isinstance(workload, type):
        ref = f"{workload.__module__}:{workload.__qualname__}"
    else:
        ref = getattr(workload, "ref", "") or ""
        if not ref:
            module = sys.modules.get(type(workload).__module__)
            name = next((k for k, v in vars(module).items() if v is workload), None) if module else None
            if name is None:
                raise ValueError(
                    f"{type(workload).__name__} has no `ref` and its module holds it under no "
                    "name: give it `ref = 'module:attr'` so that a fresh process can import it")
            ref = f"{type(workload).__module__}:{name}"
    module_name, _, attr = ref.rpartition(":")
    if module_name == "__main__":  # a script checking its own workload: its file, by path
        script = getattr(sys.modules["__main__"], "__file__", None)
        if script and "<locals>" not in attr:
            return f"{os.path.abspath(script)}:{attr}"
    if module_name == "__main__" or "<locals>" in attr or not attr:
        raise ValueError(f"{ref!r}: a fresh process cannot import this workload; define it in "
                         "an importable module (not __main__ or a function)")
    return ref


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a role: this one, with this interpreter's import path in front
    (what imported the workload here imports it there: a test's directory, a script's)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path if os.path.isdir(p or os.getcwd())]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


_Started = list[tuple["subprocess.Popen[str] | Forked", Path]]


def _start(args: list[str], out: Path, nproc: int, zygote: Zygote | None = None) -> _Started:
    """Start one role as `nproc` ranks, each writing its result to `out-r{rank}.json`:
    forked by `zygote` (`trainrec.check.zygote`), or as fresh interpreters without one."""
    port = str(_free_port())
    procs: _Started = []
    for rank in range(nproc):
        dist = {} if nproc == 1 else {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        rank_out = out.with_name(f"{out.name}-r{rank}.json")
        role = [*args, "--out", str(rank_out), "--launched", repr(time.time())]
        if zygote is not None:
            procs.append((zygote.fork(role, dist, out.with_name(f"{out.name}-r{rank}.log")),
                          rank_out))
            continue
        cmd = [sys.executable, "-m", "trainrec.check.run", *role]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=_child_env(dist)), rank_out))
    return procs


def _finish(procs: _Started, timeout: float, label: str) -> list[dict[str, Any]]:
    """The results of a started role, rank by rank. Raises `WorkloadError` when a rank
    fails, dies or outlives `timeout` (every rank is then killed)."""
    deadline = time.monotonic() + timeout
    results, failure = [], None
    for proc, rank_out in procs:
        try:
            log, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            for p, _ in procs:
                p.communicate()
            raise WorkloadError(f"the {label} did not finish in {timeout:g} s") from None
        result = json.loads(rank_out.read_text(encoding="utf-8")) if rank_out.exists() else None
        if result is None or "error" in result:
            detail = result["traceback"] if result else (log or "")[-4000:]
            failure = failure or f"the {label} failed:\n{detail}"
        else:
            results.append(result)
    if failure:
        raise WorkloadError(failure)
    return results


def check_resume(
    workload: Workload | type[Workload] | str, *, at: Sequence[int] | None = None,
    steps: int | None = None, window: int | None = None, recorder: str = "mpk",
    nproc: int = 1, seed: int = 0, plot: str | os.PathLike[str] | None = None,
    without_pending: bool | None = None, jobs: int = 2, timeout: float = 600.0,
    workdir: str | os.PathLike[str] | None = None,
    reference: str | os.PathLike[str] | None = None,
) -> ResumeReport:
    """Check that `workload` resumes bitwise from a checkpoint after each micro-step of `at`.

    Args:
        workload: a `Workload` instance, class or `"module:attr"` (see `workload_ref`).
        at: the micro-steps to checkpoint after (default `default_ats(steps, window)`).
        steps: micro-steps in all (default three windows).
        window: the accumulation window (default the workload's `window`).
        recorder: a name `trainrec.check.run.named_recorder` takes (default `"mpk"`).
        nproc: ranks per run, each with torchrun's environment (the workload initializes
            its process group in `build`, e.g. gloo).
        seed: given to `build`.
        plot: a PNG to draw the curves of each resume into (needs matplotlib); also runs
            each resume once without its pending gradients, for the curve beside it.
        without_pending: run those resumes without `plot` too (default: when plotting).
        jobs: resumes at a time, beside the uninterrupted run (`nproc` processes each);
            timeout: seconds a run may take (a resume: twice that, from its start beside
            the uninterrupted run).
        workdir: where to keep snapshots and checkpoints (default a temporary directory).
        reference: the `workdir` of an earlier check whose uninterrupted run (snapshots and
            checkpoints) this one compares with, instead of running its own: that check
            had the same steps, window, recorder, seed and nproc and checkpointed after
            every micro-step of `at`. Only for a workload whose uninterrupted run and
            checkpoints are that check's workload's, bit for bit: a variant that changes
            only its resume (`after_restore`, `load_checkpoint`), such as a fix being tried.

    Returns: the `ResumeReport` (`report.exact`, `report.checks[i].first_divergence`,
    `report.cause`; `str(report)` is what `trainrec check` prints).

    Raises: `ValueError` / `TypeError` for a workload that cannot be named or loaded or an
    impossible `at`, `steps`, `window` or `recorder`; `WorkloadError` when the workload
    itself fails in a run (its traceback in the message).
    """
    t_start = time.perf_counter()
    ref = workload_ref(workload)
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("plot= needs matplotlib: pip install 'trainrec[plot]'")
    reused_dir = None if reference is None else Path(reference)
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="trainrec-check-")
    wd = Path(workdir or tmp.name)  # type: ignore[union-attr]
    early: _Started | None = None
    forks = _Forks(ref, timeout)
    try:
        wd.mkdir(parents=True, exist_ok=True)
        if reused_dir is None and not isinstance(workload, Workload) and not _imported(ref):
            # importing the workload here would cost a process start-up: the uninterrupted
            # run imports it, refuses what `settle` refuses and resolves the defaults
            early = _start(["reference", "--workload", ref, "--recorder", recorder,
                            "--workdir", str(wd), "--seed", str(seed),
                            *(["--steps", str(steps)] if steps is not None else []),
                            *(["--window", str(window)] if window is not None else []),
                            "--at", *(map(str, at) if at is not None else ["default"])],
                           wd / "reference", nproc, forks.zygote("reference"))
        loaded = workload if isinstance(workload, Workload) else None if early else _load(ref)
        return _check_resume(
            ref, loaded, at=at, steps=steps,
            window=window, recorder=recorder, nproc=nproc, seed=seed, plot=plot,
            without_pending=without_pending, jobs=jobs, timeout=timeout, wd=wd,
            reference=reused_dir, early=early, t_start=t_start, forks=forks)
    finally:
        for proc, _ in early or ():
            if proc.poll() is None:  # refused before its result was awaited
                proc.kill()
                proc.communicate()
        forks.close()
        if tmp is not None:
            tmp.cleanup()


def settle(loaded: Any, at: Sequence[int] | None, steps: int | None, window: int | None,
           recorder: str) -> tuple[int, int, list[int]]:
    """`(steps, window, ats)` of a check of `loaded`, the defaults filled in; `TypeError`
    for an object that is no Workload, `ValueError` for an impossible setting."""
    missing = [n for n in ("state_type", "build", "micro_step", "apply_window") if not hasattr(loaded, n)]
    if missing:
        raise TypeError(f"{type(loaded).__name__} is not a trainrec Workload (it has no {', '.join(missing)})")
    window = int(getattr(loaded, "window", 4)) if window is None else window
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    steps = 3 * window if steps is None else steps
    if steps < 2:
        raise ValueError(f"steps must be at least 2, got {steps}")
    ats = sorted(set(default_ats(steps, window) if at is None else at))
    bad = [k for k in ats if not 0 < k < steps]
    if not ats or bad:
        raise ValueError(f"each at must be in 0 < K < steps={steps}; got {bad or 'none'}")
    named_recorder(loaded, recorder)  # ValueError for a name it does not know
    return steps, window, ats


def _await_resolved(early: _Started, timeout: float) -> tuple[int, int, list[int]]:
    """What the early uninterrupted run resolved (its rank 0's `.resolved.json`, written
    once it imported the workload); its refusal as `ValueError` / `TypeError`, its failure
    as `WorkloadError`."""
    proc, out = early[0]
    resolved = out.with_name(out.stem + ".resolved.json")
    deadline = time.monotonic() + timeout
    while not resolved.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if resolved.exists():
                break
            result = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
            if "usage" in result:
                raise (TypeError if result.get("usage_type") == "TypeError" else ValueError)(
                    result["usage"])
            _finish(early, 0.1, "uninterrupted run")  # raises the failure
            raise WorkloadError(f"the uninterrupted run did not start in {timeout:g} s")
        time.sleep(0.02)
    got = json.loads(resolved.read_text(encoding="utf-8"))
    return int(got["steps"]), int(got["window"]), [int(k) for k in got["at"]]


_KEPT = 4
"""Zygotes kept at most (each holds its framework's imports: a few hundred MB)."""


class _Forks:
    """The two zygotes of a check (`trainrec.check.zygote`): one forks the uninterrupted
    run, the other the resumes, so that a resume and the run it is compared with come from
    two interpreters (each with its own hash seed and memory layout, as fresh processes
    are: a loop that depends on either still diverges). They are started with the first
    run that needs them and kept for the next check of a workload of the same module in
    this process (same environment), while none of the files they imported changed (the
    `_KEPT` most recent);
    `zygote(role)` is `None` where runs start as fresh interpreters."""

    _kept: dict[tuple[str, ...], Zygote] = {}
    _spawned: dict[tuple[str, ...], Any] = {}  # started, not yet awaited
    _lock = threading.Lock()

    def __init__(self, ref: str, timeout: float) -> None:
        self._ref, self._timeout = ref, timeout
        self._env = _child_env({})
        self._module = ref.rpartition(":")[0]
        self._got: dict[str, Zygote | None] = {}

    def _key(self, role: str) -> tuple[str, ...]:
        return (role, self._module, os.getcwd(), *(f"{k}={v}" for k, v in sorted(self._env.items())))

    def zygote(self, role: str) -> Zygote | None:
        if role in self._got:
            return self._got[role]
        with self._lock:
            kept = self._kept.pop(self._key(role), None)
            if kept is not None and not kept.fresh():
                kept.close()
                kept = None
            if kept is None and role == "reference":  # the resumes' imports at the same time
                other = self._key("resume")
                if other not in self._kept and other not in self._spawned:
                    self._spawned[other] = Zygote.spawn(self._ref, self._env)
            spawned = self._spawned.pop(self._key(role), None)
            got = kept or Zygote.ready(spawned or Zygote.spawn(self._ref, self._env),
                                       self._timeout)
            self._got[role] = got
            if got is not None:
                self._kept[self._key(role)] = got
                if len(self._kept) == 1:
                    atexit.register(_Forks.close_all)
                while len(self._kept) > _KEPT:  # the oldest goes (a dict keeps the order)
                    self._kept.pop(next(iter(self._kept))).close()
        return got

    def close(self) -> None:
        """The zygotes stay for the next check (`close_all` ends them at exit)."""

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            kept, cls._kept = list(cls._kept.values()), {}
            spawned, cls._spawned = list(cls._spawned.values()), {}
        for z in kept:
            z.close()
        for proc in spawned:
            if proc is not None:
                proc.kill()
                proc.communicate()


def _imported(ref: str) -> bool:
    return ref.rpartition(":")[0] in sys.modules


def _load(ref: str) -> Any:
    """The workload `ref` names; `ValueError` when its module lacks it, `WorkloadError`
    when importing its module raises (the workload's own code failing)."""
    module, _, attr = ref.rpartition(":")
    try:
        return load_target(ref)
    except AttributeError as e:
        raise ValueError(f"{module} has no workload {attr!r} ({e})") from None
    except (ValueError, TypeError):
        raise
    except Exception as e:  # the user's module raised while importing or making the instance
        raise WorkloadError(f"importing the workload failed: {type(e).__name__}: {e}") from e


def _check_resume(
    ref: str, loaded: Any, *, at: Sequence[int] | None, steps: int | None, window: int | None,
    recorder: str, nproc: int, seed: int, plot: str | os.PathLike[str] | None,
    without_pending: bool | None, jobs: int, timeout: float, wd: Path, reference: Path | None,
    early: _Started | None, t_start: float, forks: _Forks,
) -> ResumeReport:
    if loaded is None:  # the uninterrupted run imported it and resolved the defaults
        steps, window, ats = _await_resolved(early or [], timeout)
    else:
        steps, window, ats = settle(loaded, at, steps, window, recorder)
    drop = plot is not None if without_pending is None else without_pending

    settings = {"steps": steps, "window": window, "recorder": recorder, "seed": seed,
                "nproc": nproc}
    reused = None if reference is None else _reused_reference(reference, settings, ats)
    common = ["--workload", ref, "--steps", str(steps), "--window", str(window),
              "--recorder", recorder, "--workdir", str(reference or wd), "--seed", str(seed)]
    runs = [(k, False) for k in ats] + ([(k, True) for k in ats] if drop else [])
    # the resumes start with the uninterrupted run: each imports and builds the workload
    # while it trains, then waits for it to end (its result file) before it restores
    started = None if reused else early or _start(
        ["reference", *common, "--at", *map(str, ats)], wd / "reference", nproc,
        forks.zygote("reference"))
    zygote = forks.zygote("resume")
    after = [] if started is None else [
        "--after", str(wd / "reference"), "--after-pid", *(str(p.pid) for p, _ in started)]
    with ThreadPoolExecutor(max_workers=max(1, jobs // nproc)) as pool:
        resumes = [pool.submit(lambda run: _finish(_start(
            ["resume", *common, "--at", str(run[0]), *after,
             *(["--drop-pending"] if run[1] else [])],
            wd / f"{'drop' if run[1] else 'resume'}-{run[0]}", nproc, zygote), 2 * timeout,
            f"resume after micro-step {run[0]}{' without pending gradients' if run[1] else ''}"),
            run) for run in runs]
        try:
            if started is None:
                reference_runs = reused["results"]  # type: ignore[index]
            else:
                reference_runs = _finish(started, timeout, "uninterrupted run")
                took = {k: reference_runs[0].get(k) for k in ("steps", "window", "at")}
                if took != {"steps": steps, "window": window, "at": ats}:
                    raise WorkloadError(
                        f"the uninterrupted run took {took}, this process "
                        f"{ {'steps': steps, 'window': window, 'at': ats} }: the "
                        "workload's window differs between processes")
                _write_manifest(wd, {**settings, "workload": ref, "at": ats,
                                     "results": reference_runs})
        except WorkloadError:
            for future in resumes:
                future.cancel()
            for _, rank_out in started or ():  # the started resumes end, seeing this
                if not rank_out.exists():
                    _write_json(rank_out, {"error": "the uninterrupted run failed"})
            raise
        done = [future.result() for future in resumes]
    results = dict(zip(runs, done))
    checks = tuple(_check(k, window, results[(k, False)], reference_runs,
                          results.get((k, True))) for k in ats)
    train_s = max(r["train_s"] for r in reference_runs)
    resumed = [r for rs in done for r in rs]
    timings = {"snapshot_s": max(r["snapshot_s"] for r in reference_runs),
               "save_s": max(r["save_s"] for r in reference_runs),
               "startup_s": max(r.get("startup_s", 0.0) for r in reference_runs),
               "resume_startup_s": max(r.get("startup_s", 0.0) for r in resumed),
               "resume_train_s": max(r["train_s"] for r in resumed),
               "runs": len(runs) + (reused is None),
               **({"forked_from_s": zygote.ready_s} if zygote is not None else {})}
    report = ResumeReport(ref, steps, window, recorder, nproc, checks,
                          time.perf_counter() - t_start, train_s, timings,
                          reused["workload"] if reused else None)
    if plot is not None:
        from .plot import draw

        draw(report, Path(plot))
    return report


_MANIFEST = "reference.json"


def _write_manifest(workdir: Path, manifest: dict[str, Any]) -> None:
    """What `reference=` checks before it reuses this workdir's uninterrupted run."""
    _write_json(workdir / _MANIFEST, manifest)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(tmp, path)


def _reused_reference(path: Path, settings: dict[str, Any], ats: list[int]) -> dict[str, Any]:
    """The manifest of the earlier check in `path`; `ValueError` when it cannot stand in
    for this check's uninterrupted run."""
    try:
        manifest: dict[str, Any] = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"reference {str(path)!r} holds no uninterrupted run of a check "
                         f"({_MANIFEST}: {e})") from None
    other = {k: manifest.get(k) for k in settings if manifest.get(k) != settings[k]}
    if other:
        raise ValueError(f"reference {str(path)!r} was run with {other}, this check has "
                         f"{ {k: settings[k] for k in other} }")
    missing = [k for k in ats if k not in manifest.get("at", [])]
    if missing:
        raise ValueError(f"reference {str(path)!r} checkpointed after micro-steps "
                         f"{manifest.get('at')}, not after {missing}")
    return manifest


def _curve(results: list[dict[str, Any]]) -> tuple[dict[str, float], ...]:
    """Per micro-step, the max over ranks of each component's difference."""
    steps = len(results[0]["steps"])
    return tuple({c: max(r["steps"][i]["worst"].get(c, 0.0) for r in results) for c in COMPONENTS}
                 for i in range(steps))


def _check(at: int, window: int, resumed: list[dict[str, Any]], reference: list[dict[str, Any]],
           dropped: list[dict[str, Any]] | None) -> ResumeCheck:
    first: tuple[int, int, int, dict[str, Any]] | None = None  # (micro, priority, rank, result)
    for result in resumed:
        for step in result["steps"]:
            if step["diffs"]:
                order = _AT_RESTORE if step["micro"] == at else _AFTER
                prio = min(order.index(c) for c, _, _ in step["diffs"])
                key = (step["micro"], prio, result["rank"], result)
                if first is None or key[:3] < first[:3]:
                    first = key
                break
    curve = _curve(resumed)
    lost = None if dropped is None else _curve(dropped)
    if first is None:
        return ResumeCheck(at, None, "", curve, (), lost)
    micro, prio, rank, result = first
    step = next(s for s in result["steps"] if s["micro"] == micro)
    order = _AT_RESTORE if micro == at else _AFTER
    component = order[prio]
    shown_rank = rank if len(resumed) > 1 else None
    rows = sorted(step["diffs"], key=lambda r: order.index(r[0]))  # stable: walk order within
    differing = tuple(Divergence(micro, c, k, float(g), shown_rank) for c, k, g in rows)
    divergence = next(d for d in differing if d.component == component)
    ref_extras = next(r for r in reference if r["rank"] == rank)["extras"].get(str(at), {})
    cause = explain(at=at, window=window, divergence=divergence, differing=differing,
                    step=step, saved=result["saved"], ref_extras=ref_extras,
                    got_extras=result["extras"],
                    equal_before=[s["micro"] for s in result["steps"] if s["micro"] < micro],
                    own_checkpoint=bool(result.get("own_checkpoint")))
    return ResumeCheck(at, divergence, cause, curve, differing, lost)
