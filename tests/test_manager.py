"""`trainrec.CheckpointManager`: background saves, retention, crash safety, preemption,
error surfacing, every recorder (spec/PROTOCOLS.md, "CheckpointManager")."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from same_items import same

import trainrec
from trainrec import (
    CheckpointManager,
    FileMissingError,
    GradientsAccumulator,
    KeepBest,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    TrainingRecord,
)
from trainrec.adapters.numpy import MLP, AdamW, StepLr

NATIVE = NativePrecisionSettings()


@trainrec.record
class Tagged:
    step: int


def _record(step: int, size: int = 8) -> TrainingRecord:
    """A record whose every parameter holds `step`, and whose state says `step`."""
    model = MLP([size, size, 2], seed=0)
    for v in model.params.values():
        v[...] = step
    return TrainingRecord.capture(model, AdamW(), StepLr(0.1, 2), GradientsAccumulator(), Tagged(step))


def _check(mgr: CheckpointManager, step: int) -> None:
    rec = mgr.load(step, state_type=Tagged)
    assert rec.state.step == step
    for name, t in rec.model.item.items():
        assert np.all(t.array == step), name


class _Gated(NamedMpkFileRecorder):
    """A file recorder whose saves wait for `gate` and log when they start and end."""

    def __init__(self, fail_on: set[str] | None = None) -> None:
        super().__init__(NATIVE)
        self.gate = threading.Event()
        self.gate.set()
        self.log: list[str] = []
        self.fail_on = fail_on or set()

    def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
        name = Path(args).name
        self.log.append(f"start {name}")
        assert self.gate.wait(30)
        time.sleep(0.02)
        if name in self.fail_on:
            self.log.append(f"fail {name}")
            raise RecorderError("disk on fire", source=str(args))
        out = super().save_item(item, args, record_type, allow_lossy=allow_lossy)
        self.log.append(f"end {name}")
        return out


# -- every recorder: loaded == saved, dtype included --------------------------------------


@trainrec.record
class Mixed:
    step: int
    arrays: dict


def _mixed_record(step: int) -> TrainingRecord:
    rng = np.random.default_rng(step)
    arrays = {
        "f64": rng.normal(size=(3, 2)),
        "f32": rng.normal(size=5).astype(np.float32),
        "f16": rng.normal(size=4).astype(np.float16),
        "bf16": rng.normal(size=4).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-2**62, 2**62, size=3),
        "i32": rng.integers(-2**31, 2**31, size=3, dtype=np.int32),
        "i8": rng.integers(-128, 128, size=3, dtype=np.int8),
        "u8": rng.integers(0, 256, size=3, dtype=np.uint8),
        "bool": rng.random(4) > 0.5,
    }
    model, opt, acc = MLP([4, 6, 2], seed=step), AdamW(), GradientsAccumulator()
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 2))
    _, g = model.loss_and_grads(x, y)
    acc.accumulate(model, g)
    opt.step(0.1, model, acc.grads())
    _, g = model.loss_and_grads(x, y)
    acc.accumulate(model, g)  # one gradient pending
    return TrainingRecord.capture(model, opt, StepLr(0.1, 2), acc, Mixed(step, arrays))


def _recorders():
    yield pytest.param(lambda: None, id="default")
    yield pytest.param(lambda: NamedMpkFileRecorder(NATIVE), id="mpk")
    yield pytest.param(lambda: NamedMpkGzFileRecorder(NATIVE), id="mpk.gz")

    def torch_recorder():
        pytest.importorskip("torch")
        from trainrec.adapters.torch import TorchFileRecorder
        return TorchFileRecorder(NATIVE)

    def flax_recorder():
        pytest.importorskip("flax")
        from trainrec.adapters.jax import FlaxMsgpackFileRecorder
        return FlaxMsgpackFileRecorder(NATIVE)

    def orbax_recorder():
        pytest.importorskip("jax")
        pytest.importorskip("orbax.checkpoint")
        from trainrec.adapters.jax import OrbaxRecorder
        return OrbaxRecorder(NATIVE)

    yield pytest.param(torch_recorder, id="torch")
    yield pytest.param(flax_recorder, id="flax")
    yield pytest.param(orbax_recorder, id="orbax")  # checkpoints are directories


@pytest.mark.parametrize("make", list(_recorders()))
def test_every_recorder_loads_back_what_was_saved_dtype_included(make, tmp_path):
    recorder = make()
    mgr = CheckpointManager(tmp_path, recorder, keep_last=2)
    saved = {s: _mixed_record(s) for s in (1, 2, 3)}
    for s, rec in saved.items():
        mgr.save(s, rec, metrics={"loss": 1.0 / s})
    mgr.wait()
    assert mgr.steps() == [2, 3]
    suffix = ".mpk" if recorder is None else recorder.suffix
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".trainrec-lock", "step-00000002.metrics.json", f"step-00000002{suffix}",
        "step-00000003.metrics.json", f"step-00000003{suffix}"]
    for s in (2, 3):
        loaded = mgr.load(s)
        assert same(loaded.into_item(NATIVE), saved[s].into_item(NATIVE)), s
        assert mgr.metrics(s) == {"loss": 1.0 / s}
    rebuilt = CheckpointManager(tmp_path, make(), read_only=True).load(state_type=Mixed)  # a reader's view
    assert rebuilt.state.step == 3
    assert all(rebuilt.state.arrays[k].dtype == v.dtype for k, v in saved[3].state.arrays.items())


# -- background saves, one in flight, errors surface ---------------------------------------


def test_save_returns_before_the_write_and_the_step_is_listed_only_when_complete(tmp_path):
    recorder = _Gated()
    mgr = CheckpointManager(tmp_path, recorder)
    mgr.save(1, _record(1), block=True)
    recorder.gate.clear()
    mgr.save(2, _record(2))  # returns while the write waits for the gate
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert not (tmp_path / "step-00000002.mpk").exists()
    recorder.gate.set()
    mgr.wait()
    assert mgr.steps() == [1, 2]
    _check(mgr, 2)


def test_a_second_save_waits_for_the_first(tmp_path):
    recorder = _Gated()
    mgr = CheckpointManager(tmp_path, recorder, keep_last=None)
    for s in range(1, 6):
        mgr.save(s, _record(s))
    mgr.wait()
    expected = []
    for s in range(1, 6):
        expected += [f"start step-{s:08d}.mpk", f"end step-{s:08d}.mpk"]
    assert recorder.log == expected  # never two writes at once
    assert mgr.steps() == [1, 2, 3, 4, 5]


def test_a_background_error_is_raised_by_the_next_call_once_and_deletes_nothing(tmp_path):
    recorder = _Gated(fail_on={"step-00000003.mpk"})
    mgr = CheckpointManager(tmp_path, recorder, keep_last=1)
    mgr.save(2, _record(2), block=True)
    mgr.save(3, _record(3))  # fails in the background
    with pytest.raises(RecorderError, match="disk on fire"):
        mgr.save(4, _record(4))
    assert mgr.steps() == [2]  # step 4 was not started; step 2 is intact
    _check(mgr, 2)
    mgr.wait()  # raised once, not again
    recorder.fail_on = set()
    mgr.save(3, _record(3), block=True)  # the failed step may be saved again
    assert mgr.steps() == [3]

    recorder.fail_on = {"step-00000004.mpk"}
    mgr.save(4, _record(4))
    with pytest.raises(RecorderError, match="disk on fire"):
        mgr.wait()
    recorder.fail_on = {"step-00000005.mpk"}
    mgr.save(5, _record(5))
    time.sleep(0.5)
    with pytest.raises(RecorderError, match="disk on fire"):
        mgr.steps()  # a finished failure surfaces at any call
    assert mgr.steps() == [3]
    mgr.save(6, _record(6), block=True)
    assert mgr.steps() == [6]


def test_a_lossy_recorder_refusal_surfaces(tmp_path):
    mgr = CheckpointManager(tmp_path, NamedMpkFileRecorder(trainrec.HalfPrecisionSettings()))
    rec = _record(1)
    rec.model.item["layers.0.weight"] = TensorData.from_array(np.full((8, 8), 1e-9, np.float32))
    mgr.save(1, rec)
    with pytest.raises(trainrec.LossyPrecisionError, match="layers.0.weight"):
        mgr.wait()
    assert mgr.steps() == []


def test_an_error_never_raised_is_reported_when_the_program_ends(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, trainrec
        from trainrec import CheckpointManager, TrainingRecord, GradientsAccumulator, NamedMpkFileRecorder
        from trainrec.adapters.numpy import MLP, AdamW

        @trainrec.record
        class S:
            step: int

        model = MLP([4, 2]); model.params["layers.0.bias"][...] = 1e-9
        rec = TrainingRecord.capture(model, AdamW(), None, GradientsAccumulator(), S(1))
        mgr = CheckpointManager({str(tmp_path)!r}, NamedMpkFileRecorder(trainrec.HalfPrecisionSettings()))
        mgr.save(1, rec)
        print("exiting without wait()")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a background checkpoint save failed" in done.stderr
    assert "LossyPrecisionError" in done.stderr


def test_the_context_manager_waits_for_the_save_in_flight(tmp_path):
    recorder = _Gated()
    with CheckpointManager(tmp_path, recorder) as mgr:
        recorder.gate.clear()
        mgr.save(1, _record(1))
        threading.Timer(0.2, recorder.gate.set).start()
    assert mgr.steps() == [1]
    recorder.fail_on = {"step-00000002.mpk"}
    with pytest.raises(RecorderError, match="disk on fire"):
        with mgr:
            mgr.save(2, _record(2))


# -- retention -----------------------------------------------------------------------------


def _run(tmp_path, steps, metrics=None, **kw) -> CheckpointManager:
    mgr = CheckpointManager(tmp_path, **kw)
    for s in steps:
        mgr.save(s, _record(s, 2), metrics=None if metrics is None else {"loss": metrics[s]})
    mgr.wait()
    return mgr


def test_keep_last(tmp_path):
    assert _run(tmp_path / "a", range(1, 8)).steps() == [5, 6, 7]  # default: 3
    assert _run(tmp_path / "b", range(1, 8), keep_last=1).steps() == [7]
    assert _run(tmp_path / "c", range(1, 8), keep_last=None).steps() == list(range(1, 8))


def test_keep_every(tmp_path):
    mgr = _run(tmp_path, range(0, 23), keep_last=2, keep_every=5)
    assert mgr.steps() == [0, 5, 10, 15, 20, 21, 22]


def test_keep_best_min_and_max(tmp_path):
    loss = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.8, 6: 0.7, 7: 0.6}
    mgr = _run(tmp_path / "min", loss, loss, keep_last=1, best=KeepBest("loss", "min", 2))
    assert mgr.steps() == [2, 4, 7]  # best two, and the newest
    mgr = _run(tmp_path / "max", loss, loss, keep_last=1, best=("loss", "max", 2))
    assert mgr.steps() == [3, 5, 7]
    for s in mgr.steps():
        assert mgr.metrics(s) == {"loss": loss[s]}
        _check(mgr, s)


def test_keep_best_ties_go_to_the_newer_step_and_nan_ranks_last(tmp_path):
    loss = {1: 0.2, 2: float("nan"), 3: 0.2, 4: float("nan"), 5: 0.9, 6: 1.0}
    mgr = _run(tmp_path, loss, loss, keep_last=1, best=("loss", "min", 1))
    assert mgr.steps() == [3, 6]
    mgr2 = _run(tmp_path / "n", {1: float("nan"), 2: 5.0, 3: float("nan")},
                {1: float("nan"), 2: 5.0, 3: float("nan")}, keep_last=1, best=("loss", "min", 1))
    assert mgr2.steps() == [2, 3]


def test_steps_without_the_best_metric_are_never_deleted_by_it(tmp_path):
    _run(tmp_path, [1, 2], keep_last=None)  # an earlier configuration: no metrics
    loss = {3: 0.5, 4: 0.4, 5: 0.3, 6: 0.2}
    mgr = _run(tmp_path, loss, loss, keep_last=1, best=("loss", "min", 1))
    assert mgr.steps() == [1, 2, 6]


def test_a_step_with_unreadable_metrics_is_kept_and_the_user_warned(tmp_path):
    loss = {1: 0.5, 2: 0.4}
    _run(tmp_path, loss, loss, keep_last=1, best=("loss", "min", 1))
    (tmp_path / "step-00000002.metrics.json").write_text('{"metrics": ')  # damaged by hand
    mgr = CheckpointManager(tmp_path, keep_last=1, best=("loss", "min", 1))
    with pytest.warns(UserWarning, match="unreadable metrics of step 2"):
        assert mgr.metrics(2) == {}
    with pytest.warns(UserWarning, match="unreadable metrics of step 2"):
        mgr.save(3, _record(3, 2), metrics={"loss": 0.9}, block=True)
    assert mgr.steps() == [2, 3]  # step 2 cannot be ranked: not deleted by best=


def test_a_checkpoint_is_deleted_only_after_a_newer_one_is_durable(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, NamedMpkFileRecorder(NATIVE, durable=False), keep_last=1)
    mgr.save(1, _record(1), block=True)
    events: list[tuple[str, object]] = []
    real_fsync, real_unlink = os.fsync, os.unlink

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def unlink(path, *a, **kw):
        events.append(("unlink", Path(path).name))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    mgr.save(2, _record(2), block=True)
    monkeypatch.undo()
    assert mgr.steps() == [2]
    new = os.stat(tmp_path / "step-00000002.mpk").st_ino
    first_delete = events.index(("unlink", "step-00000001.mpk"))
    assert ("fsync", new) in events[:first_delete]


def test_foreign_files_are_ignored_and_never_deleted(tmp_path):
    foreign = ["notes.txt", "step-5.mpk", "step-00000001.pt", "step-00000002.mpk.bak",
               "step-000000003.mpk", ".step-00000001.mpk.zzzzzzzzzzzz.trainrec-tmp",
               "step-00000004.metrics.json.old"]
    for name in foreign:
        (tmp_path / name).write_bytes(b"not ours")
    (tmp_path / "step-00000000.mpk").mkdir()  # a directory with a step's name is not a step
    mgr = _run(tmp_path, range(1, 7), keep_last=1)
    assert mgr.steps() == [6]
    assert {p.name for p in tmp_path.iterdir()} == set(foreign) | {
        ".trainrec-lock", "step-00000000.mpk", "step-00000006.mpk", "step-00000006.metrics.json"}


# -- misuse --------------------------------------------------------------------------------


def test_misuse_raises_clearly(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", best=("loss", "min", 1))
    assert mgr.latest_step() is None and mgr.steps() == []
    with pytest.raises(FileMissingError, match="no complete checkpoint to load"):
        mgr.load()
    rec = _record(1)
    for bad, error in [(1.0, TypeError), ("3", TypeError), (True, TypeError), (None, TypeError),
                       (-1, ValueError)]:
        with pytest.raises(error, match="non-negative int"):
            mgr.save(bad, rec, metrics={"loss": 1.0})
    with pytest.raises(TypeError, match="captured TrainingRecord"):
        mgr.save(1, rec.into_item(NATIVE), metrics={"loss": 1.0})
    with pytest.raises(ValueError, match="'loss', the metric best= ranks by"):
        mgr.save(1, rec, metrics={"acc": 1.0})
    with pytest.raises(ValueError, match="'loss', the metric best= ranks by"):
        mgr.save(1, rec)
    with pytest.raises(TypeError, match="metric 'loss' must be a real number"):
        mgr.save(1, rec, metrics={"loss": "low"})
    mgr.save(np.int64(5), rec, metrics={"loss": np.float32(0.5)}, block=True)
    assert mgr.metrics(5) == {"loss": 0.5}
    for step in (5, 4):
        with pytest.raises(ValueError, match=r"not after step 5.*steps only grow"):
            mgr.save(step, rec, metrics={"loss": 1.0})
    mgr.close()  # the directory's lock, for the next manager
    with pytest.raises(ValueError, match="not after step 5"):  # steps found on disk count too
        CheckpointManager(tmp_path / "run").save(5, rec)
    with pytest.raises(FileMissingError, match=r"no complete checkpoint for step 3; the steps there are: 5"):
        mgr.load(3)
    with pytest.raises(FileMissingError, match="step 3"):
        mgr.metrics(3)
    assert mgr.steps() == [5]  # nothing above changed the directory

    (tmp_path / "file").write_text("x")
    with pytest.raises(RecorderError, match="is a file, not a directory"):
        CheckpointManager(tmp_path / "file")
    with pytest.raises(TypeError, match="file recorder"):
        CheckpointManager(tmp_path, NamedMpkBytesRecorder())
    with pytest.raises(TypeError, match="directory must be a path"):
        CheckpointManager(None)
    for kw in ({"keep_last": 0}, {"keep_every": -2}, {"keep_last": 1.5}):
        with pytest.raises(ValueError, match="must be an int >= 1 or None"):
            CheckpointManager(tmp_path, **kw)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        CheckpointManager(tmp_path, best=("loss", "lowest", 1))
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        KeepBest("loss", "min", 0)
    with pytest.raises(TypeError, match="best must be KeepBest"):
        CheckpointManager(tmp_path, best="loss")


# -- crashes -------------------------------------------------------------------------------

_CRASHER = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, traceback, numpy as np, trainrec
    import trainrec.manager.local
    from trainrec import CheckpointManager, TrainingRecord, GradientsAccumulator
    from trainrec.adapters.numpy import MLP, AdamW, StepLr

    @trainrec.record
    class Tagged:
        step: int

    calls = 0

    def counted(real):
        def call(*a, **kw):
            global calls
            calls += 1
            if calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        return call

    def crasher(directory, start):
        model, opt, sched = MLP([512, 1024, 512], seed=0), AdamW(), StepLr(0.1, 2)
        mgr = CheckpointManager(directory, keep_last=1, keep_every=4, best=("loss", "min", 1))
        if kill_at >= 0:  # kill before the kill_at-th rename, unlink or fsync of one save
            for name in ("replace", "unlink", "fsync"):
                setattr(os, name, counted(getattr(os, name)))
            # the manager's own renames (never over anything)
            trainrec.manager.local.rename_noreplace = counted(trainrec.manager.local.rename_noreplace)
        print("ready", os.getpid(), flush=True)
        for s in range(start, start + 10_000):
            for v in model.params.values():
                v[...] = s
            mgr.save(s, TrainingRecord.capture(model, opt, sched, GradientsAccumulator(), Tagged(s)),
                     metrics={"loss": (s * 7919) % 13}, block=kill_at >= 0)
            if kill_at >= 0:
                print(calls, flush=True)
                break

    # the zygote: imported once, it saves nothing itself; each line asks for one crasher
    print("zygote", flush=True)
    for line in iter(sys.stdin.readline, ""):
        directory, start, kill_at, err = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 2)
                signal.alarm(120)  # a crasher that hangs ends (SIGALRM) instead of the test
                crasher(directory, start)
            except BaseException:
                traceback.print_exc()
                code = 1
            try:
                atexit._run_exitfuncs()  # as at a program's end: the manager's finalizer
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("exit", os.waitstatus_to_exitcode(status), flush=True)
    """
)
"""Each crasher is a child forked from a zygote process that imported numpy and trainrec once
(and never saved): a process of its own that opens a `CheckpointManager`, says "ready PID",
and saves from step `start` on, until the test SIGKILLs it (`kill_at` -1), or saves one step,
killing itself before its `kill_at`-th rename, unlink or fsync (0: never; it then prints how
many it made), without an interpreter start-up per kill. The zygote reaps it and prints
"exit CODE" (negative: the signal); its stderr goes to a file of its own."""


