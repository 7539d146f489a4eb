"""Checkpoints at store URLs (trainrec.storage.location, commit, store_manager; spec/PROTOCOLS.md,
"Checkpoints on object stores"): `memory://` for the fast cases, and a real S3 protocol
server (moto's, started on a loopback port) through s3fs for the rest."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
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
    CorruptRecordError,
    FileMissingError,
    GradientsAccumulator,
    GradientsParams,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RngRecord,
    TensorData,
    TrainingRecord,
    read_file,
)
from trainrec.adapters.numpy import MLP, AdamW, StepLr
from trainrec.recorders.flaxmsgpack import FlaxMsgpackFileRecorder

fsspec = pytest.importorskip("fsspec", reason="the [s3] extra (fsspec, s3fs) is not installed")

NATIVE = NativePrecisionSettings()


# the local manager's tests' records, checked the same way on a store
from test_manager import _check, _record  # noqa: E402


def _item() -> dict:
    return {"bf16": TensorData.from_array(np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3)),
            "f64": TensorData.from_array(np.linspace(0, 1, 5)),
            "i8": TensorData.from_array(np.arange(-3, 3, dtype=np.int8)), "n": 3}


def _recorders() -> list:
    out = [NamedMpkFileRecorder(NATIVE), NamedMpkGzFileRecorder(NATIVE), FlaxMsgpackFileRecorder(NATIVE)]
    try:
        from trainrec.adapters.torch.recorder import TorchFileRecorder
    except ImportError:
        return out
    return [*out, TorchFileRecorder(NATIVE)]


@pytest.fixture
def mem() -> str:
    url = f"memory://trainrec-test-{os.urandom(6).hex()}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url[len("memory://"):]):
        fs.rm(url[len("memory://"):], recursive=True)


# -- memory:// (fast) ---------------------------------------------------------------------


@pytest.mark.parametrize("recorder", _recorders(), ids=lambda r: type(r).__name__)
def test_every_file_recorder_round_trips_a_url_dtype_kept(mem, recorder):
    url = f"{mem}/x{recorder.suffix}"
    assert recorder.save_item(_item(), url) == url
    for _, item in (recorder.read(url), read_file(url)):
        assert same(item, _item())


def test_a_recorder_of_local_files_refuses_a_url_instead_of_writing_a_local_folder(tmp_path, monkeypatch):
    from trainrec.adapter_kit import path_arg

    class LocalOnly(NamedMpkFileRecorder):  # an adapter's recorder of local files
        def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
            return super().save_item(item, path_arg(args), record_type, allow_lossy=allow_lossy)

    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="takes a local path, not the URL"):
        LocalOnly(NATIVE).save_item(_item(), "memory://bucket/x.mpk")
    assert list(tmp_path.iterdir()) == []  # Path() would have made a folder "memory:"


def _burn_item() -> dict:
    rng = np.random.default_rng(0)
    return {"tensors": {"fc.weight": TensorData.from_array(rng.normal(size=(6, 4)).astype(np.float32)),
                        "fc.bias": TensorData.from_array(np.arange(4, dtype=np.float32)),
                        "norm.gamma": TensorData.from_array(np.ones(3, np.float16))},
            "param_ids": {"fc.weight": 1, "fc.bias": 2, "norm.gamma": 2**64 - 1},
            "metadata": {"producer": "test"}, "scalars": {"x": {"UInt": 3}}, "dtypes": {}}


def _burn_recorders() -> list:
    from trainrec.burn import BurnNamedMpkRecorder, BurnpackRecorder

    return [BurnpackRecorder(), BurnNamedMpkRecorder(), BurnNamedMpkRecorder(compress=True)]


@pytest.mark.parametrize("index", range(3), ids=["bpk", "burn-mpk", "burn-mpk-gz"])
def test_burn_recorders_save_to_and_read_from_a_url_dtypes_kept(mem, tmp_path, index):
    """Burn's recorders upload as they write (the same bytes as a local file) and read an
    object through a private local copy; a cut object is refused naming its URL."""
    recorder = _burn_recorders()[index]
    suffix = ".mpk.gz" if index == 2 else recorder.suffix
    url, local = f"{mem}/m{suffix}", tmp_path / f"m{suffix}"
    assert recorder.save_item(_burn_item(), url) == url
    recorder.save_item(_burn_item(), local)
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(url[9:]) == local.read_bytes()
    for header, item in (recorder.read(url), read_file(url)):
        assert same(item, recorder.read(local)[1]) and header.format == read_file(local)[0].format
        assert item["param_ids"] == recorder.read(local)[1]["param_ids"]
    tensors = dict(trainrec.items.iter_tensors(recorder.read(url)[1]))
    assert sorted(t.dtype.value for t in tensors.values()) == ["f16", "f32", "f32"]
    fs.pipe_file(url[9:], local.read_bytes()[:-7])
    with pytest.raises(RecorderError, match=f"m{re.escape(suffix)}") as e:
        recorder.read(url)
    assert e.value.source == url


def test_a_burnpack_training_record_puts_its_optimizer_beside_it_at_a_url(mem):
    from trainrec.burn import optimizer_path

    assert optimizer_path(f"{mem}/run/m.bpk") == f"{mem}/run/m.optim.bpk"
    assert optimizer_path("m.bpk") == Path("m.optim.bpk")


def test_a_missing_object_is_file_missing(mem):
    with pytest.raises(FileMissingError, match="x.mpk"):
        TrainingRecord.load(NamedMpkFileRecorder(NATIVE), f"{mem}/x.mpk")


def test_a_missing_commit_whose_name_holds_416_is_missing_not_empty(mem):
    """A 416 (range not satisfiable: an empty object) is told by the store's answer, never by
    a "416" in the error's text, which names the object: a missing folder or commit object
    with 416 in its URL was once read as an empty one, so that a save there was refused as
    "committed already" and a load called it damaged."""
    from trainrec.storage.commit import read_commit
    from trainrec.storage.store import Store

    url = f"{mem}/run-416/step-416"
    with pytest.raises(FileMissingError, match="step-416"):
        read_commit(Store(url), ".trainrec-commit")
    with pytest.raises(FileMissingError, match="x416.mpk"):
        TrainingRecord.load(NamedMpkFileRecorder(NATIVE), f"{mem}/x416.mpk")
    with CheckpointManager(f"{mem}/run-416") as mgr:  # saves into the folder it names
        mgr.save(1, _record(1), block=True)
        assert mgr.steps() == [1]


def test_the_manager_on_memory_keeps_retention_latest_and_metrics(mem):
    with CheckpointManager(mem, keep_last=2, keep_every=4) as mgr:
        for s in range(1, 8):
            mgr.save(s, _record(s), metrics={"loss": 10.0 - s})
        mgr.wait()
        assert mgr.steps() == [4, 6, 7] and mgr.latest_step() == 7
        assert mgr.metrics(7) == {"loss": 3.0}
        _check(mgr, 7)
        _check(mgr, 4)
        with pytest.raises(ValueError, match="steps only grow"):
            mgr.save(7, _record(7))
        with pytest.raises(FileMissingError, match="4, 6, 7"):
            mgr.load(5)
    names = {p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(mem[9:], detail=False)}
    assert {n for n in names if n.endswith(".commit")} == {f"step-{s:08d}.commit" for s in (4, 6, 7)}
    assert len(names) == 3 * 3  # each step: commit, checkpoint, metrics; the lock released


def test_keep_best_reads_metrics_through_the_commit(mem):
    with CheckpointManager(mem, keep_last=1, best=("loss", "min", 1)) as mgr:
        for s, loss in ((1, 0.5), (2, 0.9), (3, 0.7)):
            mgr.save(s, _record(s), metrics={"loss": loss}, block=True)
        assert mgr.steps() == [1, 3]


def test_a_second_writer_is_refused_and_a_reader_is_not(mem):
    with CheckpointManager(mem) as mgr:
        mgr.save(1, _record(1), block=True)
        with pytest.raises(RecorderError, match=f"pid {os.getpid()}.*this process"):
            CheckpointManager(mem)
        reader = CheckpointManager(mem, read_only=True)
        assert reader.steps() == [1]
        _check(reader, 1)
    CheckpointManager(mem).close()  # released by close()


def _names(url: str) -> list[str]:
    fs = fsspec.filesystem("memory")
    if not fs.exists(url[9:]):
        return []
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url[9:], detail=False))


def _object(url: str, role: str, step: int) -> str:
    doc = json.loads(fsspec.filesystem("memory").cat_file(f"{url[9:]}/step-{step:08d}.commit"))
    return next(o["name"] for o in doc["objects"] if o["role"] == role)


def test_a_damaged_commit_is_refused(mem):
    with CheckpointManager(mem) as mgr:
        mgr.save(1, _record(1), block=True)
    fs = fsspec.filesystem("memory")
    path = f"{mem[9:]}/step-00000001.commit"
    fs.pipe_file(path, fs.cat_file(path).replace(b'"step": 1', b'"step": 2'))
    reader = CheckpointManager(mem, read_only=True)
    with pytest.raises(CorruptRecordError, match="commit's CRC-32 does not match"):
        reader.load()


def test_a_checkpoint_object_replaced_after_its_commit_is_refused(mem):
    with CheckpointManager(mem) as mgr:
        mgr.save(1, _record(1), block=True)
        mgr.save(2, _record(2), block=True)
    fs = fsspec.filesystem("memory")
    one, two = (f"{mem[9:]}/{_object(mem, 'checkpoint', s)}" for s in (1, 2))
    fs.pipe_file(two, fs.cat_file(one))  # a valid checkpoint, of the same size, not step 2's
    reader = CheckpointManager(mem, read_only=True)
    with pytest.raises(CorruptRecordError, match="CRC-32 is .* its commit says"):
        reader.load(2)
    fs.pipe_file(two, fs.cat_file(one)[:-10])
    with pytest.raises(CorruptRecordError, match="ended after"):
        reader.load(2)
    fs.rm_file(two)
    with pytest.raises(FileMissingError):
        reader.load(2)
    _check(reader, 1)


def test_an_uncommitted_save_is_not_a_step(mem):
    with CheckpointManager(mem) as mgr:
        mgr.save(1, _record(1), block=True)
    fs = fsspec.filesystem("memory")
    # what a save killed before its commit leaves: its objects, no commit object
    fs.pipe_file(f"{mem[9:]}/step-00000002.{'a' * 24}.mpk", b"half")
    reader = CheckpointManager(mem, read_only=True)
    assert reader.steps() == [1] and reader.latest_step() == 1
    _check(reader, reader.latest_step())


def test_a_failed_save_leaves_no_object(mem):
    class Failing(NamedMpkFileRecorder):
        def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
            from trainrec.storage.location import upload

            with upload(args) as f:
                f.write(b"x" * 1000)
                raise RecorderError("disk on fire", source=str(args))

    with CheckpointManager(mem, Failing(NATIVE)) as mgr:
        mgr.save(1, _record(1))
        with pytest.raises(RecorderError, match="disk on fire"):
            mgr.wait()
        assert mgr.steps() == []
    assert _names(mem) == []


def test_the_cli_inspects_and_verifies_a_url(mem, capsys):
    from trainrec.cli.commands import main

    with CheckpointManager(mem) as mgr:
        mgr.save(3, _record(3), block=True)
        mgr.save(4, _record(4), block=True)
    assert main(["verify", mem]) == 0
    out = capsys.readouterr().out
    assert "OK: " + mem + "/step-00000003.commit" in out and "step-00000004.commit" in out
    assert main(["inspect", "--json", f"{mem}/step-00000004.commit"]) == 0
    assert json.loads(capsys.readouterr().out)["tree"]["state"] == {"step": 4}
    fs = fsspec.filesystem("memory")
    path = f"{mem[9:]}/{_object(mem, 'checkpoint', 4)}"
    data = bytearray(fs.cat_file(path))
    data[-100] ^= 1
    fs.pipe_file(path, bytes(data))
    assert main(["verify", mem]) == 1
    assert "CORRUPT" in capsys.readouterr().out


def test_a_store_without_conditional_writes_refuses_writers_and_serves_readers(mem):
    """A scheme trainrec has verified no conditional writes on (gs:// is one: gcsfs can
    create-if-absent but not replace or delete on a generation) gets no writing manager,
    with the reason; a read-only one reads its steps. The store here is an fsspec
    filesystem of its own scheme over memory://'s objects (no conditional writes known)."""
    from fsspec.implementations.memory import MemoryFileSystem

    class Plain(MemoryFileSystem):
        protocol = ("trainrec-plain",)

        @classmethod
        def _strip_protocol(cls, path):
            return MemoryFileSystem._strip_protocol(path.replace("trainrec-plain://", "memory://", 1))

    fsspec.register_implementation("trainrec-plain", Plain, clobber=True)
    with CheckpointManager(mem) as mgr:
        mgr.save(1, _record(1), block=True)
    plain = "trainrec-plain://" + mem[len("memory://"):]
    with pytest.raises(RecorderError, match="trainrec-plain:// store has no conditional writes.*read_only=True"):
        CheckpointManager(plain)
    assert ".trainrec-lock" not in _names(mem)  # nothing written
    reader = CheckpointManager(plain, read_only=True)
    assert reader.steps() == [1]
    _check(reader, 1)


