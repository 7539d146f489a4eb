"""`OrbaxRecorder`: a `TrainingRecord` as one Orbax checkpoint (spec/FORMAT.md §10).

Round trips of every item kind and dtype; precision settings and the lossy check; a save
that raises or is killed (SIGKILL, in a subprocess) leaves the checkpoint that was there;
damaged, truncated, edited and foreign directories load as `RecorderError`s; the format
registry (`read_file`, `trainrec inspect` / `verify`); `CheckpointManager` with
directory checkpoints; multi-device in one process (8 CPU devices, `NamedSharding`:
Orbax writes each device's shard, a fresh process restores onto its live shardings and
continues bitwise); two JAX processes on CPU (`jax.distributed.initialize` with a local
coordinator, 2 devices each) saving one checkpoint together, each writing the shards it
holds, and loading it; and fresh-process bitwise continuation through the roles.

Two processes work with this JAX (0.10.2) on CPU: Orbax synchronises them through the
coordinator's key-value store, and `jax_cpu_collectives_implementation="gloo"` is set for
the collectives JAX itself may run. `TrainingRecord.restore` onto arrays that span both
processes is not tested: on main, capture (and so the restore's backup) copies a whole
array to the host, which a process cannot do for an array it holds only part of; the
checkpoint's arrays are read back onto the global mesh with Orbax instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

import ml_dtypes  # noqa: E402
from continuation import assert_exact, continuation_results  # noqa: E402
from same_items import same  # noqa: E402

import trainrec  # noqa: E402
from trainrec import (  # noqa: E402
    CheckpointManager,
    CorruptRecordError,
    FileMissingError,
    GradientsAccumulator,
    LossyPrecisionError,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    TensorData,
    TrainingRecord,
    read_file,
)
from trainrec.adapters.jax import OrbaxRecorder  # noqa: E402

NATIVE = NativePrecisionSettings()
HERE = Path(__file__).parent
RUN = HERE / "orbax_run.py"


def _item() -> trainrec.Item:
    """Every dtype, 0-d and empty tensors, and every scalar kind."""
    rng = np.random.default_rng(0)
    return {
        "f32": TensorData.from_array(rng.normal(size=(3, 4)).astype(np.float32)),
        "bf16": TensorData.from_array(np.array([1.5, -2.25, 3e38], ml_dtypes.bfloat16)),
        "f16": TensorData.from_array(np.array([0.1, 65504], np.float16)),
        "f64": TensorData.from_array(np.array([np.pi, 1e-300])),
        "key": TensorData.from_array(np.array([0, 2**32 - 1], np.uint32)),
        "ints": [TensorData.from_array(np.array([-(2**63), 2**63 - 1], np.int64)),
                 TensorData.from_array(np.array([-(2**31)], np.int32)),
                 TensorData.from_array(np.array([-7], np.int16)),
                 TensorData.from_array(np.array([-8], np.int8)),
                 TensorData.from_array(np.array([255], np.uint8)),
                 TensorData.from_array(np.array([65535], np.uint16)),
                 TensorData.from_array(np.array([2**64 - 1], np.uint64))],
        "mask": TensorData.from_array(np.array([[True, False], [False, True]])),
        "scalar": TensorData.from_array(np.array(3.5, np.float32)),
        "empty": TensorData.from_array(np.zeros((0, 5), np.float32)),
        "values": [3, -(2**63), 2**64 - 1, 2.5, -0.0, float("inf"),
                   float(np.frombuffer(bytes.fromhex("7ff8000000000123")[::-1], np.float64)[0]),
                   "text \u00e9 \ud83d", b"\x00\xffbytes", None, True, False, [], {}],
        "nested": {"a.b": {"c": [TensorData.from_array(np.arange(3, dtype=np.float32))]}},
    }


def test_every_dtype_and_scalar_round_trips_exactly(tmp_path):
    item = _item()
    path = OrbaxRecorder(NATIVE).save_item(item, tmp_path / "c.orbax", "Item")
    assert path.is_dir() and (path / "trainrec" / "metadata").is_file()
    header, back = OrbaxRecorder().read(path)
    assert header.format == "trainrec.orbax" and header.record_type == "Item"
    assert header.settings == NATIVE
    assert same(back, item)  # dtypes, key order, NaN payloads and -0.0 included


def test_a_training_record_with_jax_parts_loads_back_and_restores(tmp_path):
    from trainrec.adapter_kit import train_until
    from trainrec.adapters.jax.demo import WORKLOAD

    parts = WORKLOAD.build(0)
    train_until(WORKLOAD, parts, 6, 4)  # mid-window: two gradients pending
    record = TrainingRecord.capture(parts.model, parts.optimizer, None, parts.accumulator, parts.state)
    path = record.save(OrbaxRecorder(NATIVE), tmp_path / "r.orbax")
    loaded = TrainingRecord.load(OrbaxRecorder(), path, state_type=WORKLOAD.state_type)
    assert same(loaded.into_item(NATIVE), record.into_item(NATIVE))
    assert loaded.state.key.dtype == np.uint32 and loaded.state.micro == 6
    fresh = WORKLOAD.build(1)
    restored = loaded.restore(fresh.model, fresh.optimizer, None, None)
    again = TrainingRecord.capture(fresh.model, fresh.optimizer, None, restored.accumulator, restored.state)
    assert same(again.into_item(NATIVE), record.into_item(NATIVE))
    # the record check: a model of other shapes is refused, nothing changes
    import jax.numpy as jnp

    from trainrec.adapters.jax import JaxModule
    other = JaxModule({"params": {"w": jnp.zeros((2, 2))}})
    with pytest.raises(RecordMismatchError):
        loaded.restore(other, fresh.optimizer, None, None)
    assert other.params["params"]["w"].shape == (2, 2)
    with pytest.raises(RecordMismatchError, match="holds a Item, not a TrainingRecord"):
        TrainingRecord.load(OrbaxRecorder(), OrbaxRecorder().save_item({"x": 1}, tmp_path / "i.orbax"))


def test_precision_settings_store_and_load_back_in_the_saved_dtype(tmp_path):
    item = {"w": TensorData.from_array(np.array([0.5, 2.0], np.float32)),
            "n": TensorData.from_array(np.array([7], np.int64)),
            "k": TensorData.from_array(np.array([2**32 - 1], np.uint32))}
    path = OrbaxRecorder(trainrec.HalfPrecisionSettings()).save_item(item, tmp_path / "h.orbax")
    table = json.loads((path / "trainrec" / "metadata").read_text())["tensors"]
    assert [row[2] for row in table] == ["f16", "i16", "u32"]  # stored; uint kept
    header, back = OrbaxRecorder().read(path)
    assert header.settings.name == "half" and same(back, item)


def test_a_lossy_save_raises_and_leaves_the_existing_checkpoint(tmp_path):
    path = tmp_path / "c.orbax"
    good = {"w": TensorData.from_array(np.array([1.0], np.float64))}
    OrbaxRecorder(NATIVE).save_item(good, path)
    lossy = {"w": TensorData.from_array(np.array([0.1], np.float64))}
    with pytest.raises(LossyPrecisionError, match="OrbaxRecorder\\(NativePrecisionSettings\\(\\)\\)"):
        OrbaxRecorder().save_item(lossy, path)
    assert same(OrbaxRecorder().read(path)[1], good)
    OrbaxRecorder().save_item(lossy, path, allow_lossy=True)  # rounded floats, when asked
    assert OrbaxRecorder().read(path)[1]["w"].array[0] == np.float64(np.float32(0.1))
    wrapped = {"n": TensorData.from_array(np.array([2**40], np.int64))}
    with pytest.raises(LossyPrecisionError):  # an integer that would change: never
        OrbaxRecorder().save_item(wrapped, path, allow_lossy=True)


def test_a_save_over_a_checkpoint_replaces_it_and_leaves_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in (tmp_path / "c.orbax", Path("r.orbax")):  # a relative path too
        for value in (1.0, 2.0, 3.0):
            assert OrbaxRecorder(NATIVE).save_item({"w": TensorData.from_array(np.array([value]))}, path) == path
            assert OrbaxRecorder().read(path)[1]["w"].array[0] == value
    assert sorted(os.listdir(tmp_path)) == ["c.orbax", "r.orbax"]


def test_a_save_that_fails_inside_orbax_or_at_the_exchange_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from trainrec.adapters.jax import orbax_recorder

    path = tmp_path / "c.orbax"
    old = {"w": TensorData.from_array(np.array([1.0], np.float32))}
    new = {"w": TensorData.from_array(np.array([2.0], np.float32))}
    OrbaxRecorder(NATIVE).save_item(old, path)

    async def broken_save(self, directory, *args, **kw):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(ocp.PyTreeCheckpointHandler, "async_save", broken_save)
        with pytest.raises(RecorderError, match="Orbax could not save the checkpoint.*No space"):
            OrbaxRecorder(NATIVE).save_item(new, path)
    assert same(OrbaxRecorder().read(path)[1], old)

    def broken_exchange(a, b):
        raise RecorderError("cannot put the new checkpoint in place: injected", source=str(b))

    with monkeypatch.context() as m:
        m.setattr(orbax_recorder, "_exchange", broken_exchange)
        with pytest.raises(RecorderError, match="injected"):
            OrbaxRecorder(NATIVE).save_item(new, path)
    assert same(OrbaxRecorder().read(path)[1], old)
    OrbaxRecorder(NATIVE).save_item(new, path)  # the next save clears what the failed one left
    assert same(OrbaxRecorder().read(path)[1], new)
    assert sorted(os.listdir(tmp_path)) == ["c.orbax"]


def test_a_save_never_replaces_a_file_a_foreign_directory_or_into_a_missing_folder(tmp_path, monkeypatch):
    item = {"w": TensorData.from_array(np.array([1.0], np.float32))}
    (tmp_path / "file").write_bytes(b"keep me")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("keep me")
    with pytest.raises(RecorderError, match="the target is a file"):
        OrbaxRecorder().save_item(item, tmp_path / "file")
    with pytest.raises(RecorderError, match="not a trainrec Orbax checkpoint"):
        OrbaxRecorder().save_item(item, tmp_path / "data")
    with pytest.raises(FileMissingError, match="does not exist"):
        OrbaxRecorder().save_item(item, tmp_path / "nowhere" / "c.orbax")
    assert (tmp_path / "file").read_bytes() == b"keep me"
    assert (tmp_path / "data" / "x.txt").read_text() == "keep me"
    with pytest.raises(TypeError):
        OrbaxRecorder().save_item(item, 3)
    from trainrec.adapters.jax import orbax_recorder

    big = {"losses": [0.5] * 1000}
    OrbaxRecorder().save_item(big, tmp_path / "big.orbax")
    monkeypatch.setattr(orbax_recorder, "MAX_JSON_BYTES", 1000)
    with pytest.raises(CorruptRecordError, match="more than the 1000 a load accepts"):
        OrbaxRecorder().read(tmp_path / "big.orbax")
    with pytest.raises(RecorderError, match="more than the 1000 a load accepts"):
        OrbaxRecorder().save_item(big, tmp_path / "big2.orbax")  # what a load refuses is never written
    assert not (tmp_path / "big2.orbax").exists()
    with pytest.raises(TypeError):
        OrbaxRecorder(settings="full")


_KILLER = """
import sys
import numpy as np
from trainrec import NativePrecisionSettings, TensorData
from trainrec.adapters.jax import OrbaxRecorder
rec = OrbaxRecorder(NativePrecisionSettings())
items = [{"w": TensorData.from_array(np.full((64, 64), v, np.float32)), "v": v} for v in (1.0, 2.0)]
n = 0
while True:
    rec.save_item(items[n % 2], sys.argv[1])
    n += 1
    print(n, flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    paths = [tmp_path / f"k{i}.orbax" for i in range(2)]
    for p in paths:
        OrbaxRecorder(NATIVE).save_item(
            {"w": TensorData.from_array(np.full((64, 64), 1.0, np.float32)), "v": 1.0}, p)
    procs = [subprocess.Popen([sys.executable, "-c", _KILLER, str(p)], stdout=subprocess.PIPE,
                              text=True) for p in paths]
    try:
        for i, proc in enumerate(procs):
            assert proc.stdout is not None
            for _ in range(2 + i):  # a few saves done: the next is in flight
                assert proc.stdout.readline(), "the saving process ended"
            time.sleep(0.013 * (i + 1))
            proc.send_signal(signal.SIGKILL)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    for p in paths:
        back = OrbaxRecorder().read(p)[1]
        assert back["v"] in (1.0, 2.0) and np.all(back["w"].array == back["v"])
        OrbaxRecorder(NATIVE).save_item({"v": 3.0}, p)  # and the next save clears any leftover
        assert OrbaxRecorder().read(p)[1] == {"v": 3.0}
    assert sorted(os.listdir(tmp_path)) == ["k0.orbax", "k1.orbax"]


# -- damaged and foreign checkpoints -----------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    item = {"w": TensorData.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64)),
            "b": TensorData.from_array(np.ones(8, np.float32)), "step": 3}
    return OrbaxRecorder(NATIVE).save_item(item, tmp_path / "c.orbax", "Item")


