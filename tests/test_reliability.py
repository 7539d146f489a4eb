"""Reliability and security: crash-safe saves, hostile input, no code execution from a
file, atomic restore under failure. See spec/SECURITY.md."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainrec
from trainrec import (
    DefaultRecorder,
    GradientsAccumulator,
    GradientsParamsRecord,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    TrainingRecord,
)
from trainrec.adapters.numpy import MLP, AdamW, NumpyBackend, StepLr


@trainrec.record
class Gen:
    generation: int


# -- crash safety -------------------------------------------------------------------------

SAVER = textwrap.dedent(
    """
    import json, os, sys, numpy as np, trainrec
    from trainrec.adapters.numpy import MLP, AdamW, StepLr

    @trainrec.record
    class Gen:
        generation: int

    def save_forever(path, start, log):
        model, opt, sched = MLP([512, 1024, 512], seed=0), AdamW(), StepLr(0.1, 2)
        acc = trainrec.GradientsAccumulator()
        with open(log, "w") as out:
            print("ready", os.getpid(), flush=True)
            for g in range(start, start + 10_000):
                for v in model.params.values():
                    v[...] = g
                trainrec.TrainingRecord.capture(model, opt, sched, acc, Gen(g)).save(
                    trainrec.DefaultRecorder(), path)
                print(g, file=out, flush=True)

    # the zygote: imported once, it saves nothing itself; each line asks for one writer
    print("zygote", flush=True)
    for line in iter(sys.stdin.readline, ""):
        pid = os.fork()
        if pid == 0:
            try:
                save_forever(*json.loads(line))
            finally:
                os._exit(1)
        os.waitpid(pid, 0)  # killed by the test
        print("reaped", flush=True)
    """
)
"""Each writer is a child forked from a zygote process that imported numpy and trainrec once
(and never saved): a process of its own that builds its objects and saves generation after
generation into one checkpoint until the test SIGKILLs it, without an interpreter start-up
per kill. It reports its pid once it is about to save, then each generation it completed
(into its own log: the zygote's stdout is the test's)."""


def _check_complete(path: Path, at_least: int) -> int:
    rec = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=Gen)
    g = rec.state.generation
    assert g >= at_least
    for name, t in rec.model.item.items():  # type: ignore[union-attr]
        assert np.all(t.array == g), name  # every tensor from the same save: old or new, whole
    return g


def test_sigkill_during_saves_never_leaves_a_broken_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    path = tmp_path / "ckpt.mpk"
    # generation 0 written once, completely, before the kills begin
    model = MLP([512, 1024, 512], seed=0)
    for v in model.params.values():
        v[...] = 0
    TrainingRecord.capture(model, AdamW(), StepLr(0.1, 2), GradientsAccumulator(), Gen(0)).save(
        DefaultRecorder(), path)
    rng = random.Random(1234)
    seen, landed = 0, 0
    deadline = time.monotonic() + 400  # 50 kills: a loaded machine (the suite on every core) is slower
    trials = 0
    logs = tmp_path / "logs"
    logs.mkdir()
    zygote = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        assert zygote.stdout.readline().strip() == "zygote"  # the imports are done
        while trials < 50 and time.monotonic() < deadline:
            log = logs / f"writer-{trials}.txt"
            zygote.stdin.write(json.dumps([str(path), seen + 1, str(log)]) + "\n")
            zygote.stdin.flush()
            # wait until the writer built its objects, then kill it inside the save loop
            got = zygote.stdout.readline().split()
            assert got[:1] == ["ready"], got
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(int(got[1]), signal.SIGKILL)
            assert zygote.stdout.readline().strip() == "reaped"
            landed += len(log.read_text().split())
            seen = _check_complete(path, seen)
            trials += 1
    finally:
        zygote.kill()
        zygote.communicate()
    assert trials >= 50
    assert landed > 0  # the kills did land among real saves
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".trainrec-tmp")]
    # temp files of killed saves never break the next save or load, which removes them
    TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=Gen).save(DefaultRecorder(), path)
    _check_complete(path, seen)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".trainrec-tmp")]
    print(f"{trials} kills, {landed} completed saves, {len(leftovers)} orphaned temp files removed")


# -- atomic restore under failure ---------------------------------------------------------


def _numpy_setup():
    model, opt, sched, acc = MLP([3, 4, 2], seed=0), AdamW(), StepLr(0.1, 2), GradientsAccumulator()
    gen = np.random.default_rng(0)
    for i in range(5):
        _, g = model.loss_and_grads(gen.normal(size=(2, 3)), gen.normal(size=(2, 2)))
        acc.accumulate(model, g)
        if i % 2:
            opt.step(sched.step(), model, acc.grads())
    return model, opt, sched, acc


def _snapshot(model, opt, sched):
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.capture(model, opt, sched, GradientsAccumulator(), Gen(0)).save(r)


@pytest.mark.parametrize("failing", ["model", "optimizer", "scheduler"])
def test_a_failure_while_writing_rolls_every_component_back(monkeypatch, failing):
    rec = TrainingRecord.capture(*_numpy_setup(), Gen(5))
    model, opt, sched = MLP([3, 4, 2], seed=9), AdamW(), StepLr(0.1, 2)
    sched.step()
    before = _snapshot(model, opt, sched)
    target = {"model": model, "optimizer": opt, "scheduler": sched}[failing]
    real = target.load_record
    calls = {"n": 0}

    def failing_load(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:  # the restore's write fails half way: it changed things first
            real(*args, **kw)
            raise MemoryError("device out of memory")
        return real(*args, **kw)  # the rollback's write

    monkeypatch.setattr(target, "load_record", failing_load)
    with pytest.raises(RecorderError, match="rolled back"):
        rec.restore(model, opt, sched, "cpu")
    assert _snapshot(model, opt, sched) == before


def test_a_failure_in_the_rollback_is_reported(monkeypatch):
    rec = TrainingRecord.capture(*_numpy_setup(), Gen(5))
    model, opt, sched = MLP([3, 4, 2], seed=9), AdamW(), StepLr(0.1, 2)

    def broken(*args, **kw):
        raise OSError("device lost")

    monkeypatch.setattr(opt, "load_record", broken)
    monkeypatch.setattr(model, "load_record", broken)
    with pytest.raises(RecorderError, match="partly restored"):
        rec.restore(model, opt, sched, "cpu")


def test_load_record_failing_mid_way_leaves_the_accumulator_unchanged(monkeypatch):
    model, *_ = _numpy_setup()
    acc = GradientsAccumulator()
    _, g = model.loss_and_grads(np.ones((2, 3)), np.ones((2, 2)))
    acc.accumulate(model, g)
    before = {k: v.array.copy() for k, v in acc.try_to_record().grads.items()}
    record = GradientsParamsRecord(
        {k: TensorData.from_array(np.zeros(v.shape, np.float32)) for k, v in before.items()}
    )
    backend = acc.backend
    assert isinstance(backend, NumpyBackend)
    calls = {"n": 0}
    real = backend.from_host

    def flaky(array, device):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy failed")
        return real(array, device)

    monkeypatch.setattr(backend, "from_host", flaky)
    with pytest.raises(RecorderError, match="copy failed"):
        acc.load_record(record, "cpu")
    after = acc.try_to_record().grads
    assert all(np.array_equal(before[k], after[k].array) for k in before)


def test_torch_copy_failing_mid_restore_rolls_back(monkeypatch):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(src.parameters())
    src(torch.randn(5, 3)).sum().backward()
    opt.step()
    rec = TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Gen(1))
    dst = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt_dst = torch.optim.Adam(dst.parameters())
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    real_copy = torch.Tensor.copy_
    calls = {"n": 0}

    def flaky_copy(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_copy(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", flaky_copy)
    with pytest.raises(RecorderError, match="rolled back"):
        rec.restore(dst, opt_dst, None, "cpu")
    monkeypatch.undo()
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in before.items())
    assert opt_dst.state_dict()["state"] == {}


# -- hostile and corrupt input ------------------------------------------------------------


def _valid_item():
    return {"w": TensorData.from_array(np.arange(64, dtype=np.float32).reshape(8, 8)),
            "meta": {"step": 3, "name": "x", "blob": b"\x00\x01", "lst": [1.5, None, True]},
            "grads": [TensorData.from_array(np.ones(5, np.float16))]}


def _recorders():
    out = {
        "mpk": NamedMpkFileRecorder(),
        "gz": NamedMpkGzFileRecorder(max_bytes=1 << 20),
        "bytes": NamedMpkBytesRecorder(),
    }
    try:
        import trainrec.adapters.torch as trt

        out["torch"] = trt.TorchFileRecorder()
    except ImportError:
        pass
    try:
        import trainrec.adapters.jax as trj

        out["flax"] = trj.FlaxMsgpackFileRecorder()
    except ImportError:
        pass
    return out


RECORDERS = _recorders()


def _write(name, tmp_path):
    r = RECORDERS[name]
    if name == "bytes":
        return r.save_item(_valid_item(), None)
    return r.save_item(_valid_item(), tmp_path / f"valid.{name}").read_bytes()


def _load(name, data: bytes, tmp_path: Path):
    r = RECORDERS[name]
    if name == "bytes":
        return r.load_item(data)
    path = tmp_path / f"case.{name}"
    path.write_bytes(data)
    return r.load_item(path)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "cut", "insert", "delete"]), st.integers(0, 2**32),
              st.integers(0, 255)),
    min_size=1, max_size=4,
)


def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, val in ops:
        if not b:
            break
        i = pos % len(b)
        if op == "flip":
            b[i] ^= 1 << (val % 8)
        elif op == "set":
            b[i] = val
        elif op == "cut":
            del b[i:]
        elif op == "insert":
            b[i:i] = bytes([val]) * (1 + val % 7)
        else:
            del b[i : i + 1 + val % 9]
    return bytes(b)


@pytest.mark.parametrize("name", list(RECORDERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=mutations)
def test_mutated_files_raise_recorder_errors_quickly_and_within_memory(name, ops, tmp_path):
    valid = _write(name, tmp_path)
    data = _mutate(valid, ops)
    # the first refusal of a kind imports what its message needs (the format sniffers behind a
    # wrong magic, the entry points' metadata): once per process, not the load's own memory
    try:
        _load(name, data, tmp_path)
    except RecorderError:
        pass
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _load(name, data, tmp_path)
        loaded = True
    except RecorderError:
        loaded = False
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 1.0
    if name != "torch":  # torch.load's own buffers are outside our control
        assert peak < len(data) + (1 << 20)
    if loaded:
        # only possible for bytes no checksum covers: gzip framing that decodes the same; a
        # NamedMpk document and a .pt or flax file (file checksum) are covered byte for byte
        assert name == "gz" or data == valid


@pytest.mark.parametrize("name", list(RECORDERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048))
def test_random_bytes_raise_recorder_errors(name, data, tmp_path):
    try:
        _load(name, data, tmp_path)
    except RecorderError:
        return
    # a plain flax file is any msgpack map (e.g. b"\x80", the empty state dict)
    import msgpack

    assert name == "flax" and isinstance(msgpack.unpackb(data, strict_map_key=False), dict)


# -- no code execution from a file --------------------------------------------------------


def _core_payloads(tmp_path):
    rec = TrainingRecord.capture(*_numpy_setup(), Gen(1))
    out = []
    for name, r in (("mpk", NamedMpkFileRecorder()), ("gz", NamedMpkGzFileRecorder())):
        out.append((r, rec.save(r, tmp_path / f"c.{name}")))
    out.append((NamedMpkBytesRecorder(), rec.save(NamedMpkBytesRecorder())))
    return out


def test_core_loads_never_unpickle(tmp_path, monkeypatch):
    payloads = _core_payloads(tmp_path)

    def no_pickle(*a, **kw):
        raise AssertionError("pickle used on a load path")

    for attr in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, attr, no_pickle)
    monkeypatch.setattr(np, "load", no_pickle)
    for r, args in payloads:
        TrainingRecord.load(r, args, "cpu", state_type=Gen)
        TrainingRecord.load(r, args, "cpu", state_type=Gen, **({"mmap": True} if r is payloads[0][0] else {}))
    core = Path(trainrec.__file__).parent
    assert not [p for p in core.rglob("*.py") if "import pickle" in p.read_text()]


def test_loads_import_nothing_a_file_names(tmp_path, monkeypatch):
    payloads = _core_payloads(tmp_path)
    evil = NamedMpkBytesRecorder().save_item({"x": 1}, None, record_type="os.system")
    imported = []
    real_import = builtins.__import__

    def watch(name, *a, **kw):
        if name not in sys.modules:
            imported.append(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", watch)
    for r, args in payloads:
        TrainingRecord.load(r, args, "cpu", state_type=Gen)
    header, _ = NamedMpkBytesRecorder().read(evil)
    with pytest.raises(trainrec.RecordMismatchError):
        TrainingRecord.load(NamedMpkBytesRecorder(), evil)
    monkeypatch.undo()
    assert header.record_type == "os.system" and imported == []


def test_a_save_removes_temp_files_of_dead_writers_only(tmp_path):
    import fcntl

    from trainrec.storage import atomic as _atomic

    path = tmp_path / "c.mpk"
    orphan = tmp_path / f".c.mpk.abc123abc123{_atomic.TEMP_SUFFIX}"  # no writer holds it
    alive = tmp_path / f".c.mpk.def456def456{_atomic.TEMP_SUFFIX}"
    other = tmp_path / f".other.mpk.abc123abc123{_atomic.TEMP_SUFFIX}"
    for p in (orphan, alive, other):
        p.write_bytes(b"partial")
    fd = os.open(alive, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as its writer does, for the whole write
    try:
        DefaultRecorder().save_item({"a": 1}, path)
        assert not orphan.exists() and alive.exists() and other.exists()
    finally:
        os.close(fd)
    DefaultRecorder().save_item({"a": 1}, path)
    assert not alive.exists() and other.exists()


def test_adapter_recorders_refuse_unknown_major_versions(tmp_path):
    torch = pytest.importorskip("torch")
    import msgpack

    import trainrec.adapters.torch as trt

    pt = trt.TorchFileRecorder().save_item({"a": 1}, tmp_path / "x.pt")
    doc = torch.load(pt, weights_only=True)
    doc["version"] = [9, 0]
    torch.save(doc, pt)
    with pytest.raises(trainrec.UnsupportedVersionError, match="9.0"):
        trt.TorchFileRecorder().load_item(pt)
    jax_adapter = pytest.importorskip("trainrec.adapters.jax")
    fl = jax_adapter.FlaxMsgpackFileRecorder().save_item({"a": 1}, tmp_path / "x.msgpack")
    doc = msgpack.unpackb(fl.read_bytes())
    doc["version"] = [9, 1]
    fl.write_bytes(msgpack.packb(doc))
    with pytest.raises(trainrec.UnsupportedVersionError, match="9.1"):
        jax_adapter.FlaxMsgpackFileRecorder().load_item(fl)


def _fallocate_works(directory: Path) -> bool:
    from trainrec.storage import atomic as _atomic

    if _atomic._fallocate is None:
        return False
    probe = directory / "probe"
    with open(probe, "wb") as f:
        ok = _atomic._fallocate(f.fileno(), _atomic._FALLOC_FL_KEEP_SIZE, 0, 1 << 20) == 0
    probe.unlink()
    return ok


def test_a_save_reserves_its_payload_before_writing(tmp_path):
    if not _fallocate_works(tmp_path):
        pytest.skip("this filesystem has no fallocate")
    from trainrec.storage import atomic as _atomic

    with _atomic.atomic_write(tmp_path / "ckpt", size_hint=8 << 20) as f:
        st = os.fstat(f.fileno())
        assert (st.st_size, st.st_blocks * 512 >= 8 << 20) == (0, True)
        f.write(b"x" * 100)
    assert (tmp_path / "ckpt").read_bytes() == b"x" * 100
    assert os.stat(tmp_path / "ckpt").st_blocks * 512 <= 64 << 10  # the unused rest was freed
    item = {"w": TensorData.from_array(np.arange(3 << 20, dtype=np.float32)), "step": 3}
    path = NamedMpkFileRecorder(durable=False).save_item(item, tmp_path / "a.mpk")
    assert path.read_bytes() == NamedMpkBytesRecorder().save_item(item)
    assert os.stat(path).st_blocks * 512 < path.stat().st_size + (64 << 10)


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_a_disk_without_room_fails_before_writing_and_keeps_the_old_file(tmp_path, monkeypatch, code):
    import ctypes
    import errno

    from trainrec.storage import atomic as _atomic

    path = tmp_path / "ckpt.mpk"
    old = {"w": TensorData.from_array(np.ones(10, np.float32))}
    NamedMpkFileRecorder().save_item(old, path)
    before = path.read_bytes()
    calls = []

    def full_disk(fd, mode, offset, length):
        calls.append(length)
        ctypes.set_errno(getattr(errno, code))
        return -1

    monkeypatch.setattr(_atomic, "_fallocate", full_disk)
    written = []
    real_write = trainrec.format.writer.write_document
    monkeypatch.setattr(trainrec.recorders.namedmpk, "write_document",
                        lambda *a, **k: written.append(1) or real_write(*a, **k))
    big = {"w": TensorData.from_array(np.zeros(8 << 20, np.float32))}  # 32 MiB: reserved first
    with pytest.raises(RecorderError, match=r"needs at least \d+ bytes"):
        NamedMpkFileRecorder().save_item(big, path)
    assert len(calls) == 1 and 32 << 20 < calls[0] < (32 << 20) + 1024 and written == []
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.mpk"]


def test_a_filesystem_without_fallocate_still_saves(tmp_path, monkeypatch):
    import ctypes
    import errno

    from trainrec.storage import atomic as _atomic

    def unsupported(fd, mode, offset, length):
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(_atomic, "_fallocate", unsupported)
    item = {"w": TensorData.from_array(np.arange(1 << 16, dtype=np.float32))}
    path = NamedMpkFileRecorder().save_item(item, tmp_path / "a.mpk")
    np.testing.assert_array_equal(NamedMpkFileRecorder().load_item(path)["w"].array, item["w"].array)
