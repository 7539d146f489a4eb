"""One of two JAX processes for `test_orbax_multiprocess.py`:
`python orbax_mp_run.py ROLE DIR PROCESS_ID PORT` (2 CPU devices each; one global mesh of
the 4 devices of both processes).

A small MLP whose parameters, adamw moments and pending gradients are all sharded ACROSS
the two processes (no process holds any of them whole), trained with gradient
accumulation under jit (a jitted gradient, `GradientsAccumulator.accumulate`, a jitted
optimizer update every WINDOW micro-steps):

- `reference`: trains to STOP (mid-window: two gradients pending), captures a
  `TrainingRecord` (each sharded array as this process's shards) and saves it with
  `OrbaxRecorder` (each process writing its shards), then trains on to END and keeps its
  addressable shards of the final parameters and moments (`ref.PID.npz`);
- `resume`: two FRESH processes build the model, load the checkpoint reading only their
  own shards (`OrbaxRecorder(sharding=shardings_of(live record))`), restore (params,
  moments, the uncommitted step count, the pending gradients on the parameters'
  shardings) and train to END; their addressable shards must equal the reference's
  bitwise. Then a shard's bytes are changed on disk (process 0, between barriers) and the
  load must fail with a checksum error naming the shard.
Each prints one JSON line of facts the test checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _shared_runs import xla_flags  # next to this script

ROLE, WORK, PID, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.environ["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=2")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2,
                           process_id=PID, initialization_timeout=30)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainrec  # noqa: E402
from trainrec import GradientsAccumulator, NativePrecisionSettings, TrainingRecord  # noqa: E402
from trainrec.adapters.jax import JaxModule, JaxOptimizer, OrbaxRecorder, grads_from, to_tree  # noqa: E402
from trainrec.adapters.jax.orbax_recorder import shardings_of  # noqa: E402
from trainrec.items.tree import iter_tensors  # noqa: E402

NATIVE = NativePrecisionSettings()
WINDOW, STOP, END = 4, 6, 11
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))  # both processes' devices
SPECS = {"w1": P("a", "b"), "b1": P("b"), "w2": P("a", None), "b2": P()}
REPLICATED = NamedSharding(MESH, P())


@trainrec.record
class State:
    micro: int
    key: np.ndarray


def build() -> tuple[JaxModule, JaxOptimizer, State]:
    k1, k2, key = jax.random.split(jax.random.PRNGKey(0), 3)
    host = {"w1": np.asarray(jax.random.normal(k1, (8, 16))), "b1": np.zeros(16, np.float32),
            "w2": np.asarray(jax.random.normal(k2, (16, 4))), "b2": np.zeros(4, np.float32)}
    params = {k: jax.device_put(v, NamedSharding(MESH, SPECS[k])) for k, v in host.items()}
    tx = optax.adamw(1e-2)
    # the moments follow the parameters' shardings; the step count is optax's own
    # (uncommitted, one device): a restore must keep it so for the jitted update
    return JaxModule(params), JaxOptimizer(tx, tx.init(params)), State(0, np.asarray(key))


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


GRAD = jax.jit(jax.grad(loss))


def _update(tx):
    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update)


def step(model, opt, acc, state, update) -> None:
    key, sub = jax.random.split(jnp.asarray(state.key))
    x = np.asarray(jax.random.normal(sub, (8, 8)))  # the same batch in both processes
    xs = jax.device_put(x, REPLICATED)
    ys = jax.device_put(np.sin(x[:, :4]), REPLICATED)
    acc.accumulate(model, grads_from(GRAD(model.params, xs, ys), model))
    state.key, state.micro = np.asarray(key), state.micro + 1
    if state.micro % WINDOW == 0:
        model.params, opt.opt_state = update(to_tree(acc.grads(), model), opt.opt_state, model.params)


def train(model, opt, acc, state, until) -> None:
    update = _update(opt.tx)
    while state.micro < until:
        step(model, opt, acc, state, update)


def shards(model, opt) -> dict[str, np.ndarray]:
    """This process's addressable shards of the parameters and adamw moments."""
    trees = {"p": model.params, "mu": opt.opt_state[0].mu, "nu": opt.opt_state[0].nu}
    out = {}
    for t, tree in trees.items():
        for k, v in tree.items():
            for s in v.addressable_shards:
                out[f"{t}.{k}.{s.device.id}"] = np.asarray(s.data)
    return out


def spans_processes(tree) -> bool:
    return all(not v.is_fully_addressable for v in tree.values())