def _data_files(path: Path) -> list[Path]:
    return sorted((p for p in (path / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: -p.stat().st_size)


def test_a_deleted_shard_file_is_a_corrupt_record(saved):
    for f in _data_files(saved):
        f.unlink()
    with pytest.raises(CorruptRecordError, match="Orbax cannot read the array") as e:
        OrbaxRecorder().read(saved)
    assert "tensorstore_spec" not in str(e.value) and len(str(e.value)) < 1000


def test_a_truncated_shard_file_is_a_corrupt_record(saved):
    f = _data_files(saved)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptRecordError, match=str(saved)):
        OrbaxRecorder().read(saved)


def test_a_flipped_byte_in_a_shard_file_is_caught(saved):
    f = _data_files(saved)[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError):  # tensorstore's decode, or our checksum
        OrbaxRecorder().read(saved)


def _edit(path: Path, fn, *, fix_crc: bool) -> None:
    from trainrec.adapters.jax.orbax_recorder import _doc_crc

    marker = path / "trainrec" / "metadata"
    doc = json.loads(marker.read_text())
    fn(doc)
    if fix_crc:
        doc["crc"] = _doc_crc(doc)
    marker.write_text(json.dumps(doc))


def test_an_edited_json_item_is_refused(saved):
    _edit(saved, lambda d: d["item"].__setitem__("step", 4), fix_crc=False)
    with pytest.raises(CorruptRecordError, match="checksum does not match"):
        OrbaxRecorder().read(saved)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["tensors"][0][1].__setitem__(0, 32), "do not match the tensor table"),
    (lambda d: d["tensors"][0].__setitem__(2, "f64"), "do not match the tensor table"),
    (lambda d: d["tensors"].pop(), "do not match the tensor table"),
    (lambda d: d["checksums"].__setitem__(0, (d["checksums"][0] + 1) % 2**32), "checksum mismatch"),
    (lambda d: d["item"].__setitem__("w", {"__tensor__": 1}), "malformed tensor"),
    (lambda d: d.__setitem__("version", [9, 0]), "format version 9.0"),
    (lambda d: d.__setitem__("dtypes", [None]), "dtype table"),
])
def test_a_json_item_that_does_not_match_the_arrays_is_refused(saved, edit, message):
    _edit(saved, edit, fix_crc=True)  # consistent with its checksum: the checks behind it catch it
    with pytest.raises(RecorderError, match=message):
        OrbaxRecorder().read(saved)