def test_gs_writers_are_refused_with_gcsfs_reason():
    from trainrec.storage import Store

    store = Store.__new__(Store)  # no gcsfs here: the refusal needs no connection
    store.scheme, store.url, store.conditional = "gs", "gs://bucket/run", False
    with pytest.raises(RecorderError, match="no conditional writes.*ifGenerationMatch=0.*generation"):
        store.put_new(".trainrec-lock", b"{}")


# -- a real S3 protocol server (moto) through s3fs ----------------------------------------


# the moto S3 server and the `s3` bucket fixture: tests/conftest.py (one server a session)


@pytest.mark.parametrize("recorder", _recorders()[:2], ids=lambda r: type(r).__name__)
def test_recorders_round_trip_on_s3(s3, recorder):
    url = f"{s3}/x{recorder.suffix}"
    recorder.save_item(_item(), url)
    assert same(recorder.read(url)[1], _item())


def test_a_failed_upload_on_s3_leaves_no_object_and_no_open_upload(s3):
    from trainrec.storage.location import PART_BYTES, upload

    with pytest.raises(KeyError):
        with upload(f"{s3}/big.mpk") as f:
            f.write(b"\0" * (PART_BYTES + 1))  # one part uploaded
            raise KeyError("interrupted")
    fs = fsspec.filesystem("s3")
    bucket = s3[5:].split("/")[0]
    assert not fs.exists(f"{s3}/big.mpk")
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


