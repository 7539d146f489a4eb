"""The fork server of `trainrec check`: `python -m trainrec.check.zygote WORKLOAD`.

A check runs its workload in several processes (the uninterrupted run and one per resume,
times `nproc` ranks). Each fresh interpreter would import the framework again (PyTorch:
about 4 s of CPU with the optimizer's lazy imports; Lightning: 8 s); the zygote imports
the workload's module once, then forks every run from itself. A forked run is still a
process of its own, with its own memory: nothing of another run reaches it, and the
zygote itself never builds or trains the workload. What a fresh interpreter would start
with differently is made the same: `random` is reseeded from the OS at the fork (by
CPython) and so is numpy's global RNG (here).

A fork is safe only where the process has no state that a fork breaks: the adapters say
what that is for their framework through the entry point group `FORK_PREPARE_GROUP`
(a CUDA context, JAX's initialized backends). Each prepare may also import what every run
of its framework imports anyway (the zygote pays it once). The zygote answers `ready` when
forking is safe, `unsafe REASON` when it is not (the driver then starts fresh interpreters,
`trainrec.check.resume`), and `TRAINREC_CHECK_START=exec` asks for fresh interpreters always.

The driver's side is `trainrec.check.forks` (it imports nothing of this module, which
imports the roles). A driver keeps its zygotes for the next check of the same module (`trainrec.check.resume`):
before each reuse it asks `{"fresh": true}`, and the zygote answers `fresh` while every
source file of every module it imported is as it was then (size and mtime), `stale PATH`
once one changed (the driver then ends it and starts another: no check runs old code).

Protocol (one line each): the driver writes `{"args": [...], "env": {...}, "log": PATH}` as
JSON to stdin; the zygote forks a run of `trainrec.check.run.run_role(args)` with `env`
added to its environment and its stdout and stderr in `log`, and answers `pid PID`; when a
run ends it answers `exit PID CODE` (a signal's: minus its number). Its stdin closing ends
it (after its runs are killed).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import select
import signal
import sys
import time
import traceback
from importlib import metadata
from typing import Any

__all__ = ["FORK_PREPARE_GROUP", "fork_hazard", "main"]

FORK_PREPARE_GROUP = "trainrec.fork_prepare"
"""Entry points `framework = "module:function"`: once the zygote has imported the workload,
each whose `framework` module is imported is called with no arguments; it returns `None`
when a fork is safe (having imported what its framework's runs import anyway), or the reason
it is not, as a sentence."""


def fork_hazard() -> str | None:
    """The first reason a registered prepare gives that this process must not fork, or
    `None`; a prepare that raises is a reason too (its error)."""
    if not hasattr(os, "fork"):
        return "this platform has no fork"
    for ep in metadata.entry_points(group=FORK_PREPARE_GROUP):
        if ep.name not in sys.modules:
            continue
        try:
            reason = ep.load()()
        except Exception as e:  # a broken prepare must not make a fork look safe
            return f"the {ep.name} fork check failed: {type(e).__name__}: {e}"
        if reason:
            return str(reason)
    return None


def _import_module_of(ref: str) -> None:
    """Import the module `ref` (`module:attr` or `path/script.py:attr`) names, as the runs'
    `load_target` would; an import that fails is left to the runs, which report it."""
    from .state import SCRIPT_MODULE

    module, _, _ = ref.rpartition(":")
    try:
        if not module.endswith(".py"):
            importlib.import_module(module)
            return
        spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, module)
        if spec is None or spec.loader is None:
            return
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[SCRIPT_MODULE] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[SCRIPT_MODULE]
            raise
    except Exception:  # noqa: BLE001 - each run imports it again and reports the error
        for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
            del sys.modules[name]


def _sources() -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of the source file of each imported module."""
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            try:
                st = os.stat(path)
            except OSError:
                continue
            found[path] = (st.st_size, st.st_mtime_ns)
    return found


def _changed(sources: dict[str, tuple[int, int]]) -> str | None:
    for path, seen in sources.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_size, st.st_mtime_ns) != seen:
            return path
    return None


def _die_with_parent() -> None:
    """On Linux, have this process killed when the zygote dies (killed itself, a run
    would otherwise live on unseen)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass
        if os.getppid() == 1:  # the zygote died before the prctl
            os._exit(1)


def _run(request: dict[str, Any]) -> None:
    """In the forked child: become the run `request` asks for, then exit."""
    code = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        os.environ.update(request["env"])
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()  # from the OS, as in a fresh interpreter
        from .run import run_role

        sys.argv = ["python -m trainrec.check.run", *request["args"]]
        code = run_role(request["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainrec.check.zygote WORKLOAD", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    from . import run as _run_module  # noqa: F401 - what every run imports

    _import_module_of(args[0])
    reason = fork_hazard()
    out = sys.stdout
    out.write(f"unsafe {reason}\n" if reason else f"ready {time.perf_counter() - t0:.3f}\n")
    out.flush()
    if reason:
        return 0
    sources = _sources()
    children: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    open_ = True
    while open_ or children:
        if open_:
            readable, _, _ = select.select([stdin], [], [], 0.02)
            if readable:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    open_ = False
                    for pid in children:  # the driver is gone: so are its runs
                        os.kill(pid, signal.SIGKILL)
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    if request.get("fresh"):
                        changed = _changed(sources)
                        out.write(f"stale {changed}\n" if changed else "fresh\n")
                        out.flush()
                        continue
                    out.flush()
                    pid = os.fork()
                    if pid == 0:
                        _run(request)
                    children.add(pid)
                    out.write(f"pid {pid}\n")
                    out.flush()
        else:
            time.sleep(0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            try:
                out.write(f"exit {pid} {code}\n")
                out.flush()
            except BrokenPipeError:
                open_ = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
