"""Checkpoints at store URLs (trainrec.storage.location, commit, store_manager; spec/PROTOCOLS.md,
"Checkpoints on object stores"): `memory://` for the fast cases, and a real S3 protocol
server (moto's, started on a loopback port) through s3fs for the rest."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

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
    from trainrec.recorders.burn import BurnpackRecorder

    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="takes a local path, not the URL"):
        BurnpackRecorder().save_item(_item(), "memory://bucket/x.bpk")
    assert list(tmp_path.iterdir()) == []  # before: a folder "memory:" with bucket/x.bpk in it


def test_a_missing_object_is_file_missing(mem):
    with pytest.raises(FileMissingError, match="x.mpk"):
        TrainingRecord.load(NamedMpkFileRecorder(NATIVE), f"{mem}/x.mpk")


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


def test_a_store_without_conditional_writes_refuses_writers():
    from trainrec.storage.location import Store

    store = Store.__new__(Store)
    store.scheme, store.url, store.conditional = "gs", "gs://bucket/run", False
    with pytest.raises(RecorderError, match="no conditional writes"):
        store.put_new(".trainrec-lock", b"{}")


# -- a real S3 protocol server (moto) through s3fs ----------------------------------------


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server in a process of its own (a thread of this one would share its
    sockets with the writers the kill test forks) on a free loopback port."""
    pytest.importorskip("s3fs", reason="the [s3] extra is not installed")
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto[server] is not installed: pip install 'trainrec[test]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a socket timeout: a writer killed inside a request must not hold the server's
    # dispatch lock (taken while it reads the request) for ever
    serve = ("import socket, sys; socket.setdefaulttimeout(3); from moto.server import main; "
             "main(sys.argv[1:])")
    server = subprocess.Popen([sys.executable, "-c", serve, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                why = server.stderr.read().decode(errors="replace")[-500:] if server.stderr else ""
                pytest.skip(f"the moto S3 server did not start on 127.0.0.1:{port}: {why}")
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.filesystem("s3", skip_instance_cache=True)  # the env is read by new instances
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.terminate()
    server.wait(10)


@pytest.fixture
def s3(s3_server):
    bucket = f"trainrec-{os.urandom(4).hex()}"
    fs = fsspec.filesystem("s3")
    fs.mkdir(bucket)
    return f"s3://{bucket}/run"


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