class _Crashers:
    """The test's end of the `_CRASHER` zygote."""

    def __init__(self, tmp_path: Path) -> None:
        script = tmp_path / "crasher.py"
        script.write_text(_CRASHER)
        self.tmp_path = tmp_path
        self.runs = 0
        self.zygote = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        self.stdin, self.stdout = self.zygote.stdin, self.zygote.stdout
        assert self.stdout.readline().strip() == "zygote"  # the imports are done

    def start(self, directory: Path, start: int, kill_at: int) -> Path:
        self.runs += 1
        err = self.tmp_path / f"crasher-{self.runs}.err"
        self.stdin.write(json.dumps([str(directory), start, kill_at, str(err)]) + "\n")
        self.stdin.flush()
        return err

    def reap(self, err: Path) -> subprocess.CompletedProcess[str]:
        """The crasher's exit code, stdout (after its "ready" line) and stderr, once it is gone."""
        lines = []
        while not (line := self.stdout.readline()).startswith("exit "):
            assert line, "the zygote died"
            lines.append(line)
        return subprocess.CompletedProcess([], int(line.split()[1]), "".join(lines), err.read_text())

    def run(self, directory: Path, start: int, kill_at: int) -> subprocess.CompletedProcess[str]:
        return self.reap(self.start(directory, start, kill_at))

    def close(self) -> None:
        self.zygote.kill()
        self.zygote.communicate()