def test_foreign_paths_are_clear_errors(tmp_path, saved):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x").write_text("x")
    with pytest.raises(CorruptRecordError, match="not an Orbax checkpoint"):
        OrbaxRecorder().read(tmp_path / "plain")
    (tmp_path / "file").write_bytes(b"\x00" * 10)
    with pytest.raises(CorruptRecordError, match="a file, not an Orbax checkpoint"):
        OrbaxRecorder().read(tmp_path / "file")
    trainrec.DefaultRecorder().save_item({"x": 1}, tmp_path / "x.mpk")
    with pytest.raises(CorruptRecordError, match="this is a NamedMpk file: NamedMpkFileRecorder"):
        OrbaxRecorder().read(tmp_path / "x.mpk")
    with pytest.raises(FileMissingError):
        OrbaxRecorder().read(tmp_path / "missing")
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as c:  # an Orbax checkpoint of someone else's
        c.save(tmp_path / "theirs", {"a": np.ones(3)})
    with pytest.raises(CorruptRecordError, match="without trainrec's item"):
        OrbaxRecorder().read(tmp_path / "theirs")
    (saved / "trainrec" / "metadata").write_text('{"format": "trainrec.orbax", ')
    with pytest.raises(CorruptRecordError, match="does not parse"):
        OrbaxRecorder().read(saved)
    (saved / "trainrec" / "metadata").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CorruptRecordError):
        OrbaxRecorder().read(saved)