def reference() -> dict:
    model, opt, state = build()
    acc = GradientsAccumulator()
    train(model, opt, acc, state, STOP)
    pending = acc._pending  # noqa: SLF001
    record = TrainingRecord.capture(model, opt, None, acc, state)
    kinds = sorted({type(t).__name__ for _, t in iter_tensors(record.into_item(NATIVE))})
    path = Path(WORK) / "ckpt.orbax"
    record.save(OrbaxRecorder(NATIVE), path)
    train(model, opt, acc, state, END)
    np.savez(Path(WORK) / f"ref.{PID}.npz", **shards(model, opt))
    written = sorted(p.name for p in (path / "arrays").glob("ocdbt.process_*"))
    return {"process": jax.process_index(), "count": jax.process_count(), "kinds": kinds,
            "sharded": spans_processes(model.params) and spans_processes(opt.opt_state[0].mu),
            "pending_sharded": len(pending) == 4 and spans_processes(pending), "written": written}


def resume() -> dict:
    model, opt, state = build()
    # the live layout, pending gradients included (one zero gradient per parameter)
    probe = GradientsAccumulator()
    probe.accumulate(model, grads_from(jax.tree.map(jnp.zeros_like, model.params), model))
    rule = shardings_of(TrainingRecord.capture(model, opt, None, probe, state))
    path = Path(WORK) / "ckpt.orbax"
    record = TrainingRecord.load(OrbaxRecorder(NATIVE, sharding=rule), path, state_type=State)
    loaded = {k: type(t).__name__ for k, t in iter_tensors(record.into_item(NATIVE))}
    live = {k: v.sharding for k, v in model.params.items()}
    restored = record.restore(model, opt, None, None)
    acc, state = restored.accumulator, restored.state
    pending = acc.try_to_record().grads
    pending_placed = all(acc._pending[k].sharding.is_equivalent_to(live[k], acc._pending[k].ndim)  # noqa: SLF001
                         for k in live)
    count = opt.opt_state[0].count
    facts = {"placed": all(model.params[k].sharding == s for k, s in live.items()),
             "mu_placed": all(opt.opt_state[0].mu[k].sharding == s for k, s in live.items()),
             "count_uncommitted": not count.committed, "pending": sorted(pending),
             "pending_placed": pending_placed, "micro": state.micro}
    train(model, opt, acc, state, END)
    ref = np.load(Path(WORK) / f"ref.{PID}.npz")
    got = shards(model, opt)
    differ = sorted(k for k in ref.files if k not in got or got[k].tobytes() != ref[k].tobytes())
    facts.update({"same": not differ and set(ref.files) == set(got), "differ": differ[:5],
                  "compared": len(got), "loaded": loaded})
    facts["corrupt"] = corrupt_a_shard(path, rule)
    return {"process": jax.process_index(), "count": jax.process_count(), **facts}


def corrupt_a_shard(path: Path, rule) -> list[str]:
    """Process 0 rewrites the arrays item with one element of the first parameter changed
    (Orbax's own metadata stays consistent: only trainrec's shard CRCs can tell); then
    both processes load it, each reading its own shards (both must refuse: process 1's
    shards are intact), then each reading every array whole."""

    meta = json.loads((path / "trainrec" / "metadata").read_text())
    name = next(row[3] for row in meta["tensors"] if row[0].endswith("w1") and row[0].startswith("0."))
    if jax.process_index() == 0:  # in a process of its own: Orbax's barriers are for all
        import shutil
        import subprocess

        arrays, fresh = path / "arrays", path.parent / "rewritten"
        names = [row[3] for row in meta["tensors"] if row[3]]
        subprocess.run([sys.executable, "-c", REWRITE, str(arrays), str(fresh), name, *names],
                       check=True, timeout=60, env={**os.environ, "XLA_FLAGS": ""})
        shutil.rmtree(arrays)
        shutil.move(str(fresh), str(arrays))
    multihost_utils.sync_global_devices("corrupted")
    said = []
    for recorder in (OrbaxRecorder(NATIVE, sharding=rule), OrbaxRecorder(NATIVE)):  # shards, whole
        try:
            TrainingRecord.load(recorder, path, state_type=State)
        except trainrec.ChecksumError as e:
            said.append(str(e))
        except trainrec.RecorderError as e:
            said.append("other: " + str(e))
        else:
            said.append("loaded")
    return said


REWRITE = """
import sys, numpy as np, orbax.checkpoint as ocp
src, dst, name, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with ocp.PyTreeCheckpointer() as c:
    tree = c.restore(src, args=ocp.args.PyTreeRestore(
        restore_args={n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}))
    tree = {k: np.array(v) for k, v in tree.items()}
    tree[name][0, 0] += 1.0
    c.save(dst, args=ocp.args.PyTreeSave(tree))
"""


if __name__ == "__main__":
    out = {"reference": reference, "resume": resume}[ROLE]()
    print(json.dumps(out), flush=True)