@pytest.fixture
def crashers(tmp_path):
    zygote = _Crashers(tmp_path)
    yield zygote
    zygote.close()


def _check_directory(directory: Path) -> list[int]:
    """Every listed step loads whole, with its own metrics; returns the steps."""
    mgr = CheckpointManager(directory)
    steps = mgr.steps()
    for s in steps:
        _check(mgr, s)
        assert mgr.metrics(s) == {"loss": float((s * 7919) % 13)}, s
    return steps


def test_a_crash_at_every_phase_of_a_save_leaves_every_listed_step_loadable(tmp_path, crashers):
    run = crashers.run

    def copy_of_base(name):
        directory = tmp_path / name
        directory.mkdir()
        for p in base.iterdir():
            (directory / p.name).write_bytes(p.read_bytes())
        return directory

    base = tmp_path / "base"
    for s in range(1, 6):  # steps 1..5; the save under test is step 6, which deletes step 5
        assert run(base, s, 0).returncode == 0
    assert _check_directory(base) == [1, 4, 5]  # best loss, every 4th, the last
    done = run(copy_of_base("count"), 6, 0)
    assert done.returncode == 0, done.stderr
    total = int(done.stdout.split()[-1])  # renames, unlinks and fsyncs in one save of step 6
    assert total >= 8
    assert _check_directory(tmp_path / "count") == [1, 4, 6]
    for kill_at in range(1, total + 1):
        directory = copy_of_base(f"kill{kill_at}")
        crashed = run(directory, 6, kill_at)
        assert crashed.returncode == -signal.SIGKILL, (kill_at, crashed.stderr)
        steps = _check_directory(directory)
        assert steps in ([1, 4, 5], [1, 4, 5, 6], [1, 4, 6]), (kill_at, steps)
        assert run(directory, 7, 0).returncode == 0  # the next save works and tidies up
        after = _check_directory(directory)
        assert after[-1] == 7
        assert not [p for p in directory.iterdir() if p.name.endswith(".trainrec-tmp")]
        leftover = {p.name for p in directory.iterdir()} - {".trainrec-lock"} - {
            f"step-{s:08d}{e}" for s in after for e in (".mpk", ".metrics.json")}
        assert leftover == set(), (kill_at, leftover)


