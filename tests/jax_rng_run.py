"""A jitted dropout training step whose keys live in the caller state (`JaxRngRecord`):
`reference OUT`, `checkpoint CKPT AT` (train to AT, save) and `resume CKPT OUT` (a fresh
process: build, restore, train on). OUT gets the final parameters and keys as `.npz`.
Used by tests/test_jax_rng.py."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import trainrec
import trainrec.adapters.jax as trj
from trainrec import DefaultRecorder, GradientsAccumulator, TrainingRecord

STEPS = 10


@trainrec.record
class State:
    step: int
    rng: trj.JaxRngRecord | None = None


def build():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    model = trj.JaxModule({"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 1))})
    tx = optax.adam(1e-2)
    optimizer = trj.JaxOptimizer(tx, tx.init(model.params))
    keys = {"dropout": jax.random.key(3, impl="rbg"), "data": jax.random.PRNGKey(4)}  # typed and raw
    noise = nnx.Rngs(5, noise=jax.random.key(6, impl="unsafe_rbg"))
    return model, optimizer, State(step=0), keys, noise, np.random.default_rng(7)


@jax.jit
def grad_fn(params, x, y, key):
    def loss(p):
        h = jax.nn.relu(x @ p["w1"])
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.mean(((jnp.where(keep, h / 0.8, 0.0)) @ p["w2"] - y) ** 2)
    return jax.grad(loss)(params)


def train(model, optimizer, state, keys, noise, data, until):
    while state.step < until:
        keys["data"], kx = jax.random.split(keys["data"])
        keys["dropout"], kd = jax.random.split(keys["dropout"])
        x = jax.random.normal(kx, (16, 8)) + jax.random.normal(noise.noise(), (16, 8)) * 0.1
        y = jnp.asarray(data.normal(size=(16, 1)), jnp.float32)
        g = grad_fn(model.params, x, y, kd)
        updates, optimizer.opt_state = optimizer.tx.update(g, optimizer.opt_state, model.params)
        model.params = optax.apply_updates(model.params, updates)
        state.step += 1


def save_out(path, model, keys, noise):
    out = {f"p_{k}": np.asarray(v) for k, v in model.params.items()}
    out["dropout"] = np.asarray(jax.random.key_data(keys["dropout"]))
    out["dropout_impl"] = np.array(str(jax.random.key_impl(keys["dropout"])))
    out["data"] = np.asarray(keys["data"])
    out["noise_count"] = np.asarray(noise.noise.count[...])
    np.savez(path, **out)


def main(role, *args):
    model, optimizer, state, keys, noise, data = build()
    if role == "reference":
        train(model, optimizer, state, keys, noise, data, STEPS)
        save_out(args[0], model, keys, noise)
    elif role == "checkpoint":
        train(model, optimizer, state, keys, noise, data, int(args[1]))
        state.rng = trj.JaxRngRecord.capture(data, keys["dropout"], keys["data"], noise)
        TrainingRecord.capture(model, optimizer, None, GradientsAccumulator(), state).save(DefaultRecorder(), args[0])
    elif role in ("resume", "resume-without-rng"):
        record = TrainingRecord.load(DefaultRecorder(), args[0], "cpu", state_type=State)
        state = record.restore(model, optimizer, None, "cpu").state
        if role == "resume":  # else the keys, Rngs and Generator start over: the run differs
            keys["dropout"], keys["data"] = state.rng.apply(data, keys["dropout"], keys["data"], noise)
        train(model, optimizer, state, keys, noise, data, STEPS)
        save_out(args[1], model, keys, noise)


if __name__ == "__main__":
    main(*sys.argv[1:])
