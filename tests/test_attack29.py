"""Attacks of issue 29 on the manager's directory, the readers and the command line: each
test names the attack and holds the code to its refusal (or to its being safe).

- the manager never writes or reads outside its directory: links and special files at
  its names are refused or ignored with a warning, never followed, never listed;
- one writer per directory (the lock), a step is never replaced, and metrics are bound
  to their checkpoint by the save's id;
- no reader waits on a FIFO or reads a device; JSON reads bounded in bytes, values and
  depth; the NamedMpk empty-chunk payload refused at once (tests/bounded_runner.py: each
  case in a forked child, its CPU time and memory measured);
- only `RecorderError` out of saves, retention and loads; `trainrec convert` refuses what
  it cannot convert; a mapped file replaced by a save stays intact.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import trainrec
import trainrec.manager.local
from trainrec import (
    CheckpointManager,
    CorruptRecordError,
    FileMissingError,
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    TrainingRecord,
)
from trainrec.adapters.numpy import MLP, AdamW

HERE = Path(__file__).parent
NATIVE = NativePrecisionSettings()
CPU_S = 1.0
SLACK_MIB = 48


@trainrec.record
class Tag:
    step: int


def _record(step: int) -> TrainingRecord:
    model = MLP([4, 4, 2], seed=0)
    for v in model.params.values():
        v[...] = step
    return TrainingRecord.capture(model, AdamW(), None, GradientsAccumulator(), Tag(step))


def _within(seconds: float, fn) -> str:
    """Run `fn()` in a forked child; its outcome ("ok ...", "raised Type: message"), or
    "hung" when it has not finished in `seconds` (the child is then killed)."""
    rd, wr = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's: the child never uses it
        pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            out = f"ok {fn()!r}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"raised {type(e).__name__}: {e}"
        os.write(wr, out.encode()[:4000])
        os._exit(0)
    os.close(wr)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(rd)
        return "hung"
    with os.fdopen(rd, "rb") as f:
        return f.read().decode()


# -- item 1: the manager never writes or reads outside its directory ------------------------


def test_a_link_at_a_future_metrics_name_is_never_written_through(tmp_path):
    """The attack: a link at `step-N.metrics.json` made the save overwrite what it points
    to, outside the directory."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    run = tmp_path / "run"
    mgr = CheckpointManager(run)
    (run / "step-00000002.metrics.json").symlink_to(outside)
    mgr.save(1, _record(1), block=True)
    mgr.save(2, _record(2), metrics={"loss": 0.5})
    with pytest.raises(RecorderError, match=r"step-00000002.metrics.json exists already \(a symbolic link\)"):
        mgr.wait()
    assert outside.read_bytes() == b"precious"
    assert mgr.steps() == [1] and (run / "step-00000002.metrics.json").is_symlink()
    mgr.save(3, _record(3), block=True)  # later saves go on
    assert mgr.steps() == [1, 3]


def test_a_dangling_link_at_a_future_step_never_creates_a_file_outside(tmp_path):
    """The attack: a dangling link at `step-N.mpk` made the save create the checkpoint at
    its target, outside the directory."""
    run, target = tmp_path / "run", tmp_path / "elsewhere" / "planted.mpk"
    target.parent.mkdir()
    mgr = CheckpointManager(run)
    (run / "step-00000004.mpk").symlink_to(target)
    mgr.save(4, _record(4))
    with pytest.raises(RecorderError, match=r"step-00000004.mpk exists already \(a symbolic link\).*never replaced"):
        with pytest.warns(UserWarning, match="step-00000004.mpk .* is a symbolic link"):
            mgr.wait()
    assert not target.exists()
    assert not (run / "step-00000004.metrics.json").exists()  # the failed save took its metrics back
    assert mgr.steps() == []