def test_sigkill_at_random_moments_leaves_every_listed_step_loadable(tmp_path, crashers):
    rng = random.Random(18)
    start, kills, saved = 1, 0, 0
    deadline = time.monotonic() + 90
    while kills < 12 and time.monotonic() < deadline:
        err = crashers.start(tmp_path / "run", start, -1)
        ready = crashers.stdout.readline().split()
        assert ready[:1] == ["ready"], (ready, err.read_text())
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(int(ready[1]), signal.SIGKILL)
        assert crashers.reap(err).returncode == -signal.SIGKILL
        kills += 1
        steps = _check_directory(tmp_path / "run")
        if steps:
            saved = max(saved, steps[-1])
            start = steps[-1] + 1
    assert kills >= 8
    assert saved >= 3  # the kills landed among real saves


# -- preemption ----------------------------------------------------------------------------


def test_preemption_sets_the_flag_and_a_second_signal_gets_the_old_handler(tmp_path):
    mgr = CheckpointManager(tmp_path)
    seen: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with mgr.preemption(signals=(signal.SIGUSR1,)) as preempted:
            assert not preempted
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert preempted and preempted.signal == signal.SIGUSR1 and seen == []
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert seen == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # the old handler is back after the block
        time.sleep(0.05)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, old)