def test_an_unfinished_orbax_directory_is_refused(tmp_path, saved):
    shutil.copytree(saved, tmp_path / "half")
    (tmp_path / "half" / "commit_success.txt").unlink()
    (tmp_path / "half" / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(CorruptRecordError, match="never finalized"):
        OrbaxRecorder().read(tmp_path / "half")


# -- the format registry and the CLI ---------------------------------------------------------


def test_read_file_and_the_cli_recognise_an_orbax_directory(tmp_path, saved, capsys):
    from trainrec.cli.commands import main
    from trainrec.recorders.formats import format_for_name, recorder_for

    header, item = read_file(saved)
    assert header.format == "trainrec.orbax" and item["step"] == 3
    assert format_for_name("x.orbax").name == "trainrec.orbax"
    assert isinstance(recorder_for("x.orbax"), OrbaxRecorder)
    assert main(["inspect", str(saved)]) == 0
    assert "format: trainrec.orbax" in capsys.readouterr().out
    assert main(["verify", str(saved)]) == 0
    assert "every tensor checksum" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileMissingError, match="a directory, not a record file"):
        read_file(tmp_path / "plain")
    assert main(["inspect", str(tmp_path / "plain")]) == 3
    with pytest.raises(FileMissingError, match="this is an Orbax checkpoint directory: "
                                               "trainrec.adapters.jax.OrbaxRecorder reads it"):
        trainrec.DefaultRecorder().load_item(saved)  # another recorder says which one reads it
    _edit(saved, lambda d: d["item"].__setitem__("step", 4), fix_crc=False)
    assert main(["verify", str(saved)]) == 1