@trainrec.record
class LoopState:
    micro: int
    rng: RngRecord | None = None


def _train(mgr: CheckpointManager | None, upto: int, stop: int | None = None) -> dict:
    """A training loop (dropout, accumulation over 2 micro-steps, a schedule) that saves
    every 5 micro-steps to `mgr` and resumes from its latest step; stops at `stop`."""
    model, opt, sched = MLP([8, 16, 2], seed=0, dropout=0.1), AdamW(weight_decay=0.01), StepLr(1e-2, 3)
    acc, gen, state = GradientsAccumulator(), np.random.default_rng(1), LoopState(0)
    if mgr is not None and mgr.latest_step() is not None:
        r = mgr.load(state_type=LoopState).restore(model, opt, sched, "cpu")
        acc, state = r.accumulator, r.state
        state.rng.apply(gen)
    while state.micro < upto:
        x = gen.normal(size=(4, 8)).astype(np.float32)
        _, grads = model.loss_and_grads(x, np.tanh(x[:, :2]), gen)
        acc.accumulate(model, grads)
        state.micro += 1
        if state.micro % 2 == 0:
            summed = acc.grads()
            opt.step(sched.step(), model, GradientsParams({k: v / np.float32(2) for k, v in summed.items()}))
        if mgr is not None and state.micro % 5 == 0:
            state.rng = RngRecord.capture(gen)
            mgr.save(state.micro, TrainingRecord.capture(model, opt, sched, acc, state), block=True)
        if state.micro == stop:
            break
    return {k: v.copy() for k, v in model.params.items()}


