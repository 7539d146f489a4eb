"""Sharded JAX arrays over 8 CPU devices (set XLA_FLAGS before running: the caller does).

`checks OUT`: capture and placement checks, each result (`"ok"` or what failed) in the
JSON file OUT. `reference CKPT AT OUT`: train a small sharded MLP with gradient
accumulation, save a checkpoint at micro-step AT (mid-window), go on to the end and
write the final parameters to OUT (`.npz`). `resume CKPT MESH OUT`: a fresh process
builds the model on MESH (`same`: the reference's 4x2 mesh, live arrays of another seed
as targets; `other`: 4 devices, another layout, abstract targets), restores, checks the
restored values and placements, trains on and writes OUT. Used by tests/test_jax_sharded.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import trainrec
import trainrec.adapters.jax as trj
from trainrec import (
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    TrainingRecord,
)

K = 4  # micro-steps per window
STEPS = 16  # micro-steps in all
BATCH, D_IN, D_H, D_OUT = 16, 8, 32, 4
TX = optax.adam(1e-2)
RECORDER = NamedMpkFileRecorder(NativePrecisionSettings())


@trainrec.record
class State:
    micro: int


def mesh_of(kind: str) -> Mesh:
    if kind == "same":
        return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    return Mesh(np.array(jax.devices()[4:]), ("data",))  # 4 other devices, one axis


def layout(kind: str) -> tuple[Any, Mesh]:
    """Each parameter's sharding on the mesh of `kind`."""
    mesh = mesh_of(kind)
    if kind == "same":
        specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    else:  # another mesh: w1 replicated, w2 sharded along its other axis (4 | D_OUT)
        specs = {"w1": P(), "b1": P("data"), "w2": P(None, "data"), "b2": P("data")}
    return {k: NamedSharding(mesh, s) for k, s in specs.items()}, mesh


def init(key: Any) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (D_IN, D_H)) * 0.3, "b1": jnp.zeros(D_H),
            "w2": jax.random.normal(k2, (D_H, D_OUT)) * 0.3, "b2": jnp.zeros(D_OUT)}


def opt_shardings(param_sh: dict[str, Any], mesh: Mesh) -> Any:
    adam, empty = TX.init(jax.eval_shape(init, jax.random.key(0)))
    return (adam._replace(count=NamedSharding(mesh, P()), mu=param_sh, nu=param_sh), empty)


def build(kind: str, seed: int) -> tuple[trj.JaxModule, trj.JaxOptimizer, Any, Mesh]:
    param_sh, mesh = layout(kind)
    params = jax.device_put(init(jax.random.key(seed)), param_sh)
    opt_state = jax.device_put(TX.init(params), opt_shardings(param_sh, mesh))
    return trj.JaxModule(params), trj.JaxOptimizer(TX, opt_state), param_sh, mesh


def batch(micro: int, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1000 + micro)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    sh = NamedSharding(mesh, P("data", None))
    return jax.device_put(x, sh), jax.device_put(y, sh)