def test_a_link_to_an_outside_checkpoint_is_not_a_step_and_is_never_overwritten(tmp_path):
    """The attack: a link to an outside file was listed as a step (and loaded), and saving
    that step number overwrote the file it points to."""
    foreign = tmp_path / "foreign.mpk"
    TrainingRecord.save(_record(7), NamedMpkFileRecorder(NATIVE), foreign)
    before = foreign.read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-00000007.mpk").symlink_to(foreign)
    with pytest.warns(UserWarning, match="step-00000007.mpk .* is a symbolic link, not a checkpoint"):
        mgr = CheckpointManager(run)
    assert mgr.steps() == [] and mgr.latest_step() is None
    with pytest.raises(FileMissingError, match="no complete checkpoint for step 7"):
        mgr.load(7)
    mgr.save(7, _record(8))
    with pytest.raises(RecorderError, match="exists already"):
        mgr.wait()
    assert foreign.read_bytes() == before


def test_special_files_at_step_names_are_never_opened_or_listed(tmp_path):
    """A FIFO at a step's name or at a listed step's metrics: not listed, not opened (a
    FIFO would block the reader), a warning; retention with `best=` goes on."""
    run = tmp_path / "run"
    mgr = CheckpointManager(run, keep_last=1, best=("loss", "min", 1))
    mgr.save(1, _record(1), metrics={"loss": 0.1}, block=True)
    mgr.close()  # the child below writes (a forked child never holds its parent's lock)
    os.mkfifo(run / "step-00000005.mpk")
    os.unlink(run / "step-00000001.metrics.json")
    os.mkfifo(run / "step-00000001.metrics.json")

    def save_two():
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr = CheckpointManager(run, keep_last=1, best=("loss", "min", 1))
            mgr.save(2, _record(2), metrics={"loss": 0.9}, block=True)
            return mgr.steps(), sorted(str(w.message) for w in caught)

    outcome = _within(20, save_two)
    assert outcome.startswith("ok ([1, 2]"), outcome  # step 1 has no readable metrics: kept
    assert "unreadable metrics of step 1" in outcome and "a FIFO" in outcome


def test_a_fifo_at_a_future_metrics_name_does_not_hang_a_blocking_save(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "step-00000003.metrics.json")
    outcome = _within(20, lambda: CheckpointManager(run).save(3, _record(3), metrics={"loss": 1.0},
                                                              block=True))
    assert outcome.startswith("raised RecorderError") and "exists already (a FIFO)" in outcome, outcome


def test_a_link_at_the_lock_file_is_refused_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".trainrec-lock").symlink_to(outside)
    with pytest.raises(RecorderError, match="lock file is a symbolic link"):
        CheckpointManager(run)
    assert outside.read_bytes() == b"keep"


@pytest.fixture
def orbax_recorder():
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    from trainrec.adapters.jax import OrbaxRecorder

    return OrbaxRecorder(NATIVE)


