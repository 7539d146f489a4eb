"""JAX loops for `trainrec check` (tests/test_check.py): the README's flax linen loop as a
`trainrec.Workload`, and broken variants of it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import trainrec
import trainrec.adapters.jax as trj
from trainrec import Parts

WINDOW = 4


@trainrec.record
class State:  # your counters and your RNG states
    micro: int
    rng: trj.JaxRngRecord | None = None  # at a checkpoint: the dropout key and the data Generator


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, dropout_key):  # type: ignore[no-untyped-def]
        h = nn.Dropout(0.1, deterministic=False)(nn.relu(nn.Dense(32)(x)), rng=dropout_key)
        return nn.Dense(1)(h)


@jax.jit
def grad_fn(params, x, key):  # type: ignore[no-untyped-def]
    def loss(params):  # type: ignore[no-untyped-def]
        return jnp.mean((MLP().apply({"params": params}, x, key) - x.sum(1, keepdims=True)) ** 2)
    return jax.grad(loss)(params)


class ReadmeJaxLoop(trainrec.Workload):
    """The README's JAX loop: optax chain with clipping and a cosine schedule, a typed
    dropout key and a numpy data Generator, both in `parts.extras` and recorded."""

    state_type = State
    window = WINDOW

    def build(self, seed: int) -> Parts:
        variables = MLP().init(jax.random.PRNGKey(seed), jnp.zeros((1, 8)), jax.random.PRNGKey(1))
        model = trj.JaxModule(variables)
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(optax.cosine_decay_schedule(1e-2, 6)))
        optimizer = trj.JaxOptimizer(tx, tx.init(variables["params"]))
        return Parts(model, optimizer, None, State(micro=0),
                     extras={"key": jax.random.key(2), "data": np.random.default_rng(seed)})

    def micro_step(self, parts: Parts) -> None:
        x = parts.extras["data"].normal(size=(16, 8)).astype(np.float32)
        parts.report_batch(x)
        parts.extras["key"], dropout_key = jax.random.split(parts.extras["key"])
        grads = jax.tree.map(lambda g: g / WINDOW, grad_fn(parts.model.params["params"], x, dropout_key))
        parts.accumulator.accumulate(parts.model, trj.grads_from(grads, parts.model))

    def apply_window(self, parts: Parts, window: int) -> None:
        model, optimizer = parts.model, parts.optimizer
        params = model.params["params"]
        summed = trj.to_tree(parts.accumulator.grads(), model)
        updates, optimizer.opt_state = optimizer.tx.update(summed, optimizer.opt_state, params)
        model.params = {**model.params, "params": optax.apply_updates(params, updates)}

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = trj.JaxRngRecord.capture(parts.extras["key"], parts.extras["data"])

    def after_restore(self, parts: Parts) -> None:
        (parts.extras["key"],) = parts.state.rng.apply(parts.extras["key"], parts.extras["data"])


class DropoutKeyOutside(ReadmeJaxLoop):
    """The dropout key is split every micro-step but never recorded: only the data is."""

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = trj.JaxRngRecord.capture(parts.extras["data"])

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply(parts.extras["data"])


class JaxRngNotApplied(ReadmeJaxLoop):
    """Key and Generator recorded, never put back."""

    def after_restore(self, parts: Parts) -> None:
        pass


README_JAX_LOOP = ReadmeJaxLoop()
