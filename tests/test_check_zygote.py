"""The fork server of `trainrec check` (`trainrec.check.zygote`): runs forked from a process
that imported the workload once are as separate as fresh interpreters (numpy's global RNG
reseeded, the uninterrupted run and the resumes from two interpreters), a zygote whose
imported files changed is replaced, a process that cannot fork safely (JAX's backends
initialized) and `TRAINREC_CHECK_START=exec` start fresh interpreters, and no run outlives
its zygote."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainrec.check.forks import Zygote
from trainrec.check.resume import check_resume

HERE = Path(__file__).resolve().parent


def test_a_loop_exact_in_forked_runs_is_reported_as_forked():
    report = check_resume("check_core_loops:NUMPY_LOOP", at=[2, 5], steps=6)
    assert report.exact, str(report)
    assert report.timings["forked_from_s"] > 0
    assert "forked from one that imported the workload" in str(report)


def test_numpy_global_randomness_not_recorded_diverges_as_in_fresh_processes():
    report = check_resume("check_fork_loops:UNSEEDED", at=[3], steps=6)
    assert "forked_from_s" in report.timings
    assert not report.exact, str(report)
    assert "extras['scale']" in report.cause, str(report)


@pytest.mark.skipif(bool(os.environ.get("PYTHONHASHSEED")), reason="PYTHONHASHSEED is set: one hash everywhere")
def test_a_loop_depending_on_the_hash_seed_diverges_as_in_fresh_processes():
    report = check_resume("check_fork_loops:HASHED", at=[3], steps=6)
    assert "forked_from_s" in report.timings
    assert not report.exact, str(report)


def test_exec_starts_fresh_interpreters(monkeypatch):
    monkeypatch.setenv("TRAINREC_CHECK_START", "exec")
    report = check_resume("check_core_loops:NUMPY_LOOP", at=[5], steps=6)
    assert report.exact and "forked_from_s" not in report.timings, str(report)
    bad = check_resume("check_fork_loops:UNSEEDED", at=[3], steps=6)
    assert not bad.exact and "extras['scale']" in bad.cause, str(bad)


def test_a_process_with_jax_backends_initialized_is_not_forked():
    pytest.importorskip("jax")
    report = check_resume("check_fork_jax_loop:LOOP", at=[5], steps=6)
    assert report.exact and "forked_from_s" not in report.timings, str(report)


def test_a_kept_zygote_whose_files_changed_is_replaced(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "zygote_edited_loop.py"
    module.write_text(textwrap.dedent("""
        from check_core_loops import NumpyLoop
        LOOP = NumpyLoop()
    """))
    assert check_resume("zygote_edited_loop:LOOP", at=[5], steps=6).exact
    module.write_text(textwrap.dedent("""
        from check_core_loops import NumpyNewAccumulator
        LOOP = NumpyNewAccumulator()  # edited: the resume drops the pending gradients
    """))
    st = module.stat()
    os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    edited = check_resume("zygote_edited_loop:LOOP", at=[5], steps=6)
    assert not edited.exact and "new accumulator" in edited.cause, str(edited)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the runs' parent-death signal is Linux's")
@pytest.mark.parametrize("end", ["close", "sigkill"])
def test_no_run_outlives_its_zygote(tmp_path, end):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    zygote = Zygote.ready(Zygote.spawn("check_core_loops:NUMPY_LOOP", env), 60)
    assert zygote is not None
    run = zygote.fork(["reference", "--workload", "check_core_loops:NUMPY_LOOP", "--steps",
                       "100000000", "--window", "4", "--at", "99999999", "--workdir",
                       str(tmp_path), "--out", str(tmp_path / "out.json")], {}, tmp_path / "log")
    time.sleep(0.5)
    assert run.poll() is None and _alive(run.pid)
    if end == "close":
        zygote.close()
        assert run.poll() == -signal.SIGKILL
    else:
        os.kill(zygote._proc.pid, signal.SIGKILL)
        zygote._proc.wait()
    deadline = time.monotonic() + 10
    while _alive(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(run.pid)
    zygote.close()


def test_runs_forked_from_one_zygote_draw_their_own_numpy_global_randomness(tmp_path):
    """As two fresh interpreters would: numpy's global RNG is reseeded in each run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    zygote = Zygote.ready(Zygote.spawn("check_fork_loops:UNSEEDED", env), 60)
    assert zygote is not None
    try:
        scales = []
        for i in range(2):
            out = tmp_path / f"out{i}.json"
            run = zygote.fork(["reference", "--workload", "check_fork_loops:UNSEEDED", "--steps", "2",
                               "--window", "2", "--at", "1", "--workdir", str(tmp_path / f"w{i}"),
                               "--out", str(out)], {}, tmp_path / f"log{i}")
            log, _ = run.communicate(60)
            assert run.returncode == 0, log
            scales.append(json.loads(out.read_text())["extras"]["1"]["values"]["scale"])
        assert scales[0] != scales[1]
    finally:
        zygote.close()