_TRAINER = textwrap.dedent(
    """
    import sys, time, numpy as np, trainrec
    from trainrec import CheckpointManager, GradientsAccumulator, GradientsParams, RngRecord, TrainingRecord
    from trainrec.adapters.numpy import MLP, AdamW, LinearWarmupCosineLr

    WINDOW, TOTAL, EVERY = 4, 60, 5

    @trainrec.record
    class State:
        micro: int
        rng: RngRecord | None = None

    mode, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
    model, opt = MLP([8, 16, 2], seed=0, dropout=0.1), AdamW(weight_decay=0.01)
    sched, acc = LinearWarmupCosineLr(1e-2, warmup=2, total=20), GradientsAccumulator()
    gen, state = np.random.default_rng(1), State(0)
    mgr = CheckpointManager(directory, keep_last=2)
    if mode == "resume":
        r = mgr.load(state_type=State).restore(model, opt, sched, "cpu")
        acc, state = r.accumulator, r.state
        state.rng.apply(gen)

    def micro_step():
        x = gen.normal(size=(4, 8)).astype(np.float32)
        _, grads = model.loss_and_grads(x, np.tanh(x[:, :2]), gen)
        acc.accumulate(model, grads)
        state.micro += 1
        if state.micro % WINDOW == 0:
            summed = acc.grads()
            opt.step(sched.step(), model, GradientsParams({k: v / np.float32(WINDOW) for k, v in summed.items()}))

    with mgr.preemption() as preempted:
        while state.micro < TOTAL:
            micro_step()
            print(state.micro, flush=True)
            if mode == "train":
                time.sleep(0.05)
            if state.micro % EVERY == 0 or preempted:
                state.rng = RngRecord.capture(gen)
                mgr.save(state.micro, TrainingRecord.capture(model, opt, sched, acc, state),
                         block=bool(preempted))
            if preempted:
                print("preempted at", mgr.latest_step(), flush=True)
                sys.exit(0)
    mgr.wait()
    np.savez(out, **model.params)
    """
)


def test_sigterm_saves_and_exits_cleanly_and_the_resumed_run_is_bitwise_exact(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)

    def run(mode, directory, out):
        return [sys.executable, str(script), mode, str(directory), str(out)]

    straight = subprocess.run(run("straight", tmp_path / "s", tmp_path / "straight.npz"),
                              capture_output=True, text=True, timeout=120)
    assert straight.returncode == 0, straight.stderr
    proc = subprocess.Popen(run("train", tmp_path / "p", tmp_path / "unused.npz"),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while int(proc.stdout.readline()) < 13:  # past a few periodic saves, off their steps
        pass
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    stopped = int(out.strip().splitlines()[-1].split()[-1])
    assert out.strip().splitlines()[-1] == f"preempted at {stopped}"
    assert 13 <= stopped < 60
    mgr = CheckpointManager(tmp_path / "p", read_only=True)  # a reader: the resume writes
    assert mgr.latest_step() == stopped
    assert not (tmp_path / "unused.npz").exists()  # it stopped, not finished
    resumed = subprocess.run(run("resume", tmp_path / "p", tmp_path / "resumed.npz"),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert int(resumed.stdout.split()[0]) == stopped + 1
    a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