def test_a_training_loop_on_s3_resumes_bitwise_from_latest(s3):
    straight = _train(None, 22)
    with CheckpointManager(s3, keep_last=2) as mgr:
        _train(mgr, 22, stop=13)  # saved 5 and 10, then "crashed": 11-13 are lost
    with CheckpointManager(s3, keep_last=2) as mgr:
        assert mgr.steps() == [5, 10]
        resumed = _train(mgr, 22)
        assert mgr.steps() == [15, 20]
    assert straight.keys() == resumed.keys()
    assert all(straight[k].tobytes() == resumed[k].tobytes() for k in straight)


def test_the_cli_verifies_and_inspects_s3(s3, capsys):
    from trainrec.cli.commands import main

    with CheckpointManager(s3) as mgr:
        mgr.save(1, _record(1), block=True)
    assert main(["verify", s3]) == 0
    assert "OK: " + s3 + "/step-00000001.commit" in capsys.readouterr().out
    assert main(["inspect", "--json", s3]) == 0
    assert json.loads(capsys.readouterr().out)["tree"]["state"] == {"step": 1}


def test_an_emptied_commit_on_s3_is_a_corrupt_record_and_fails_verify(s3, capsys):
    from trainrec.cli.commands import main

    with CheckpointManager(s3) as mgr:
        mgr.save(1, _record(1), block=True)
    fsspec.filesystem("s3").pipe_file(f"{s3}/step-00000001.commit", b"")  # S3 answers its range with 416
    with pytest.raises(CorruptRecordError, match="step-00000001.commit"):
        CheckpointManager(s3, read_only=True).load(1)
    assert main(["verify", s3]) == 1  # damaged, not unreadable (3)
    assert "step-00000001.commit" in capsys.readouterr().out