def test_orbax_retention_meeting_a_link_at_its_delete_name_goes_on(tmp_path, orbax_recorder):
    """The attack: a link at `.step-N.orbax.trainrec-del` made retention raise
    `NotADirectoryError`, and every later save fail the same way."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    run = tmp_path / "run"
    mgr = CheckpointManager(run, orbax_recorder, keep_last=1)
    (run / ".step-00000001.orbax.trainrec-del").symlink_to(outside)
    (run / ".step-00000002.orbax.trainrec-del").write_text("a file")
    for s in (1, 2, 3):
        mgr.save(s, _record(s), block=True)
    assert mgr.steps() == [3]
    assert (outside / "keep.txt").read_text() == "keep"
    assert mgr.load(3, state_type=Tag).state.step == 3


# -- item 2: one writer per directory -------------------------------------------------------


def test_a_second_manager_on_one_directory_fails_naming_the_holder(tmp_path):
    first = CheckpointManager(tmp_path)
    first.save(1, _record(1), block=True)
    with pytest.raises(RecorderError, match=rf"pid {os.getpid()} on host '{socket.gethostname()}'.*this process"):
        CheckpointManager(tmp_path)
    reader = CheckpointManager(tmp_path, read_only=True)  # reading needs no lock
    assert reader.steps() == [1] and reader.load(1, state_type=Tag).state.step == 1
    with pytest.raises(ValueError, match="read_only=True: it never writes"):
        reader.save(2, _record(2))
    first.close()
    second = CheckpointManager(tmp_path)  # the lock is free once the first is closed
    with pytest.raises(RecorderError, match="another CheckpointManager writes"):
        first.save(2, _record(2))  # a closed manager takes the lock again to save
    second.save(2, _record(2), block=True)
    del second  # collected: its lock goes with it
    first.save(3, _record(3), block=True)
    assert first.steps() == [1, 2, 3]


def test_a_read_only_manager_creates_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "not-yet", read_only=True)
    assert mgr.steps() == [] and not (tmp_path / "not-yet").exists()
    with pytest.raises(TypeError, match="read_only must be a bool"):
        CheckpointManager(tmp_path, read_only="yes")


_HOLDER = textwrap.dedent("""
    import sys, time, numpy as np, trainrec
    from trainrec import CheckpointManager, GradientsAccumulator, TrainingRecord
    from trainrec.adapters.numpy import MLP, AdamW

    @trainrec.record
    class Tag:
        step: int

    mgr = CheckpointManager(sys.argv[1], keep_last=None)
    for s in range(1, 41):
        mgr.save(s, TrainingRecord.capture(MLP([4, 4, 2], seed=s), AdamW(), None,
                                           GradientsAccumulator(), Tag(s)), metrics={"run": 1})
    mgr.wait()
    print("holding", flush=True)
    time.sleep(600)
""")


def test_two_processes_cannot_both_write_and_a_killed_holder_frees_the_lock(tmp_path):
    """The attack: two processes saving steps 1..40 at once got no error, and some step's
    metrics were the other run's. Now the second fails at construction, naming the first;
    a SIGKILL of the first releases the lock."""
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        with pytest.raises(RecorderError, match=rf"another CheckpointManager writes to this directory: pid {proc.pid} "):
            CheckpointManager(tmp_path / "run")
    finally:
        proc.kill()
        proc.wait()
    mgr = CheckpointManager(tmp_path / "run", keep_last=None)  # the kernel dropped the lock
    assert mgr.steps() == list(range(1, 41))
    assert all(mgr.metrics(s) == {"run": 1.0} for s in (1, 20, 40))


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    mgr = CheckpointManager(tmp_path)
    rd, wr = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's: the child never uses it
        pid = os.fork()
    if pid == 0:  # a DataLoader worker, say, outliving the manager's close()
        os.write(wr, b"up")  # after the fork hooks ran
        time.sleep(5)
        os._exit(0)
    try:
        assert os.read(rd, 2) == b"up"
        mgr.close()
        CheckpointManager(tmp_path).close()  # the child's copy of the file holds nothing
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_step_that_exists_is_never_replaced_even_without_the_lock(tmp_path, monkeypatch):
    """Two managers where the file system has no locks (simulated): the second save of one
    step is refused and the first checkpoint stays, byte for byte."""
    import trainrec.manager.dirlock as dirlock  # the directory's lock takes the flock

    monkeypatch.setattr(dirlock, "_lock", lambda fd: None)
    with pytest.warns(UserWarning, match="has no locks"):
        a, b = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    a.save(5, _record(5), metrics={"loss": 1.0}, block=True)
    first = (tmp_path / "step-00000005.mpk").read_bytes()
    metrics = (tmp_path / "step-00000005.metrics.json").read_bytes()
    b.save(5, _record(6), metrics={"loss": 2.0})
    with pytest.raises(RecorderError, match=r"step-00000005\.metrics\.json exists already"):
        b.wait()
    assert (tmp_path / "step-00000005.mpk").read_bytes() == first
    assert (tmp_path / "step-00000005.metrics.json").read_bytes() == metrics
    assert a.load(5, state_type=Tag).state.step == 5


def test_metrics_of_another_save_are_never_taken_for_the_checkpoint_s(tmp_path):
    """The attack's other half: a step's metrics written by the other run. The save id in
    the metrics and on the checkpoint tells them apart: the step then has no metrics (a
    warning), so `best=` never ranks it by another run's loss."""
    for name, loss in (("a", 0.5), ("b", 0.1)):
        mgr = CheckpointManager(tmp_path / name)
        mgr.save(3, _record(3), metrics={"loss": loss}, block=True)
        mgr.close()
    if trainrec.manager.local._save_id_of(tmp_path / "a" / "step-00000003.mpk") is None:
        pytest.skip("this file system keeps no extended attributes")
    shutil.copy(tmp_path / "b" / "step-00000003.metrics.json", tmp_path / "a" / "step-00000003.metrics.json")
    mgr = CheckpointManager(tmp_path / "a", keep_last=1, best=("loss", "min", 1))
    with pytest.warns(UserWarning, match="another save wrote them .* two writers"):
        assert mgr.metrics(3) == {}
    (tmp_path / "a" / "step-00000003.metrics.json").write_text(
        json.dumps({"metrics": {"loss": 0.1}, "step": 4}))  # another step's
    with pytest.warns(UserWarning, match="they are step 4's"):
        assert mgr.metrics(3) == {}


