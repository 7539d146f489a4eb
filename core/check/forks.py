"""The driver's side of `trainrec check`'s fork servers (`trainrec.check.zygote`, whose
docstring has the protocol): `Zygote.spawn` starts one, `Zygote.ready` waits until it has
imported the workload, `Zygote.fork` starts a run as a `Forked` (the part of
`subprocess.Popen` the driver uses). It imports nothing of the roles it starts, so that
`trainrec.check.resume` can use it while `trainrec.check.run` imports `resume`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["Forked", "Zygote"]


class Forked:
    """A run the zygote forked, with the part of `subprocess.Popen` the driver uses: `pid`,
    `poll()`, `kill()`, `communicate(timeout)` (its log as the output)."""

    def __init__(self, zygote: Zygote, pid: int, log: Path) -> None:
        self.pid, self._zygote, self._log = pid, zygote, log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._zygote.exits.get(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it has just ended
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._zygote.changed:
            while self.pid not in self._zygote.exits:
                if self._zygote.gone:  # the zygote died: so did (or will) its runs
                    self.kill()
                    self._zygote.exits.setdefault(self.pid, -signal.SIGKILL)
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
                self._zygote.changed.wait(0.5 if left is None else min(left, 0.5))
        self.poll()
        try:
            return self._log.read_text(encoding="utf-8", errors="replace"), None
        except OSError:
            return "", None


class Zygote:
    """A zygote that is ready (`Zygote.spawn`, then `Zygote.ready`): `fork(args, env, log)`
    starts a run, `close()` ends it."""

    def __init__(self, proc: subprocess.Popen[str], ready_s: float) -> None:
        self._proc, self.ready_s = proc, ready_s
        self.exits: dict[int, int] = {}
        self.gone = False
        self.changed = threading.Condition()
        self._pids: list[int] = []
        self._answers: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, ref: str, env: dict[str, str]) -> subprocess.Popen[str] | None:
        """Start a zygote for `ref` (`None` where runs start as fresh interpreters: no fork
        here, or `TRAINREC_CHECK_START=exec`); `Zygote.ready(proc, timeout)` waits for it."""
        if os.environ.get("TRAINREC_CHECK_START", "fork") == "exec" or not hasattr(os, "fork"):
            return None
        return subprocess.Popen([sys.executable, "-m", "trainrec.check.zygote", ref],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)

    @classmethod
    def ready(cls, proc: subprocess.Popen[str] | None, timeout: float) -> Zygote | None:
        """The spawned zygote once it has imported the workload; `None` (and it ended) when
        it found forking unsafe, failed or did not answer within `timeout` seconds."""
        if proc is None:
            return None
        stdout = proc.stdout
        assert stdout is not None
        ready: list[str] = []
        waiter = threading.Thread(target=lambda: ready.append(stdout.readline()), daemon=True)
        waiter.start()
        waiter.join(timeout)
        first = ready[0].split(None, 1) if ready else []
        if len(first) != 2 or first[0] != "ready":
            proc.kill()
            proc.communicate()
            return None
        return cls(proc, float(first[1]))

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            word, *rest = line.split()
            with self.changed:
                if word == "pid":
                    self._pids.append(int(rest[0]))
                elif word == "exit":
                    self.exits[int(rest[0])] = int(rest[1])
                elif word in ("fresh", "stale"):
                    self._answers.append(line.strip())
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def fork(self, args: list[str], env: dict[str, str], log: Path) -> Forked:
        """Fork one run; `RuntimeError` when the zygote is gone."""
        request = json.dumps({"args": args, "env": env, "log": str(log)}) + "\n"
        with self._lock, self.changed:
            seen = len(self._pids)
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(f"the check's fork server is gone ({e})") from None
            while len(self._pids) == seen:
                if self.gone:
                    raise RuntimeError("the check's fork server is gone")
                self.changed.wait(0.5)
            return Forked(self, self._pids[seen], log)

    def fresh(self, timeout: float = 30.0) -> bool:
        """Whether the zygote is alive and every module it imported is unchanged on disk."""
        with self._lock, self.changed:
            seen = len(self._answers)
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write('{"fresh": true}\n')
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                return False
            deadline = time.monotonic() + timeout
            while len(self._answers) == seen:
                if self.gone or time.monotonic() > deadline:
                    return False
                self.changed.wait(0.5)
            return self._answers[seen] == "fresh"

    def close(self) -> None:
        """Kill the runs still running and end the zygote."""
        with self.changed:
            running = [p for p in self._pids if p not in self.exits]
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)