def test_a_missing_commit_on_s3_whose_name_holds_416_is_missing_not_empty(s3):
    from trainrec.storage.commit import read_commit
    from trainrec.storage.store import Store

    with pytest.raises(FileMissingError, match="step-416"):
        read_commit(Store(f"{s3}/step-416"), ".trainrec-commit")
    with pytest.raises(FileMissingError, match="x416.mpk"):
        TrainingRecord.load(NamedMpkFileRecorder(NATIVE), f"{s3}/x416.mpk")


def _lock(url: str, **fields) -> None:
    doc = {"pid": 1, "host": socket.gethostname(), "since": "then", "until": time.time() + 600,
           "token": "t", **fields}
    fsspec.filesystem("s3").pipe_file(f"{url}/.trainrec-lock", json.dumps(doc).encode())


def test_s3_writers_are_kept_apart_by_a_conditional_lease(s3):
    with CheckpointManager(s3) as mgr:
        mgr.save(1, _record(1), block=True)
        with pytest.raises(RecorderError, match="another CheckpointManager writes to this folder"):
            CheckpointManager(s3)
    _lock(s3, host="elsewhere", pid=os.getpid())  # a live lease of another host
    with pytest.raises(RecorderError, match="host 'elsewhere'.*lease runs"):
        CheckpointManager(s3)
    _lock(s3, host="elsewhere", until=time.time() - 1)  # expired: taken over
    with CheckpointManager(s3) as mgr:
        mgr.save(2, _record(2), block=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    _lock(s3, pid=pid)  # a process of this host that is gone (a killed writer's)
    with CheckpointManager(s3) as mgr:
        mgr.save(3, _record(3), block=True)
        assert mgr.steps() == [1, 2, 3]


def test_a_writer_whose_lease_was_taken_over_commits_nothing(s3):
    mgr = CheckpointManager(s3)
    mgr.save(1, _record(1), block=True)
    _lock(s3, host="elsewhere")  # another writer took the lease over (this one stalled)
    mgr.save(2, _record(2))
    with pytest.raises(RecorderError, match="took this manager's lease over"):
        mgr.wait()
    assert CheckpointManager(s3, read_only=True).steps() == [1]
    mgr.close()
    assert fsspec.filesystem("s3").exists(f"{s3}/.trainrec-lock")  # the other's, left alone


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.split())
    out.put(None)


