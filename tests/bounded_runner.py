"""Loads crafted files in a forked child each and reports how each load ended, its peak
memory and its CPU time: `python tests/bounded_runner.py CASES.json` prints one JSON line
per case. Used by test_bounded.py; a separate process, so the measurement sees only the
load (imports are done once, before the first fork)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import select
import signal
import sys
import time

TIMEOUT_S = 30
"""A load that takes longer is killed (the test then fails on it)."""


def _recorder(name: str):
    import trainrec

    if name == "torch":
        from trainrec.adapters.torch import TorchFileRecorder

        return TorchFileRecorder(trainrec.NativePrecisionSettings())
    if name == "flax":
        from trainrec.adapters.jax.recorder import FlaxMsgpackFileRecorder

        return FlaxMsgpackFileRecorder(trainrec.NativePrecisionSettings())
    if name == "orbax":
        from trainrec.adapters.jax import OrbaxRecorder

        return OrbaxRecorder(trainrec.NativePrecisionSettings())
    return {"mpk": trainrec.NamedMpkFileRecorder, "gz": trainrec.NamedMpkGzFileRecorder,
            "bytes": trainrec.NamedMpkBytesRecorder}[name](trainrec.NativePrecisionSettings())


def _run(case: dict) -> str:
    from trainrec import RecorderError

    if case["kind"] == "cli":
        from trainrec.cli.commands import main

        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = main(case["argv"])
        except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
            return f"raised {type(e).__name__}: {e}"
        return f"exit {code}"
    if case["kind"] == "metrics":  # a manager reading a step's metrics (a warning, or {})
        import warnings

        from trainrec import CheckpointManager

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = CheckpointManager(case["path"]).metrics(case["step"])
            except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
                return f"raised {type(e).__name__}: {e}"
        said = "; ".join(str(w.message) for w in caught)
        return f"metrics {got} warned: {said}"
    r = _recorder(case["recorder"])
    args = case["path"]
    if case["recorder"] == "bytes":
        with open(args, "rb") as f:
            args = f.read()
    try:
        r.read(args, **({"mmap": True} if case.get("mmap") else {}))
    except RecorderError as e:
        return f"RecorderError {type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
        return f"raised {type(e).__name__}: {e}"
    return "loaded"


def _measure(case: dict) -> dict:
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one load, measured from its own start
        os.close(rd)
        start = resource.getrusage(resource.RUSAGE_SELF)
        outcome = _run(case)
        end = resource.getrusage(resource.RUSAGE_SELF)
        result = {"id": case["id"], "outcome": outcome[:300],
                  "rss_mib": (end.ru_maxrss - start.ru_maxrss) / 1024,
                  "cpu_s": end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime}
        os.write(wr, json.dumps(result).encode())
        os._exit(0)
    os.close(wr)
    chunks = []
    deadline = time.monotonic() + TIMEOUT_S
    while select.select([rd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(rd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(rd)
    os.waitpid(pid, 0)
    if not chunks:
        return {"id": case["id"], "outcome": f"no answer within {TIMEOUT_S} s (killed) or the child died",
                "rss_mib": 0, "cpu_s": TIMEOUT_S}
    return json.loads(b"".join(chunks))


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    import trainrec  # noqa: F401 - imported once, before the forks
    import trainrec.cli.commands  # noqa: F401

    for name in {c.get("recorder") for c in cases} | {"torch", "flax"}:
        if name in ("torch", "flax", "orbax"):
            with contextlib.suppress(ImportError):
                _recorder(name)
    for case in cases:
        print(json.dumps(_measure(case)), flush=True)


if __name__ == "__main__":
    main()
