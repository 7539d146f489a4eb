"""Processes of `test_orbax_recorder.py` that need a JAX of their own (several CPU devices,
or `jax.distributed`): `python orbax_run.py ROLE DIR [PROCESS_ID PORT]`.

- `sharded-save`: 8 devices; a linen MLP whose parameters are sharded over a mesh of 8
  (`NamedSharding`), optax adamw, trained mid-window; saves a `TrainingRecord` with
  `OrbaxRecorder(sharding=...)` (each device's shard written by Orbax), then trains on
  and saves the final parameters as the reference;
- `sharded-resume`: a fresh process with 8 devices: loads the checkpoint, restores onto
  its live shardings and trains to the end, which must match bitwise (on the same mesh:
  another partitioning sums the sharded matmuls in another order); and restores the same
  record onto a mesh of 4 of the devices, checking placement and values;
- `multiprocess`: one of two JAX processes (2 CPU devices each, a global mesh of 4)
  saving one checkpoint together and loading it back.
Each prints one JSON line of facts the test checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _shared_runs import xla_flags  # next to this script

ROLE, WORK = sys.argv[1], sys.argv[2]
DEVICES = {"sharded-save": 8, "sharded-resume": 8, "multiprocess": 2}[ROLE]
os.environ["XLA_FLAGS"] = xla_flags(f"--xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402

if ROLE == "multiprocess":
    PID, PORT = int(sys.argv[3]), int(sys.argv[4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2,
                               process_id=PID, initialization_timeout=30)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainrec  # noqa: E402
from trainrec import GradientsAccumulator, NativePrecisionSettings, TrainingRecord  # noqa: E402
from trainrec.adapters.jax import JaxModule, JaxOptimizer, OrbaxRecorder, grads_from, to_tree  # noqa: E402
from trainrec.items.tree import compare_items, iter_tensors  # noqa: E402

NATIVE = NativePrecisionSettings()
WINDOW, STOP, END = 4, 6, 12


@trainrec.record
class State:
    micro: int
    key: np.ndarray


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("d",))


def shard_rule(m: Mesh):
    """Shard a tensor's first axis over the mesh where it divides, else replicate."""
    n = m.devices.size

    def rule(key: str, shape: tuple[int, ...]):
        spec = P("d") if shape and shape[0] % n == 0 else P()
        return NamedSharding(m, spec)

    return rule


def place(tree, m: Mesh):
    rule = shard_rule(m)
    return jax.tree.map(lambda a: jax.device_put(a, rule("", a.shape)), tree)


def build(m: Mesh):
    key = jax.random.PRNGKey(0)
    k1, k2, key = jax.random.split(key, 3)
    params = {"w1": jax.random.normal(k1, (16, 32)), "b1": jnp.zeros((32,)),
              "w2": jax.random.normal(k2, (32, 4)), "b2": jnp.zeros((4,))}
    params = place(params, m)
    tx = optax.adamw(1e-2)
    # every leaf committed to the mesh (the step count replicated): a restore places each
    # as the live one is placed, and a jitted step needs them all on the same devices
    return JaxModule(params), JaxOptimizer(tx, place(tx.init(params), m)), State(0, np.asarray(key))


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


GRAD = jax.jit(jax.grad(loss))


def step(model, opt, acc, state):
    key, sub = jax.random.split(jnp.asarray(state.key))
    x = jax.random.normal(sub, (8, 16))
    acc.accumulate(model, grads_from(GRAD(model.params, x, jnp.sin(x[:, :4])), model))
    state.key, state.micro = np.asarray(key), state.micro + 1
    if state.micro % WINDOW == 0:
        grads = to_tree(acc.grads(), model)
        updates, opt.opt_state = opt.tx.update(grads, opt.opt_state, model.params)
        model.params = optax.apply_updates(model.params, updates)


def train(model, opt, acc, state, until):
    while state.micro < until:
        step(model, opt, acc, state)


def final_item(model) -> trainrec.Item:
    return {k: trainrec.TensorData.from_array(np.asarray(v)) for k, v in model.params.items()}


def sharded_save() -> dict:
    m = mesh()
    model, opt, state = build(m)
    acc = GradientsAccumulator()
    train(model, opt, acc, state, STOP)
    record = TrainingRecord.capture(model, opt, None, acc, state)
    recorder = OrbaxRecorder(NATIVE, sharding=shard_rule(m))
    path = record.save(recorder, os.path.join(WORK, "ckpt.orbax"))
    train(model, opt, acc, state, END)
    trainrec.NamedMpkFileRecorder(NATIVE).save_item(final_item(model), os.path.join(WORK, "ref.mpk"))
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointHandler().metadata(path / "arrays").tree
    chunks = {k: [list(v.shape), list(v.storage.chunk_shape)] for k, v in meta.items()}
    back = TrainingRecord.load(recorder, path, state_type=State)
    same, _, where = compare_items(back.into_item(NATIVE), record.into_item(NATIVE))
    return {"chunks": chunks, "same": same, "where": where[:5],
            "keys": [k for k, _ in iter_tensors(record.into_item(NATIVE))]}


