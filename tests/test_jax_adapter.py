"""The JAX adapter: backend, pytree holders, optax states, schedules, flax msgpack."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    CorruptRecordError,
    DType,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    TensorData,
    TrainingRecord,
)


@trainrec.record
class Step:
    micro: int
    key: jax.Array


def roundtrip(rec: TrainingRecord) -> TrainingRecord:
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.load(r, rec.save(r), "cpu", state_type=Step)


def params(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jnp.zeros(3)},
            "out": [jax.random.normal(k2, (3,)), jnp.ones((), jnp.bfloat16)]}


def loss(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return jnp.sum((h * p["out"][0]) ** 2) * p["out"][1].astype(jnp.float32)


def train(module, opt, steps, seed=1, sched=None):
    key = jax.random.PRNGKey(seed)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        g = jax.grad(loss)(module.params, jax.random.normal(sub, (5, 4)))
        if sched is not None:
            opt.opt_state.hyperparams["learning_rate"] = jnp.asarray(sched.step())
        updates, opt.opt_state = opt.tx.update(g, opt.opt_state, module.params)
        module.params = optax.apply_updates(module.params, updates)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb))


# -- backend ------------------------------------------------------------------------------


def test_devices_and_adapt():
    b = trj.JaxBackend()
    cpu = jax.devices("cpu")[0]
    assert b.device("cpu") == cpu == b.device(cpu) == b.device("cpu:0")
    with pytest.raises(ValueError):
        b.device("cpu:7")
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError):
            b.device("gpu:0")
    assert isinstance(trainrec.adapt(jnp.ones(2)), trj.JaxBackend)
    assert isinstance(trainrec.adapt(cpu), trj.JaxBackend)
    assert isinstance(trainrec.adapt(jax.Array), trj.JaxBackend)
    assert isinstance(trj.JaxModule(params()), trainrec.AutodiffModule)
    assert isinstance(trj.JaxOptimizer(optax.sgd(0.1), None), trainrec.Optimizer)
    assert isinstance(trj.JaxLrScheduler(optax.constant_schedule(0.1)), trainrec.LrScheduler)


@pytest.mark.parametrize("dtype", [d for d in DType if d not in (DType.U64, DType.I64, DType.F64)])
def test_host_roundtrip(dtype):
    b = trj.JaxBackend()
    t = jnp.asarray((np.arange(6).reshape(2, 3) % 2).astype(dtype.numpy))
    host = b.to_host(t)
    assert host.dtype == dtype.numpy and b.dtype_of(t) is dtype
    back = b.from_host(host, "cpu")
    assert back.dtype == t.dtype and bool(jnp.all(back == t))
    assert asyncio.run(b.to_host_async(t)).tobytes() == host.tobytes()


# -- module -------------------------------------------------------------------------------


def test_param_ids_are_key_paths():
    m = trj.JaxModule(params())
    assert m.param_ids() == ["dense.bias", "dense.kernel", "out.0", "out.1"]


def test_flax_linen_variables_params_are_trainable_batch_stats_recorded():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.Dense(3)(x)
            return nn.BatchNorm(use_running_average=not train)(x)

    net = Net()
    variables = net.init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    _, updated = net.apply(variables, jnp.ones((2, 4)) * 2, train=True, mutable=["batch_stats"])
    variables = {**variables, **updated}
    m = trj.JaxModule(variables)
    assert m.param_ids() == ["params.BatchNorm_0.bias", "params.BatchNorm_0.scale",
                             "params.Dense_0.bias", "params.Dense_0.kernel"]
    rec = m.into_record()
    assert {"batch_stats.BatchNorm_0.mean", "batch_stats.BatchNorm_0.var"} <= set(rec.item)
    fresh = trj.JaxModule(net.init(jax.random.PRNGKey(1), jnp.ones((2, 4))))
    fresh.load_record(rec, "cpu")
    assert leaves_equal(fresh.params, variables)
    g = jax.grad(lambda p: jnp.sum(net.apply({**variables, "params": p}, jnp.ones((2, 4)))))(variables["params"])
    grads = trj.grads_from(g, m)
    assert set(grads) == set(m.param_ids())
    assert leaves_equal(trj.to_tree(grads, m), g)


def test_flax_nnx_state():
    nnx = pytest.importorskip("flax.nnx")
    lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    m = trj.JaxModule(nnx.state(lin))
    assert m.param_ids() == ["bias", "kernel"]
    other = nnx.Linear(2, 3, rngs=nnx.Rngs(5))
    target = trj.JaxModule(nnx.state(other))
    target.load_record(m.into_record(), "cpu")
    nnx.update(other, target.params)
    assert np.array_equal(np.asarray(other.kernel[...]), np.asarray(lin.kernel[...]))


def test_restore_assigns_new_trees_of_the_live_structure_dtype_and_device():
    src = trj.JaxModule(params(0))
    dst = trj.JaxModule(params(1))
    old = dst.params
    dst.load_record(src.into_record(), "cpu")
    assert dst.params is not old and leaves_equal(dst.params, src.params)
    assert jax.tree_util.tree_structure(dst.params) == jax.tree_util.tree_structure(old)
    assert dst.params["out"][1].dtype == jnp.bfloat16


def test_module_mismatch_refused_unchanged():
    src = trj.JaxModule(params(0))
    other = trj.JaxModule({"dense": {"kernel": jnp.ones((4, 5)), "bias": jnp.zeros(5)},
                           "out": [jnp.ones(5), jnp.ones((), jnp.bfloat16)]})
    before = other.params
    with pytest.raises(RecordMismatchError, match="shape"):
        other.load_record(src.into_record(), "cpu")
    missing = trj.JaxModule({"dense": params()["dense"]})
    with pytest.raises(RecordMismatchError, match="not in the live"):
        missing.check_record(src.into_record())
    assert other.params is before


# -- optimizers ---------------------------------------------------------------------------

OPTIMIZERS = {
    "adamw-schedule-chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=1e-2)),
    "sgd-nesterov": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "masked-weight-decay": lambda: optax.chain(
        optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)),
        optax.adam(1e-2)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_state_resume_is_exact(name):
    tx = OPTIMIZERS[name]()
    src = trj.JaxModule(params(0))
    opt = trj.JaxOptimizer(tx, tx.init(src.params))
    train(src, opt, 4)
    key = jax.random.PRNGKey(9)
    rec = roundtrip(TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Step(4, key)))
    dst = trj.JaxModule(params(3))
    opt_dst = trj.JaxOptimizer(tx, tx.init(dst.params))
    r = rec.restore(dst, opt_dst, None, "cpu")
    assert r.model is dst and isinstance(r.state.key, jax.Array) and bool(jnp.all(r.state.key == key))
    assert leaves_equal(opt_dst.opt_state, opt.opt_state)
    train(src, opt, 4)
    train(dst, opt_dst, 4)
    assert leaves_equal(dst.params, src.params) and leaves_equal(opt_dst.opt_state, opt.opt_state)


def test_inject_hyperparams_with_jax_lr_scheduler():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0)
    sched_fn = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    src, sched = trj.JaxModule(params(0)), trj.JaxLrScheduler(sched_fn)
    opt = trj.JaxOptimizer(tx, tx.init(src.params))
    train(src, opt, 3, sched=sched)
    rec = roundtrip(TrainingRecord.capture(src, opt, sched, GradientsAccumulator(), Step(3, jax.random.PRNGKey(0))))
    dst, sched_dst = trj.JaxModule(params(1)), trj.JaxLrScheduler(sched_fn)
    opt_dst = trj.JaxOptimizer(tx, tx.init(dst.params))
    rec.restore(dst, opt_dst, sched_dst, "cpu")
    assert sched_dst.count == sched.count == 3  # no scheduler step on restore
    train(src, opt, 3, sched=sched)
    train(dst, opt_dst, 3, sched=sched_dst)
    assert leaves_equal(dst.params, src.params) and sched_dst.count == 6


def test_optax_structure_mismatch_refused():
    src = trj.JaxModule(params(0))
    adam = optax.adam(0.1)
    rec = trj.JaxOptimizer(adam, adam.init(src.params)).into_record(src)
    sgd = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(RecordMismatchError):
        trj.JaxOptimizer(sgd, sgd.init(src.params)).check_record(rec, src)


def test_scheduler_steps_and_records_its_count():
    s = trj.JaxLrScheduler(optax.linear_schedule(1.0, 0.0, 4))
    assert [s.step() for _ in range(3)] == [1.0, 0.75, 0.5]
    other = trj.JaxLrScheduler(optax.linear_schedule(1.0, 0.0, 4))
    other.load_record(s.into_record())
    assert other.count == 3 and other.step() == 0.25


def test_accumulator_over_jax_gradients():
    m = trj.JaxModule(params(0))
    acc = GradientsAccumulator()
    g = jax.grad(loss)(m.params, jnp.ones((2, 4)))
    acc.accumulate(m, trj.grads_from(g, m))
    acc.accumulate_with_dtype(m, trj.grads_from(g, m), trainrec.FloatDType.F32)
    rec = acc.try_to_record()
    assert rec.grads["out.1"].dtype is DType.F32  # bf16 parameter, f32 pending
    summed = trj.to_tree(acc.grads(), m)
    assert bool(jnp.allclose(summed["dense"]["kernel"], 2 * g["dense"]["kernel"]))
    fresh = GradientsAccumulator()
    fresh.load_record(rec, jax.devices("cpu")[0])  # a native device names the backend
    assert set(fresh.pending_ids()) == set(m.param_ids())


# -- FlaxMsgpackFileRecorder --------------------------------------------------------------


def _item():
    item = {d.value: TensorData.from_array((np.arange(6).reshape(2, 3) % 3).astype(d.numpy)) for d in DType}
    item["meta"] = {"n": [1, 2.5, "s", None, b"\x01"]}
    return item


@pytest.mark.parametrize("settings", [trainrec.FullPrecisionSettings(), NativePrecisionSettings(),
                                      trainrec.HalfPrecisionSettings()], ids=lambda s: s.name)
def test_flax_recorder_roundtrip(tmp_path, settings):
    r = trj.FlaxMsgpackFileRecorder(settings)
    path = r.save_item(_item(), tmp_path / "x.msgpack")
    back = r.load_item(path)
    for d in DType:
        assert back[d.value].dtype is d  # settings chose only the storage dtype
        assert np.array_equal(back[d.value].array.astype(np.float64), _item()[d.value].array.astype(np.float64))
    assert back["meta"] == _item()["meta"]


def test_flax_reads_ours_and_we_read_flax(tmp_path, monkeypatch):
    serialization = pytest.importorskip("flax.serialization")
    import trainrec.recorders.flaxmsgpack as mod  # the recorder lives in core; the adapter re-exports it

    monkeypatch.setattr(mod, "MAX_CHUNK_SIZE", 16)  # chunk every array above 16 bytes
    path = trj.FlaxMsgpackFileRecorder(NativePrecisionSettings()).save_item(_item(), tmp_path / "o.msgpack")
    theirs = serialization.msgpack_restore(path.read_bytes())
    assert theirs["format"] == "trainrec.flax"
    for d in DType:
        assert np.array_equal(np.asarray(theirs["item"][d.value]), _item()[d.value].array)
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 16)
    state = {"params": params(0), "step": 3}
    (tmp_path / "flax.msgpack").write_bytes(serialization.to_bytes(state))
    header, item = trj.FlaxMsgpackFileRecorder().read(tmp_path / "flax.msgpack")
    assert header.format == "flax.msgpack" and item["step"] == 3
    assert np.array_equal(item["params"]["dense"]["kernel"].array, np.asarray(state["params"]["dense"]["kernel"]))
    assert item["params"]["out"]["1"].dtype is DType.BF16


def test_flax_recorder_with_training_record(tmp_path):
    tx = optax.adam(1e-2)
    src = trj.JaxModule(params(0))
    opt = trj.JaxOptimizer(tx, tx.init(src.params))
    train(src, opt, 2)
    rec = TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Step(2, jax.random.PRNGKey(1)))
    r = trj.FlaxMsgpackFileRecorder(NativePrecisionSettings())
    rec.save(r, tmp_path / "c.msgpack")
    back = TrainingRecord.load(r, tmp_path / "c.msgpack", "cpu", state_type=Step)
    dst = trj.JaxModule(params(1))
    opt_dst = trj.JaxOptimizer(tx, tx.init(dst.params))
    back.restore(dst, opt_dst, None, "cpu")
    assert leaves_equal(dst.params, src.params) and leaves_equal(opt_dst.opt_state, opt.opt_state)


def test_flax_recorder_rejects_bad_files(tmp_path):
    import msgpack

    r = trj.FlaxMsgpackFileRecorder()
    path = r.save_item(_item(), tmp_path / "x.msgpack")
    data = path.read_bytes()
    for n in (0, 1, 10, len(data) // 2, len(data) - 1):
        (tmp_path / "t").write_bytes(data[:n])
        with pytest.raises(CorruptRecordError):
            r.load_item(tmp_path / "t")
    bad_ext = msgpack.packb({"a": msgpack.ExtType(1, msgpack.packb(([2**40, 2**40], "float32", b"")))})
    (tmp_path / "b").write_bytes(bad_ext)
    with pytest.raises(CorruptRecordError, match="needs"):
        r.load_item(tmp_path / "b")
    (tmp_path / "c").write_bytes(msgpack.packb({"a": msgpack.ExtType(1, msgpack.packb(([1], "object", b"x")))}))
    with pytest.raises(CorruptRecordError, match="dtype"):
        r.load_item(tmp_path / "c")
    (tmp_path / "d").write_bytes(b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(CorruptRecordError):
        r.load_item(tmp_path / "d")
    raw = bytearray(data)
    raw[raw.index(np.float32(1).tobytes())] ^= 1
    (tmp_path / "e").write_bytes(bytes(raw))
    with pytest.raises(trainrec.ChecksumError):
        r.load_item(tmp_path / "e")


@pytest.mark.parametrize("chunk", [2**30, 300_000])
def test_large_arrays_are_streamed_as_the_bytes_msgpack_gives(tmp_path, monkeypatch, chunk):
    """Arrays from 64 KiB on are written from their buffers; the file is byte-identical to
    the one `msgpack.packb` builds, and flax reads it."""
    serialization = pytest.importorskip("flax.serialization")
    import trainrec.recorders.flaxmsgpack as mod  # the recorder lives in core; the adapter re-exports it

    monkeypatch.setattr(mod, "MAX_CHUNK_SIZE", chunk)
    rng = np.random.default_rng(0)
    item = {"big": TensorData.from_array(rng.standard_normal((300, 257)).astype(np.float32)),
            "bf16": TensorData.from_array(rng.standard_normal(70_000).astype(ml_dtypes.bfloat16)),
            "edge": TensorData.from_array(np.arange(1 << 14, dtype=np.float32)),  # exactly 64 KiB
            "small": TensorData.from_array(np.arange(5, dtype=np.int32)), "step": 3}
    r = trj.FlaxMsgpackFileRecorder(NativePrecisionSettings())
    streamed = r.save_item(item, tmp_path / "s.msgpack").read_bytes()
    monkeypatch.setattr(mod, "_STREAM_BYTES", 1 << 62)
    packed = r.save_item(item, tmp_path / "p.msgpack").read_bytes()
    assert streamed == packed
    theirs = serialization.msgpack_restore(streamed)["item"]
    for k in ("big", "bf16", "edge", "small"):
        assert np.asarray(theirs[k]).tobytes() == item[k].array.tobytes()
    back = r.load_item(tmp_path / "s.msgpack")
    assert back["bf16"].dtype is DType.BF16 and back["big"].array.tobytes() == item["big"].array.tobytes()


def test_plain_flax_files_with_numpy_scalars_load_as_0d_tensors(tmp_path):
    """flax packs a numpy scalar as ext type 3 holding its 0-d array's (shape, dtype, bytes)."""
    serialization = pytest.importorskip("flax.serialization")
    import msgpack

    scalars = {d.value: np.dtype(ml_dtypes.bfloat16 if d is DType.BF16 else d.numpy).type(1) for d in DType}
    state = {"step": np.int32(7), "w": np.ones(2, np.float32),
             "opt": {"count": np.uint64(2**64 - 1), "scalars": scalars, "mask": np.bool_(True)}}
    data = serialization.msgpack_serialize(state)
    assert b"\xc7" in data or b"\xd7" in data  # ext records: flax itself wrote them
    (tmp_path / "plain.msgpack").write_bytes(data)
    header, item = trainrec.read_file(tmp_path / "plain.msgpack")
    theirs = serialization.msgpack_restore(data)
    assert header.format == "flax.msgpack"
    assert item["step"].dtype is DType.I32 and item["step"].shape == () and int(item["step"].read()) == 7
    assert item["opt"]["count"].dtype is DType.U64 and int(item["opt"]["count"].read()) == 2**64 - 1
    assert item["opt"]["mask"].dtype is DType.BOOL and bool(item["opt"]["mask"].read())
    for d in DType:
        got = item["opt"]["scalars"][d.value]
        assert got.dtype is d and got.shape == ()
        assert got.read().tobytes() == np.asarray(theirs["opt"]["scalars"][d.value]).tobytes()
    # an ext 3 payload that is not a 0-d array, or a dtype trainrec has no tensor of, is refused
    for bad, match in [(msgpack.ExtType(3, msgpack.packb(([2], "int32", b"\0" * 8))), "numpy scalar"),
                       (msgpack.ExtType(3, msgpack.packb(("int32", b"\0" * 4))), "numpy scalar"),
                       (msgpack.ExtType(3, msgpack.packb(([], "complex64", b"\0" * 8))), "dtype")]:
        (tmp_path / "bad.msgpack").write_bytes(msgpack.packb({"s": bad}))
        with pytest.raises(CorruptRecordError, match=match):
            trainrec.read_file(tmp_path / "bad.msgpack")