def loss(p: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


grad_fn = jax.jit(jax.grad(loss))


def apply_window(model: trj.JaxModule, optimizer: trj.JaxOptimizer, acc: GradientsAccumulator[Any],
                 param_sh: Any, mesh: Mesh) -> None:
    grads = jax.tree.map(lambda g: g / K, trj.to_tree(acc.grads(), model))

    @jax.jit
    def update(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    out_sh = (param_sh, opt_shardings(param_sh, mesh))
    model.params, optimizer.opt_state = jax.device_put(update(model.params, optimizer.opt_state, grads), out_sh)


def train(model: trj.JaxModule, optimizer: trj.JaxOptimizer, acc: GradientsAccumulator[Any],
          state: State, param_sh: Any, mesh: Mesh, until: int) -> None:
    while state.micro < until:
        x, y = batch(state.micro, mesh)
        acc.accumulate(model, trj.grads_from(grad_fn(model.params, x, y), model))
        state.micro += 1
        if state.micro % K == 0:
            apply_window(model, optimizer, acc, param_sh, mesh)


def host(tree: Any) -> dict[str, np.ndarray[Any, Any]]:
    return {k: np.asarray(v) for k, v in trj.bindings.flatten(tree)[0].items()}


def reference(ckpt: str, at: int, out: str) -> None:
    model, optimizer, param_sh, mesh = build("same", 0)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    state = State(0)
    train(model, optimizer, acc, state, param_sh, mesh, at)
    assert acc.pending_ids(), "the checkpoint must be mid-window"
    TrainingRecord.capture(model, optimizer, None, acc, state).save(RECORDER, ckpt)
    np.savez(out + ".at.npz", **host(model.params), **{f"grad.{k}": np.asarray(v) for k, v in acc._pending.items()})
    train(model, optimizer, acc, state, param_sh, mesh, STEPS)
    np.savez(out, **host(model.params), **{f"opt.{k}": v for k, v in host(optimizer.opt_state).items()})


def resume(ckpt: str, kind: str, out: str) -> None:
    record = TrainingRecord.load(RECORDER, ckpt, state_type=State)
    if kind == "same":  # live arrays of another seed: the record's values must replace them
        model, optimizer, param_sh, mesh = build("same", 7)
        target_sh = {k: v.sharding for k, v in model.params.items()}
    else:  # abstract targets on another mesh, as `jax.eval_shape` gives them
        param_sh, mesh = layout("other")
        shapes = jax.eval_shape(init, jax.random.key(0))
        abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, param_sh)
        abstract_opt = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                    jax.eval_shape(TX.init, abstract), opt_shardings(param_sh, mesh))
        model, optimizer = trj.JaxModule(abstract), trj.JaxOptimizer(TX, abstract_opt)
        target_sh = param_sh
    r = record.restore(model, optimizer, None, None)
    assert r.model is model and r.optimizer is optimizer
    for k, v in model.params.items():
        assert isinstance(v, jax.Array), f"{k} is {type(v).__name__} after restore"
        assert v.sharding == target_sh[k], f"{k}: {v.sharding} after restore, target {target_sh[k]}"
    opt_sh = opt_shardings(param_sh, mesh)
    for leaf, sh in zip(jax.tree.leaves(optimizer.opt_state), jax.tree.leaves(opt_sh)):
        assert leaf.sharding == sh, f"optimizer leaf on {leaf.sharding}, target {sh}"
    pending = dict(r.accumulator._pending)  # placed on their parameters' shardings
    assert pending, "pending gradients were restored"
    for pid, g in pending.items():
        assert g.sharding == target_sh[pid], f"pending {pid} on {g.sharding}, parameter on {target_sh[pid]}"
    state = r.state
    np.savez(out + ".at.npz", **host(model.params), **{f"grad.{k}": np.asarray(v) for k, v in pending.items()})
    train(model, optimizer, r.accumulator, state, param_sh, mesh, STEPS)
    np.savez(out, **host(model.params), **{f"opt.{k}": v for k, v in host(optimizer.opt_state).items()})


# -- checks --------------------------------------------------------------------------------

class ValueSpy:
    """Records every request for an array's whole host value (`np.asarray(x)` of a
    multi-device array calls `ArrayImpl.__array__` and `_value`, where jax assembles the
    whole array on the host, every replica transferred; `jax.device_get`) and every
    device-to-host transfer started (`copy_to_host_async`). numpy reads a single-device
    CPU array through the buffer protocol, which no Python spy sees: the transfers are
    what tells which shards were copied."""

    def __init__(self) -> None:
        from jax._src.array import ArrayImpl
        self.cls = ArrayImpl
        self.saved = {n: ArrayImpl.__dict__[n] for n in ("__array__", "_value", "copy_to_host_async")}
        self.reads: list[Any] = []  # arrays whose whole value was asked for
        self.transfers: list[Any] = []  # arrays whose transfer to the host was started
        self.device_gets = 0

    def __enter__(self) -> ValueSpy:
        spy, saved = self, self.saved

        def array(arr: Any, *a: Any, **k: Any) -> Any:
            spy.reads.append(arr)
            return saved["__array__"](arr, *a, **k)

        def value(arr: Any) -> Any:
            spy.reads.append(arr)
            return saved["_value"].fget(arr)

        def transfer(arr: Any) -> Any:
            spy.transfers.append(arr)
            return saved["copy_to_host_async"](arr)

        self.cls.__array__, self.cls._value = array, property(value)  # type: ignore[method-assign,assignment]
        self.cls.copy_to_host_async = transfer  # type: ignore[method-assign]
        self.get, jax.device_get = jax.device_get, self._device_get  # type: ignore[assignment]
        return self

    def _device_get(self, x: Any) -> Any:
        self.device_gets += 1
        return self.get(x)

    def __exit__(self, *exc: Any) -> None:
        for name, attr in self.saved.items():
            setattr(self.cls, name, attr)
        jax.device_get = self.get  # type: ignore[assignment]