def sharded_resume() -> dict:
    small = Mesh(np.array(jax.devices()[:4]), ("d",))
    record = TrainingRecord.load(OrbaxRecorder(), os.path.join(WORK, "ckpt.orbax"), state_type=State)
    model, opt, _ = build(small)
    record.restore(model, opt, None, None)
    small_ok = all(v.sharding.mesh == small and {d.id for d in v.devices()} <= {0, 1, 2, 3}
                   for v in model.params.values())
    small_same = compare_items(final_item(model), dict(record.model.item))[0]
    m = mesh()
    model, opt, state = build(m)
    live = {k: v.sharding for k, v in model.params.items()}
    record = TrainingRecord.load(OrbaxRecorder(), os.path.join(WORK, "ckpt.orbax"), state_type=State)
    restored = record.restore(model, opt, None, None)
    placed = all(model.params[k].sharding == s for k, s in live.items())
    mu = restored.optimizer.opt_state[0].mu
    placed_opt = all(mu[k].sharding == live[k] for k in live)
    # the pending gradients come back on one device (the accumulator's restore on main
    # does not know the parameters' shardings yet): laid out as the parameters, by hand
    pending = restored.accumulator.grads()
    acc = GradientsAccumulator()
    acc.adopt(model, trainrec.GradientsParams({k: jax.device_put(v, live[k]) for k, v in pending.items()}))
    train(model, opt, acc, restored.state, END)
    ref = trainrec.NamedMpkFileRecorder().read(os.path.join(WORK, "ref.mpk"))[1]
    same, diff, where = compare_items(final_item(model), ref)
    return {"small_ok": small_ok, "small_same": small_same,
            "placed": placed, "placed_opt": placed_opt, "same": same, "diff": diff,
            "where": where[:5], "devices": len(jax.devices())}


def multiprocess() -> dict:
    """Both processes hold the same host values (built from one seed); the record is
    captured from process-local arrays and laid out over the global mesh by the
    recorder, so each process writes the shards it holds."""
    m = mesh()  # the 4 devices of both processes
    key = jax.random.PRNGKey(1)
    params = {"w": np.asarray(jax.random.normal(key, (8, 6))),
              "b": np.arange(6, dtype=np.float32)}
    local = {k: jax.device_put(v, jax.local_devices()[0]) for k, v in params.items()}
    tx = optax.sgd(0.1)
    model, opt = JaxModule(local), JaxOptimizer(tx, tx.init(local))
    acc = GradientsAccumulator()
    acc.accumulate(model, grads_from({k: v * 0.5 for k, v in local.items()}, model))
    record = TrainingRecord.capture(model, opt, None, acc, State(3, np.arange(2, dtype=np.uint32)))
    path = os.path.join(WORK, "mp.orbax")
    recorder = OrbaxRecorder(NATIVE, sharding=shard_rule(m))
    record.save(recorder, path)
    arrays_dir = Path(path) / "arrays"
    written = {p.name: len(list((p / "d").iterdir())) for p in sorted(arrays_dir.glob("ocdbt.process_*"))}
    back = TrainingRecord.load(recorder, path, state_type=State)
    same, _, where = compare_items(back.into_item(NATIVE), record.into_item(NATIVE))
    # the arrays are a plain Orbax item: read back onto the global mesh, each process
    # reading only the shards its devices hold
    import orbax.checkpoint as ocp

    rule = shard_rule(m)
    table = json.loads((Path(path) / "trainrec" / "metadata").read_text())["tensors"]
    model_rows = {row[0].rpartition(".")[2]: row[3] for row in table if row[0].startswith("0.")}
    args: dict = {row[3]: ocp.RestoreArgs(restore_type=np.ndarray) for row in table if row[3]}
    args.update({name: ocp.ArrayRestoreArgs(sharding=rule("", params[k].shape))
                 for k, name in model_rows.items()})
    with ocp.PyTreeCheckpointer() as reader:
        got = reader.restore(Path(path) / "arrays", args=ocp.args.PyTreeRestore(restore_args=args))
    shards_ok = all(
        np.array_equal(np.asarray(s.data), params[k][s.index])
        for k, name in model_rows.items() for s in got[name].addressable_shards)
    placed = all(not got[name].is_fully_addressable for name in model_rows.values())
    # a second save over the first, together: the exchange is process 0's alone
    record.save(recorder, path)
    again = TrainingRecord.load(recorder, path, state_type=State)
    same_again = compare_items(again.into_item(NATIVE), record.into_item(NATIVE))[0]
    return {"process": jax.process_index(), "count": jax.process_count(), "written": written,
            "same": same, "where": where[:5], "shards_ok": shards_ok, "placed": placed,
            "same_again": same_again, "leftovers": sorted(os.listdir(WORK))}


if __name__ == "__main__":
    out = {"sharded-save": sharded_save, "sharded-resume": sharded_resume,
           "multiprocess": multiprocess}[ROLE]()
    print(json.dumps(out), flush=True)