def test_sigkill_during_s3_saves_loses_no_committed_checkpoint(s3, capsys):
    """A writer (tests/objstore_writer.py, forked by a server that imported everything
    once) saving through CheckpointManager(s3://...) is SIGKILLed at random moments of its
    life (opening the manager, uploading parts, committing, retention), 50 times; after
    each kill every step it reported saved since the oldest listed one is still listed
    and the latest loads back equal, dtypes kept. At the end every listed step loads,
    `trainrec verify` passes, and a new writer resumes after the latest step."""
    from objstore_writer import SIZE, params, state

    from trainrec.cli import main

    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("objstore_writer.py")), s3],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(server.stdout, lines), daemon=True).start()
    shapes = MLP([SIZE, SIZE, 2], seed=0)

    def expect(word: str, timeout: float = 60) -> list[str]:
        got = lines.get(timeout=timeout)
        assert got is not None and got[0] == word, (word, got)
        return got

    def run(delay: float | None) -> list[int]:
        """One writer, killed after `delay` s (None: after its first save); its saves."""
        server.stdin.write("go\n")
        server.stdin.flush()
        pid = int(expect("pid")[1])
        started = time.monotonic()
        if delay is not None:
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        out = []
        while (got := lines.get(timeout=60)) is not None and got[0] != "exit":
            assert got[0] == "saved", got  # a writer stops only when killed
            out.append(int(got[1]))
            if delay is None:
                os.kill(pid, signal.SIGKILL)
                first_save.append(time.monotonic() - started)
        assert got is not None and int(got[1]) == pid and got[2] == str(signal.SIGKILL), got
        return out

    def check(reader: CheckpointManager, step: int) -> None:
        rec = reader.load(step, state_type=type(state(0)))
        want = state(step)
        assert rec.state.step == step
        for name in ("bf16", "i8", "f64"):
            got, expected = getattr(rec.state, name), getattr(want, name)
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), (step, name)
        for k, v in params(step, shapes).items():
            t = rec.model.item[k]
            assert t.array.dtype == np.float32 and t.array.tobytes() == v.tobytes(), (step, k)

    rng = random.Random(28)
    first_save: list[float] = []
    lives_with_saves = 0
    try:
        expect("ready", timeout=120)
        deadline = time.monotonic() + 300  # about 110 s alone on two loaded cores
        saved = run(None)  # how long a writer takes to open its manager and save once
        # (1.4-2.5 s on two loaded cores, each next save 0.8 s): kills land anywhere in a
        # writer's opening and its first saves, however loaded the machine is
        span = 3.0 * first_save[0]  # two-part saves (5 MiB parts): room for a few per life
        for _ in range(50):
            assert time.monotonic() < deadline, f"{len(saved)} saves, too slow"
            got = run(rng.uniform(0.0, span))
            saved += got
            lives_with_saves += bool(got)
            reader = CheckpointManager(s3, read_only=True)
            steps = reader.steps()
            if saved:
                assert steps and steps[-1] >= saved[-1]
                # a step may also be committed unreported (killed before it printed)
                assert {s for s in saved if s >= steps[0]} <= set(steps), (saved, steps)
                assert len(steps) >= min(3, len(saved))
                check(reader, steps[-1])
        assert lives_with_saves >= 8 and len(saved) >= 12  # the kills did land among saves (16, 25 seen)
        reader = CheckpointManager(s3, read_only=True)
        for s in reader.steps():
            check(reader, s)
        capsys.readouterr()
        assert main(["verify", s3]) == 0
        assert capsys.readouterr().out.count("OK: ") == len(reader.steps())
        latest = reader.latest_step()
        assert run(None) == [latest + 1]  # a new writer resumes after the latest step
        assert CheckpointManager(s3, read_only=True).latest_step() == latest + 1
        print(f"50 kills, {lives_with_saves} writers killed after a save, {len(saved)} saves reported")
    finally:
        server.stdin.close()
        server.wait(30)