def check_capture_copies_each_shard_once() -> None:
    mesh = mesh_of("same")
    x = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("data", None)))
    assert len(x.sharding.device_set) == 8 and not x.is_fully_replicated
    distinct = [s.data for s in x.addressable_shards if s.replica_id == 0]
    replicas = [s.data for s in x.addressable_shards if s.replica_id != 0]
    assert len(distinct) == 4 and len(replicas) == 4  # P("data") on a 4x2 mesh: each block twice
    with ValueSpy() as spy:
        out = trj.JaxBackend().to_host(x)
    assert np.array_equal(out, np.arange(8 * 6, dtype=np.float32).reshape(8, 6)) and out.flags.c_contiguous
    assert not any(r is x for r in spy.reads), "the whole array's value was asked for"
    assert spy.device_gets == 0, "jax.device_get was called"
    assert not any(t is x for t in spy.transfers), "the whole array was transferred"
    assert all(sum(t is d for t in spy.transfers) == 1 for d in distinct), "a distinct shard not transferred once"
    assert not any(t is d for t in spy.transfers for d in replicas), "a replica was transferred"
    assert x._npy_value is None, "a host copy of the whole array is left cached on the live array"
    # the spy sees what it should: jax's own host copy asks for the whole value
    with ValueSpy() as spy:
        np.asarray(x)
    assert any(r is x for r in spy.reads)


def check_training_record_capture_reads_only_shards() -> None:
    model, optimizer, param_sh, mesh = build("same", 0)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    x, y = batch(0, mesh)
    acc.accumulate(model, trj.grads_from(grad_fn(model.params, x, y), model))
    live = [v for v in jax.tree.leaves((model.params, optimizer.opt_state, acc._pending)) if len(v.sharding.device_set) > 1]
    assert len(live) >= 12
    with ValueSpy() as spy:
        rec = TrainingRecord.capture(model, optimizer, None, acc, State(1))
        rec_async = asyncio.run(TrainingRecord.capture_async(model, optimizer, None, acc, State(1)))
    assert not any(r is v for r in spy.reads for v in live), "a sharded array's whole value was read"
    assert not any(t is v for t in spy.transfers for v in live), "a sharded array was transferred whole"
    assert spy.device_gets == 0
    for k, v in acc._pending.items():
        assert np.array_equal(rec_async.grads.grads[k].array, np.asarray(v)), k
    for k, v in model.params.items():
        assert np.array_equal(rec.model.item[k].array, np.asarray(v)), k  # type: ignore[index]
        assert np.array_equal(rec.grads.grads[k].array, np.asarray(acc._pending[k])), k


