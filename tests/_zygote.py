"""A fork server for tests whose processes import torch, jax or transformers (seconds of CPU
each): it imports them once, and each process a test asks for is a child forked from it,
a process of its own that runs `python ARGS` as a fresh interpreter would.

    python tests/_zygote.py MODULE...

imports numpy and the MODULEs, checks that they started no thread beyond numpy's BLAS pool
(a fork copies only the thread that forks: a lock another thread held would stay locked in
the child; OpenBLAS stops its pool at a fork and restarts it), prints "ready",
then reads requests from stdin, one a line:

    {"jobs": [{"argv": ["-m", "trainrec.roles", ...] or ["script.py", ...], "env": {...},
               "cwd": ..., "stdout": PATH, "stderr": PATH, "timeout": SECONDS}, ...],
     "parallel": N}

and runs each job in a child, N at a time, printing "exit INDEX CODE" as each ends (CODE
as `subprocess` gives it: negative for a signal) and "done" after the last. A child starts
as `python ARGS` would: `sys.argv` and `sys.path[0]` set, the environment the zygote's
with the job's `env` on top (only variables read at run time may differ: the zygote was
started with those read at import), stdin /dev/null, stdout and stderr its files, Python's
and numpy's global RNGs seeded from the OS afresh; it ends as a program does (non-daemon
threads joined, atexit functions run). A job's `timeout` ends it with SIGALRM.

What a fork cannot give a child is a hash seed of its own: children of one zygote share
its `PYTHONHASHSEED`. Tests whose claim is about two processes (a run and its resume, two
ranks) run them from two zygotes.

`Zygote` is the test's end of it.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _child(job: dict[str, Any]) -> int:
    """Run `job` in this (forked) process as `python ARGS`; the exit code."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, job.get("stdout")), (2, job.get("stderr"))):
        out = os.open(path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.update(job.get("env") or {})
    if job.get("cwd"):
        os.chdir(job["cwd"])
    if job.get("timeout"):
        signal.alarm(int(job["timeout"]))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import runpy

    argv = list(job["argv"])
    code: int = 0
    try:
        if argv[0] == "-m":
            ran = argv[1]
            if hasattr(sys.modules.get(ran), "__path__"):  # a package runs its __main__
                ran += ".__main__"
            if ran in sys.modules:  # it would run as a second copy of itself
                raise RuntimeError(f"{ran} was imported by the zygote: leave it out")
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # as at a program's end
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return code


def _serve(request: dict[str, Any]) -> None:
    jobs: list[dict[str, Any]] = request["jobs"]
    parallel = max(1, int(request.get("parallel") or len(jobs)))
    running: dict[int, int] = {}
    waiting = list(enumerate(jobs))
    while waiting or running:
        while waiting and len(running) < parallel:
            index, job = waiting.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(job)
                finally:
                    os._exit(code)
            running[pid] = index
        pid, status = os.wait()
        if pid in running:
            print("exit", running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
    print("done", flush=True)


def main(modules: list[str]) -> None:
    import threading

    import numpy  # noqa: F401  # its BLAS pool, which OpenBLAS stops at a fork and restarts
    baseline = _threads()
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() != 1 or _threads() != baseline:
        print(f"error: the imports of {modules} started threads ({_threads()} now, {baseline} "
              f"after numpy's): forking is unsafe", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    for line in iter(sys.stdin.readline, ""):
        _serve(json.loads(line))


class Zygote:
    """A `_zygote.py` process that imported `modules` in `env` (default: this process's);
    `submit` a list of jobs, `collect` them as `subprocess.CompletedProcess`es."""

    def __init__(self, modules: list[str], env: dict[str, str] | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.proc = subprocess.Popen([sys.executable, __file__, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.count = 0
        self.pending: list[list[dict[str, Any]]] = []
        self.modules = modules
        self.started = False

    def _ready(self) -> None:
        """Wait for the imports (once): a zygote made early imports while others work."""
        if not self.started:
            ready = self.stdout.readline().strip()
            if ready != "ready":
                self.close()
                raise RuntimeError(f"the zygote importing {self.modules} did not start: {ready!r}")
            self.started = True

    def submit(self, jobs: list[dict[str, Any]], parallel: int | None = None) -> None:
        """Start `jobs` (each: "argv", and optionally "env", "cwd", "timeout"); one request
        at a time is collected, in order."""
        self._ready()
        sent = []
        for job in jobs:
            self.count += 1
            sent.append({**job, "stdout": str(self.folder / f"{self.count}.out"),
                         "stderr": str(self.folder / f"{self.count}.err")})
        self.stdin.write(json.dumps({"jobs": sent, "parallel": parallel}) + "\n")
        self.stdin.flush()
        self.pending.append(sent)

    def collect(self) -> list[subprocess.CompletedProcess[str]]:
        """The oldest request's jobs once all ended: exit code, stdout and stderr each."""
        sent = self.pending.pop(0)
        codes: dict[int, int] = {}
        while (line := self.stdout.readline().strip()) != "done":
            if not line:
                raise RuntimeError(f"the zygote ended ({self.proc.wait()}) while running jobs")
            _, index, code = line.split()
            codes[int(index)] = int(code)
        out = []
        for i, job in enumerate(sent):
            # decoded as subprocess.run(..., text=True) does: bytes that are not text raise
            stdout, stderr = (Path(job[k]).read_text() for k in ("stdout", "stderr"))
            out.append(subprocess.CompletedProcess(job["argv"], codes[i], stdout, stderr))
            for k in ("stdout", "stderr"):
                os.unlink(job[k])
        return out

    def run(self, jobs: list[dict[str, Any]], parallel: int | None = None) -> list[subprocess.CompletedProcess[str]]:
        self.submit(jobs, parallel)
        return self.collect()

    def close(self) -> None:
        """End the zygote (and reap it: its children's CPU time counts as its own)."""
        if self.proc.poll() is None:
            self.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stdout.close()
        try:
            os.rmdir(self.folder)
        except OSError:
            pass

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    main(sys.argv[1:])