def test_the_checkpoint_manager_keeps_and_deletes_orbax_directories(tmp_path):
    from trainrec.adapters.numpy import MLP, AdamW, StepLr

    @trainrec.record
    class Step:
        step: int

    def record(step: int) -> TrainingRecord:
        model = MLP([4, 4, 2], seed=step)
        return TrainingRecord.capture(model, AdamW(), StepLr(0.1, 2), GradientsAccumulator(), Step(step))

    # what a killed save of an older step, and a killed deletion, leave behind
    (tmp_path / "step-00000001.orbax.orbax-checkpoint-tmp").mkdir()
    (tmp_path / ".step-00000000.orbax.trainrec-del").mkdir()
    (tmp_path / "foreign.orbax-checkpoint-tmp").mkdir()
    mgr = CheckpointManager(tmp_path, OrbaxRecorder(NATIVE), keep_last=2)
    saved = {s: record(s) for s in (1, 2, 3)}
    for s, rec in saved.items():
        mgr.save(s, rec, metrics={"loss": 1.0 / s}, block=True)
    assert mgr.steps() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".trainrec-lock", "foreign.orbax-checkpoint-tmp",
        "step-00000002.metrics.json", "step-00000002.orbax",
        "step-00000003.metrics.json", "step-00000003.orbax"]
    for s in (2, 3):
        assert same(mgr.load(s).into_item(NATIVE), saved[s].into_item(NATIVE))
    assert CheckpointManager(tmp_path, OrbaxRecorder(), read_only=True).load(state_type=Step).state.step == 3


# -- several devices, several processes, fresh processes -------------------------------------


def _run(*args: str, timeout: float = 90) -> dict:
    out = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=HERE)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sharded_arrays_are_written_per_device_and_a_fresh_process_resumes_bitwise(tmp_path):
    saved = _run("sharded-save", str(tmp_path))
    assert saved["same"], saved["where"]
    # a (16, 32) parameter sharded 8 ways on its first axis: Orbax wrote one chunk per shard
    w1 = [i for i, k in enumerate(saved["keys"]) if k == "0.state.w1"][0]
    assert saved["chunks"][f"{w1:06d}"] == [[16, 32], [2, 32]]
    resumed = _run("sharded-resume", str(tmp_path))
    assert resumed["small_ok"] and resumed["small_same"]  # onto a mesh of 4: placed, values kept
    assert resumed["placed"] and resumed["placed_opt"]  # onto the live shardings
    assert resumed["same"], (resumed["where"], resumed["diff"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_two_jax_processes_save_one_checkpoint_together_and_load_it(tmp_path):
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(RUN), "multiprocess", str(tmp_path), str(i), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    for i, got in enumerate(outs):
        assert got["process"] == i and got["count"] == 2
        # each process wrote the shards it holds
        assert set(got["written"]) == {"ocdbt.process_0", "ocdbt.process_1"}
        assert all(n > 0 for n in got["written"].values())
        assert got["same"], got["where"]
        assert got["shards_ok"] and got["placed"]
        assert got["same_again"] and got["leftovers"] == ["mp.orbax"]


CONTINUATION = [("default", 2, "orbax")]  # mid-window: two gradients pending


def test_a_fresh_process_resumes_bitwise_from_an_orbax_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    results = continuation_results("jax_orbax_workload:WORKLOAD", CONTINUATION, [], tmp_path, env=env)
    for key in CONTINUATION:
        assert_exact(results, key)