def check_restore_onto_live_and_other_meshes() -> None:
    src_mesh = mesh_of("same")
    values = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    sources = {"sharded": NamedSharding(src_mesh, P("data", "model")), "replicated": NamedSharding(src_mesh, P())}
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("x",))
    targets = {"sharded4": NamedSharding(mesh4, P("x")), "replicated4": NamedSharding(mesh4, P()),
               "sharded8": NamedSharding(src_mesh, P("model", "data")), "replicated8": NamedSharding(src_mesh, P())}
    for sname, ssh in sources.items():
        rec = trj.JaxModule({"w": jax.device_put(values, ssh)}).into_record()
        for tname, tsh in targets.items():
            live = trj.JaxModule({"w": jax.device_put(np.zeros_like(values), tsh)})
            live.load_record(rec, None)
            w = live.params["w"]
            assert w.sharding == tsh and np.array_equal(np.asarray(w), values), f"{sname} -> live {tname}"
            abstract = trj.JaxModule({"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=tsh)})
            abstract.load_record(rec, None)
            w = abstract.params["w"]
            assert w.sharding == tsh and np.array_equal(np.asarray(w), values), f"{sname} -> abstract {tname}"
            tree = trj.restore_tree(rec, {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=tsh)})
            assert tree["w"].sharding == tsh and np.array_equal(np.asarray(tree["w"]), values)


def check_an_abstract_leaf_without_sharding_goes_to_the_device_given() -> None:
    from flax import nnx

    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    rec = trj.JaxModule({"w": jax.device_put(values, NamedSharding(mesh_of("same"), P()))}).into_record()
    for device in (jax.devices()[3], "cpu:5"):
        target = trj.JaxModule({"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)})
        target.load_record(rec, device)
        want = device if isinstance(device, jax.Device) else jax.devices()[5]
        assert target.params["w"].devices() == {want} and np.array_equal(np.asarray(target.params["w"]), values)
    linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    trj.NnxModule(abstract).load_record(trj.NnxModule(linear).into_record(), "cpu:6")
    assert abstract.kernel[...].devices() == {jax.devices()[6]}
    assert np.array_equal(np.asarray(abstract.kernel[...]), np.asarray(linear.kernel[...]))


def check_pending_gradients_follow_parameter_shardings() -> None:
    model, optimizer, param_sh, mesh = build("same", 0)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    x, y = batch(0, mesh)
    acc.accumulate(model, trj.grads_from(grad_fn(model.params, x, y), model))
    rec = TrainingRecord.capture(model, optimizer, None, acc, State(1))
    other_sh, other_mesh = layout("other")
    target, _, _, _ = build("other", 3)
    r = rec.restore(target, trj.JaxOptimizer(TX, jax.device_put(TX.init(target.params), opt_shardings(other_sh, other_mesh))),
                    None, None)
    for pid, g in r.accumulator._pending.items():
        assert g.sharding == other_sh[pid], f"{pid}: {g.sharding}"
        assert np.array_equal(np.asarray(g), np.asarray(acc._pending[pid])), pid
    tree = trj.restore_tree(rec.grads, None, module=trj.JaxModule(jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), target.params)))
    for pid, g in tree.items():
        assert g.sharding == other_sh[pid] and np.array_equal(np.asarray(g), np.asarray(acc._pending[pid])), pid


def check_sharded_typed_keys_round_trip() -> None:
    mesh = mesh_of("same")
    keys = jax.random.split(jax.random.key(5), 8)
    sh = NamedSharding(mesh, P("data"))
    tree = {"keys": jax.device_put(keys, sh)}
    rec = trj.JaxModule(tree).into_record()
    target = trj.JaxModule({"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, P()))})
    target.load_record(rec, None)
    got = target.params["keys"]
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P()), got.ndim), got.sharding
    assert np.array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(keys)))


@trainrec.record
class Step:
    micro: int