# -- item 5: only RecorderError from saves, retention and loads -----------------------------


def test_permission_and_read_only_errors_are_recorder_errors(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _record(1), block=True)
    real_unlink = os.unlink

    def refused(path, *a, **kw):
        if Path(path).name == "step-00000001.mpk":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refused)
    mgr.save(2, _record(2))
    with pytest.raises(RecorderError, match="step 2 was saved, but retention failed: .*Permission denied"):
        mgr.wait()
    monkeypatch.undo()
    assert mgr.steps() == [1, 2]

    def read_only(path, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "mkdir", read_only)
    mgr.save(3, _record(3))
    with pytest.raises(RecorderError, match="cannot save step 3: .*Read-only file system"):
        mgr.wait()
    monkeypatch.undo()
    mgr.close()
    real_open = os.open

    def no_lock_file(path, *a, **kw):
        if Path(path).name == ".trainrec-lock":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", no_lock_file)
    with pytest.raises(RecorderError, match="Read-only file system.*; to only read this directory.*read_only=True"):
        CheckpointManager(tmp_path)
    assert CheckpointManager(tmp_path, read_only=True).steps() == [1, 2]


def test_a_deeply_nested_metrics_file_is_a_warning_not_a_recursion_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _record(1), metrics={"loss": 1.0}, block=True)
    (tmp_path / "step-00000001.metrics.json").write_text('{"metrics": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.warns(UserWarning, match="unreadable metrics of step 1 .*nested too deeply"):
        assert mgr.metrics(1) == {}


def test_metrics_too_large_to_read_back_are_refused_at_save(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="the metrics take too much room"):
        mgr.save(1, _record(1), metrics={f"a_metric_with_a_long_name_{i}": 0.5 for i in range(30_000)})
    assert mgr.steps() == []


# -- item 4: every reader bounded ---------------------------------------------------------------


@pytest.fixture(scope="module")
def orbax_saved(tmp_path_factory):
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    from trainrec.adapters.jax import OrbaxRecorder

    d = tmp_path_factory.mktemp("orbax")
    item = {"w": TensorData.from_array(np.arange(6, dtype=np.float32)),
            "b": TensorData.from_array(np.ones(3, np.float64)), "step": 3}
    return OrbaxRecorder(NATIVE).save_item(item, d / "c.orbax")


def _fifo_copy(saved: Path, where: Path, name: str) -> Path:
    shutil.copytree(saved, where)
    (where / name).unlink()
    os.mkfifo(where / name)
    return where


def _empty_chunks(n: int) -> bytes:
    """A NamedMpk document whose one tensor's payload is `n` empty chunks and its 4 bytes,
    every checksum right (an attacker computes them as well as we do)."""
    import zlib

    import msgpack
    from test_bounded import _mpk_with_raw_item

    payload = b"\x01\x02\x03\x04"
    data = b"\xdd" + (n + 1).to_bytes(4, "big") + b"\xc4\x00" * n + b"\xc4\x04" + payload
    tensor = (b"\x85" + msgpack.packb("__tensor__") + msgpack.packb("u8") + msgpack.packb("shape")
              + msgpack.packb([4]) + msgpack.packb("pad") + b"\xc4\x00" + msgpack.packb("data")
              + data + msgpack.packb("crc") + msgpack.packb(zlib.crc32(payload)))
    return _mpk_with_raw_item(tensor)


def _metrics_dir(d: Path, name: str, write) -> Path:
    run = d / name
    mgr = CheckpointManager(run)
    mgr.save(1, _record(1), metrics={"loss": 1.0}, block=True)
    mgr.close()
    path = run / "step-00000001.metrics.json"
    path.unlink()
    write(path)
    return run


def _sparse(path: Path, size: int, prefix: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(size)


def _orbax_cases(d: Path, saved: Path) -> list[dict]:
    cases: list[dict] = []
    data_file = next(p for p in sorted((saved / "arrays").rglob("*")) if p.parent.name == "d")
    for name in ("arrays/_METADATA", "arrays/manifest.ocdbt", str(data_file.relative_to(saved)),
                 "trainrec/metadata", "_CHECKPOINT_METADATA"):
        tag = name.replace("/", "-")
        where = str(_fifo_copy(saved, d / f"fifo-{tag}", name))
        cases += [{"id": f"orbax-fifo-{tag}-load", "kind": "load", "recorder": "orbax", "path": where},
                  {"id": f"orbax-fifo-{tag}-verify", "kind": "cli", "argv": ["verify", where]},
                  {"id": f"orbax-fifo-{tag}-inspect", "kind": "cli", "argv": ["inspect", where]}]
    sparse = d / "sparse-metadata"
    shutil.copytree(saved, sparse)
    _sparse(sparse / "arrays" / "_METADATA", 8 << 30, b'{"tree_metadata": {')
    cases.append({"id": "orbax-8GiB-sparse-_METADATA", "kind": "load", "recorder": "orbax", "path": str(sparse)})
    # valid JSON, 2.9 MB: 20,000 arrays Orbax would have opened one by one (12-15 s)
    many = d / "many-arrays-metadata"
    shutil.copytree(saved, many)
    doc = json.loads((many / "arrays" / "_METADATA").read_text())
    for i in range(20_000):
        k = f"{i + 100:06d}"
        doc["tree_metadata"][str((k,))] = {"key_metadata": [{"key": k, "key_type": 2}],
                                           "value_metadata": {"value_type": "np.ndarray",
                                                              "skip_deserialize": False}}
    (many / "arrays" / "_METADATA").write_text(json.dumps(doc))
    assert (many / "arrays" / "_METADATA").stat().st_size > 2_800_000
    cases.append({"id": "orbax-2.9MB-_METADATA-of-20000-arrays", "kind": "load", "recorder": "orbax",
                  "path": str(many)})
    empties = d / "empty-lists-doc"
    shutil.copytree(saved, empties)
    (empties / "trainrec" / "metadata").write_bytes(b'{"format": "trainrec.orbax", "x": [' + b"[]," * 4_000_000 + b"[]]}")
    cases.append({"id": "orbax-12MB-of-empty-lists-json-item", "kind": "load", "recorder": "orbax",
                  "path": str(empties)})
    return cases


@pytest.fixture(scope="module")
def bounded(tmp_path_factory, orbax_saved):
    """{case id: outcome} of every case, each loaded in a forked child with its CPU time and
    peak memory measured (tests/bounded_runner.py)."""
    d = tmp_path_factory.mktemp("attack29")
    (d / "chunks.mpk").write_bytes(_empty_chunks(500_000))  # 1 MB of empty chunks
    os.mkfifo(d / "fifo.mpk")
    cases = [
        {"id": "mpk-1MB-of-empty-chunks", "kind": "load", "recorder": "mpk", "path": str(d / "chunks.mpk")},
        {"id": "mpk-1MB-of-empty-chunks-bytes", "kind": "load", "recorder": "bytes", "path": str(d / "chunks.mpk")},
        {"id": "mpk-fifo-load", "kind": "load", "recorder": "mpk", "path": str(d / "fifo.mpk")},
        {"id": "gz-fifo-load", "kind": "load", "recorder": "gz", "path": str(d / "fifo.mpk")},
    ]
    cases += [
        {"id": "metrics-8GiB-sparse", "kind": "metrics", "step": 1,
         "path": str(_metrics_dir(d, "m-sparse", lambda p: _sparse(p, 8 << 30, b'{"metrics": {')))},
        {"id": "metrics-fifo", "kind": "metrics", "step": 1,
         "path": str(_metrics_dir(d, "m-fifo", os.mkfifo))},
        {"id": "metrics-900KB-of-empty-maps", "kind": "metrics", "step": 1,
         "path": str(_metrics_dir(d, "m-maps", lambda p: p.write_bytes(
             b'{"metrics": {}, "x": [' + b"{}," * 300_000 + b"{}]}")))},
    ]
    cases += _orbax_cases(d, orbax_saved)
    spec = d / "cases.json"
    spec.write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, str(HERE / "bounded_runner.py"), str(spec)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(results) == {c["id"] for c in cases}
    return results


def _bad(results: dict, ok, *, max_rss_mib: float = SLACK_MIB) -> list[str]:
    return [f"{k}: {r['outcome'][:160]} cpu {r['cpu_s']:.2f}s rss +{r['rss_mib']:.0f} MiB"
            for k, r in results.items()
            if not ok(k, r["outcome"]) or r["cpu_s"] > CPU_S or r["rss_mib"] > max_rss_mib]


def test_no_reader_waits_on_a_fifo_and_a_fifo_is_not_a_missing_file(bounded):
    """The attack: FIFOs at Orbax's `_METADATA`, `manifest.ocdbt`, a data file hung `load`,
    `read_file`, `verify` and `inspect` forever; a FIFO was reported as missing."""
    fifo = {k: r for k, r in bounded.items() if "fifo" in k}
    assert len(fifo) == 18

    def ok(k, outcome):
        if k.startswith("metrics"):
            return outcome.startswith("metrics {} warned:") and "a FIFO" in outcome
        if "-verify" in k:
            return outcome in ("exit 1", "exit 3")  # corrupt, or (the marker) unreadable
        if "-inspect" in k:
            return outcome == "exit 3"
        return (outcome.startswith("RecorderError") and "FIFO" in outcome
                and "FileMissingError" not in outcome)

    assert not _bad(fifo, ok), "\n".join(_bad(fifo, ok))


def test_json_reads_are_bounded_in_bytes_and_values(bounded):
    """The attack: an 8 GiB sparse JSON file was a raw `MemoryError` (Orbax's `_METADATA`,
    metrics), a valid 2.9 MB `_METADATA` took Orbax 12-15 s; each now refused within a
    second of CPU and 48 MiB."""
    cases = {k: r for k, r in bounded.items() if ("orbax" in k or "metrics" in k) and "fifo" not in k}
    assert len(cases) == 5

    def ok(k, outcome):
        if k.startswith("metrics"):
            return outcome.startswith("metrics {} warned:") and "unreadable metrics" in outcome
        return outcome.startswith("RecorderError CorruptRecordError")

    assert not _bad(cases, ok), "\n".join(_bad(cases, ok))
    assert "more than the" in bounded["orbax-8GiB-sparse-_METADATA"]["outcome"]
    assert "a load accepts" in bounded["orbax-2.9MB-_METADATA-of-20000-arrays"]["outcome"]
    assert "object budget" in bounded["orbax-12MB-of-empty-lists-json-item"]["outcome"]


def test_a_payload_of_empty_chunks_is_refused_at_once(bounded):
    """The attack: 1 MB of empty NamedMpk chunks loaded 2000-3700 times slower than a 1 MB
    tensor (10 s for 500,000 chunks here)."""
    cases = {k: r for k, r in bounded.items() if "chunks" in k}
    assert len(cases) == 2
    ok = lambda k, outcome: "chunk of 0 bytes before the last" in outcome  # noqa: E731
    assert not _bad(cases, ok), "\n".join(_bad(cases, ok))


def test_the_chunk_rule_keeps_what_writers_write(monkeypatch):
    """Payloads cut into chunks (writers cut at `CHUNK_BYTES`, 2 GiB; here at 3 MiB) still
    load, bit for bit; a short chunk before the last, or an empty last one, is refused."""
    import trainrec.format as fmt
    from trainrec import NamedMpkBytesRecorder

    monkeypatch.setattr(fmt.limits, "CHUNK_BYTES", 3 << 20)
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: three chunks
    data = NamedMpkBytesRecorder().save_item({"w": TensorData.from_array(big)})
    assert data.count(b"\xc6\x00\x30\x00\x00") == 2  # two full chunks of 3 MiB
    assert np.array_equal(NamedMpkBytesRecorder().load_item(data)["w"].array, big)
    monkeypatch.setattr(fmt.limits, "MIN_CHUNK_BYTES", 4 << 20)
    with pytest.raises(CorruptRecordError, match="chunk of 3145728 bytes before the last"):
        NamedMpkBytesRecorder().load_item(data)


def test_core_readers_refuse_a_fifo_without_waiting(tmp_path):
    """`read_file` and every core recorder, given a FIFO (not through the CLI, which
    checks first): a `RecorderError` saying so, at once."""
    fifo = tmp_path / "x.pt"
    os.mkfifo(fifo)

    def every_reader():
        out = []
        readers = [trainrec.read_file, NamedMpkFileRecorder().read, trainrec.NamedMpkGzFileRecorder().read,
                   trainrec.FlaxMsgpackFileRecorder().read]
        for read in readers:
            try:
                read(fifo)
                out.append("loaded")
            except RecorderError as e:
                out.append(f"{type(e).__name__}: {'not a regular file (a FIFO)' in str(e)}")
        return out

    outcome = _within(20, every_reader)
    assert outcome == "ok " + repr(["RecorderError: True"] * 4), outcome


def test_a_fifo_marker_is_not_a_regular_file_not_a_missing_directory(tmp_path):
    (tmp_path / "c.orbax" / "trainrec").mkdir(parents=True)
    os.mkfifo(tmp_path / "c.orbax" / "trainrec" / "metadata")
    outcome = _within(20, lambda: trainrec.read_file(tmp_path / "c.orbax"))
    assert outcome.startswith("raised RecorderError: trainrec/metadata is a FIFO"), outcome


# -- item 6: convert refuses what it cannot convert; SIGBUS --------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_refuses_a_dcp_directory_and_writes_nothing(tmp_path, capsys):
    """The attack: `trainrec convert DCPDIR out.mpk --to mpk` exited 0 having written
    "tensors 0" (the reader's view of the entries, under a TrainingRecord header)."""
    torch = pytest.importorskip("torch")
    trt = pytest.importorskip("trainrec.adapters.torch")
    from trainrec.cli.commands import main

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = trt.DCPRecorder().save(tmp_path / "ck", model, opt, None, Tag(3))
    for argv in (["convert", str(path), str(tmp_path / "out.mpk"), "--to", "mpk"],
                 ["convert", str(path), str(tmp_path / "out.pt"), "--to", "torch", "--template",
                  str(path)]):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert "cannot convert" in err and "DCPRecorder" in err, err
        assert "dtype and shape), not its values" in err and "nothing written" in err
    assert not (tmp_path / "out.mpk").exists() and not (tmp_path / "out.pt").exists()


def test_convert_refuses_a_training_record_header_over_another_item(tmp_path, capsys):
    from trainrec.cli.commands import main

    src = NamedMpkFileRecorder().save_item({"not": "a record"}, tmp_path / "x.mpk", "TrainingRecord")
    assert main(["convert", str(src), str(tmp_path / "out.mpk"), "--to", "mpk"]) == 3
    assert "says it holds a TrainingRecord but does not" in capsys.readouterr().err
    assert not (tmp_path / "out.mpk").exists()


def test_a_save_over_a_mapped_file_leaves_its_loaded_tensors_intact(tmp_path):
    """`mmap=True` maps the file; trainrec's saves replace a file by a rename, never in
    place, so the mapping keeps the old file's pages and the loaded tensors their values."""
    r = NamedMpkFileRecorder(NATIVE)
    r.save_item({"w": TensorData.from_array(np.arange(1 << 16, dtype=np.float64))}, tmp_path / "x.mpk")
    loaded = r.load_item(tmp_path / "x.mpk", mmap=True)["w"]
    r.save_item({"w": TensorData.from_array(np.zeros(4))}, tmp_path / "x.mpk")
    assert np.array_equal(loaded.array, np.arange(1 << 16, dtype=np.float64))


def test_truncating_a_mapped_file_in_place_is_the_sigbus_the_docs_describe(tmp_path):
    """What spec/SECURITY.md says of `mmap=True`: a file cut short in place (not by a
    trainrec save) while its tensors are mapped ends the process with SIGBUS, as any
    mapped read does (numpy.memmap, safetensors); a load without mmap is not affected."""
    script = textwrap.dedent(f"""
        import os, numpy as np, trainrec
        r = trainrec.NamedMpkFileRecorder()
        p = {str(tmp_path / "x.mpk")!r}
        r.save_item({{"w": trainrec.TensorData.from_array(np.ones(1 << 20))}}, p)
        eager = r.load_item(p)["w"].array
        mapped = r.load_item(p, mmap=True)["w"]
        os.truncate(p, 4096)
        print(float(eager.sum()), flush=True)
        mapped.array.sum()
        print("not reached", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == [str(float(1 << 20))]



# -- item 7: what a checksum does not protect against -------------------------------------------


def test_a_forgery_with_recomputed_checksums_loads_as_the_docs_say(tmp_path, capsys):
    """spec/SECURITY.md section 6: the checksums are unkeyed CRC-32s, so they find damage,
    not a forger. `maximize` flipped in a flax file is refused (the byte changed)...
    and loads, passing `trainrec verify`, once the file checksum is recomputed."""
    import zlib

    from trainrec.cli.commands import main

    r = trainrec.FlaxMsgpackFileRecorder(NATIVE)
    path = r.save_item({"maximize": False, "w": TensorData.from_array(np.ones(2, np.float32))},
                       tmp_path / "x.msgpack")
    data = bytearray(path.read_bytes())
    at = data.index(b"maximize") + len(b"maximize")
    assert data[at] == 0xC2  # msgpack False
    data[at] = 0xC3
    path.write_bytes(bytes(data))
    with pytest.raises(trainrec.ChecksumError, match="file checksum"):
        r.load_item(path)
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    assert r.load_item(path)["maximize"] is True
    assert main(["verify", str(path)]) == 0 and "OK:" in capsys.readouterr().out