def test_s3_loads_stream_ranges_into_place_and_refuse_damage(s3, monkeypatch):
    """Ranged GETs streamed into the buffer (several ranges, several chunks each, in
    flight at once) load a checkpoint equal; one replaced by another of its size, cut
    short or gone on past its commit's size is refused."""
    # the module that reads these names (`trainrec.storage.location` as an attribute is its function)
    storage = importlib.import_module("trainrec.storage.location")

    monkeypatch.setattr(storage, "READ_BYTES", 8 << 10)  # several ranges of several chunks
    monkeypatch.setattr(storage, "_CHUNK", 3000)
    streamed, stream = [], storage._stream_range

    async def counted(*args):
        streamed.append(args[5:7])
        return await stream(*args)

    monkeypatch.setattr(storage, "_stream_range", counted)
    with CheckpointManager(s3) as mgr:
        mgr.save(1, _record(1, size=96), block=True)
        mgr.save(2, _record(2, size=96), block=True)
        _check(mgr, 2)
    assert len(streamed) > 4  # s3:// bodies streamed into place, range by range
    fs = fsspec.filesystem("s3")
    doc = json.loads(fs.cat_file(f"{s3}/step-00000002.commit"))
    entry = next(o for o in doc["objects"] if o["role"] == "checkpoint")
    assert entry["size"] > 4 * (8 << 10)
    one, two = (f"{s3}/{_s3_object(s3, s)}" for s in (1, 2))
    good = fs.cat_file(two)
    reader = CheckpointManager(s3, read_only=True)
    fs.pipe_file(two, fs.cat_file(one))  # a valid checkpoint of the same size, not step 2's
    with pytest.raises(CorruptRecordError, match="CRC-32 is .* its commit says"):
        reader.load(2)
    fs.pipe_file(two, good[:-10])
    with pytest.raises(CorruptRecordError, match="ended after"):
        reader.load(2)
    fs.pipe_file(two, good[: 8 << 10])  # ends before the later ranges start
    with pytest.raises(CorruptRecordError, match="ended after"):
        reader.load(2)
    fs.pipe_file(two, good + b"\0")
    with pytest.raises(CorruptRecordError, match="holds more than"):
        reader.load(2)
    fs.pipe_file(two, good)
    _check(reader, 2)


def _s3_object(url: str, step: int) -> str:
    doc = json.loads(fsspec.filesystem("s3").cat_file(f"{url}/step-{step:08d}.commit"))
    return next(o["name"] for o in doc["objects"] if o["role"] == "checkpoint")


def test_a_burnpack_round_trips_on_s3(s3, tmp_path):
    from trainrec.burn import BurnpackRecorder

    BurnpackRecorder().save_item(_burn_item(), f"{s3}/m.bpk")
    BurnpackRecorder().save_item(_burn_item(), tmp_path / "m.bpk")
    assert fsspec.filesystem("s3").cat_file(f"{s3}/m.bpk") == (tmp_path / "m.bpk").read_bytes()
    assert same(BurnpackRecorder().read(f"{s3}/m.bpk")[1], BurnpackRecorder().read(tmp_path / "m.bpk")[1])