def check_not_fully_addressable_is_captured_as_shards_only_orbax_saves() -> None:
    """An array spanning other processes is captured as a ShardedTensor (this process's
    shards, global shape, sharding); every recorder but OrbaxRecorder and every consumer
    of its values refuses it, naming OrbaxRecorder."""
    import os
    import tempfile

    from jax._src.array import ArrayImpl

    from trainrec.format.envelope import crc_of
    from trainrec.items.tree import compare_items
    from trainrec.recorders.formats import known_formats

    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh_of("same"), P("data")))
    original = ArrayImpl.is_fully_addressable
    from flax import nnx

    linear = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    linear.kernel.set_value(x)
    acc: GradientsAccumulator[Any] = GradientsAccumulator()
    module = trj.JaxModule({"w": x})
    acc.accumulate(module, trainrec.GradientsParams({"w": x}))
    # as arrays spanning several JAX processes are: this process holds only its shards
    ArrayImpl.is_fully_addressable = property(lambda self: False)  # type: ignore[assignment,method-assign]
    try:
        captures = {"JaxModule": lambda: module.into_record().item["w"],
                    "NnxModule": lambda: trj.NnxModule(linear).into_record().item["kernel"],
                    "pending gradients": lambda: acc.try_to_record().grads["w"],
                    "pending gradients (async)": lambda: asyncio.run(acc.to_record_async()).grads["w"]}
        got = {what: capture() for what, capture in captures.items()}
        record = TrainingRecord.capture(module, trj.JaxOptimizer(optax.sgd(0.1), optax.sgd(0.1).init({"w": x})),
                                        None, acc, Step(3))
    finally:
        ArrayImpl.is_fully_addressable = original  # type: ignore[method-assign]
    want = sorted({tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in zip(i, x.shape))
                   for i in x.sharding.devices_indices_map(x.shape).values()})
    assert len(want) > 1, want
    for what, t in got.items():
        assert isinstance(t, trainrec.ShardedTensor), (what, t)
        assert t.shape == (8, 2) and t.dtype is trainrec.DType.F32 and t.layout == x.sharding, (what, t)
        assert sorted(t.shards) == want, (what, sorted(t.shards))
        assert all(np.array_equal(p.array, np.asarray(x)[i0:i1, j0:j1])
                   for ((i0, i1), (j0, j1)), p in t.shards.items()), what

    def refuses(what: str, fn: Any, because: tuple[str, ...] = ("OrbaxRecorder", "sharded across processes")) -> None:
        try:
            fn()
        except trainrec.RecorderError as e:
            assert all(b in str(e) for b in because), f"{what}: {e}"
        else:
            raise AssertionError(f"{what}: no RecorderError")

    t = got["JaxModule"]
    for what, fn in {"array": lambda: t.array, "read": t.read, "take": t.take, "to_bytes": t.to_bytes,
                     "cast": lambda: t.cast(trainrec.DType.F16).array,
                     "compare_items": lambda: compare_items({"w": t}, {"w": t}),
                     "crc": lambda: crc_of(t)}.items():
        refuses(what, fn)
    item = record.into_item(trainrec.NativePrecisionSettings())
    writers = [f for f in known_formats() if not f.marker]  # every file format (Orbax: a directory)
    assert len(writers) >= 4, [f.name for f in writers]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in writers:
            try:
                recorder = fmt.new_recorder(trainrec.NativePrecisionSettings())
            except trainrec.RecorderError:
                continue  # its framework is not installed here
            path = os.path.join(tmp, "ckpt" + (fmt.extensions or (".bin",))[0])  # burn.bin claims none
            # Burn's files hold only Burn's own form: a JAX record is refused before its arrays are read
            because = ("Burn",) if fmt.name.startswith("burn.") else ("OrbaxRecorder", "sharded across processes")
            refuses(f"{fmt.name} save", lambda r=recorder, p=path: record.save(r, p), because)
            refuses(f"{fmt.name} save_item", lambda r=recorder, p=path: r.save_item(item, p), because)
            assert not os.path.exists(path), fmt.name
    # restoring the shards builds the array on its sharding again
    back = trj.JaxModule({"w": jax.device_put(np.zeros((8, 2), np.float32), x.sharding)})
    back.load_record(record.model, None)
    assert back.params["w"].sharding == x.sharding and np.array_equal(np.asarray(back.params["w"]), np.asarray(x))


def check_orbax_saves_shards_and_checks_each_shard() -> None:
    """A record holding ShardedTensors (arrays captured as spanning other processes)
    saved by OrbaxRecorder in one process: read whole (every shard's CRC checked) or into
    a layout, equal to the array; a shards table edited in the file is refused."""
    import json
    import os
    import tempfile

    from jax._src.array import ArrayImpl

    from trainrec.adapters.jax.orbax_recorder import _doc_crc, shardings_of

    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh_of("same"), P("data")))
    module = trj.JaxModule({"w": x})
    original = ArrayImpl.is_fully_addressable
    ArrayImpl.is_fully_addressable = property(lambda self: False)  # type: ignore[assignment,method-assign]
    try:
        record = module.into_record()
    finally:
        ArrayImpl.is_fully_addressable = original  # type: ignore[method-assign]
    assert isinstance(record.item["w"], trainrec.ShardedTensor)
    native = trainrec.NativePrecisionSettings()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.orbax")
        trj.OrbaxRecorder(native).save_item(record.item, path)
        doc = json.loads(open(os.path.join(path, "trainrec", "metadata")).read())
        assert doc["version"] == [1, 1] and sorted(doc["shards"]["0"]) == ["0:2,0:2", "2:4,0:2", "4:6,0:2", "6:8,0:2"], doc
        for recorder in (trj.OrbaxRecorder(native), trj.OrbaxRecorder(native, sharding=shardings_of(record.item))):
            back = recorder.read(path)[1]["w"]
            assert type(back) is trainrec.TensorData and np.array_equal(back.array, np.asarray(x)), recorder
        live = trj.JaxModule({"w": jax.device_put(np.zeros((8, 2), np.float32), x.sharding)})
        live.load_record(trainrec.StateRecord(record.kind, trj.OrbaxRecorder(native).read(path)[1]), None)
        assert np.array_equal(np.asarray(live.params["w"]), np.asarray(x))
        marker = os.path.join(path, "trainrec", "metadata")
        good = open(marker).read()
        edits = {"a shard missing": lambda d: d["shards"]["0"].pop("6:8,0:2"),
                 "a shard outside": lambda d: d["shards"]["0"].update({"6:9,0:2": d["shards"]["0"].pop("6:8,0:2")}),
                 "a shard CRC": lambda d: d["shards"]["0"].update({"0:2,0:2": d["shards"]["0"]["0:2,0:2"] ^ 1}),
                 "a bad CRC type": lambda d: d["shards"]["0"].update({"0:2,0:2": "0"}),
                 "a tensor index": lambda d: d["shards"].update({"7": d["shards"].pop("0")}),
                 "the table's type": lambda d: d.update({"shards": []})}
        for what, edit in edits.items():
            doc = json.loads(good)
            edit(doc)
            doc["crc"] = _doc_crc(doc)
            with open(marker, "w") as f:
                json.dump(doc, f)
            try:
                trj.OrbaxRecorder(native).read(path)
            except trainrec.CorruptRecordError as e:
                want = "checksum mismatch" if what == "a shard CRC" else "shard"
                assert want in str(e), (what, e)
            else:
                raise AssertionError(f"{what}: loaded")
        with open(marker, "w") as f:
            f.write(good)
        assert trj.OrbaxRecorder(native).read(path)[1]["w"].bitwise_equal(
            trainrec.TensorData.from_array(np.asarray(x)))


def check_an_uncommitted_live_leaf_stays_uncommitted() -> None:
    """optax's step count is made uncommitted (jnp.zeros): restored committed to one
    device, a jitted step mixing it with arrays on a mesh fails; it must stay free."""
    sh = NamedSharding(mesh_of("same"), P("data"))
    params = {"w": jax.device_put(np.ones((8, 2), np.float32), sh)}
    tx = optax.adam(0.1)
    opt = trj.JaxOptimizer(tx, tx.init(params))
    module = trj.JaxModule(params)
    assert not opt.opt_state[0].count.committed
    record = opt.into_record(module)
    fresh = trj.JaxOptimizer(tx, tx.init(params))
    fresh.load_record(record, module, None)
    count = fresh.opt_state[0].count
    assert not count.committed and int(count) == 0, count.sharding
    assert fresh.opt_state[0].mu["w"].sharding == sh
    step = jax.jit(lambda g, st, p: tx.update(g, st, p))
    step(params, fresh.opt_state, params)  # mixed devices fail here with a committed count


def checks(out: str) -> None:
    assert len(jax.devices()) == 8, f"{len(jax.devices())} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    results = {}
    for name, fn in list(globals().items()):
        if name.startswith("check_"):
            try:
                fn()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "checks":
        checks(args[0])
    elif mode == "reference":
        reference(args[0], int(args[1]), args[2])
    elif mode == "resume":
        resume(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")
