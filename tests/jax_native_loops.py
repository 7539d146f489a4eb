"""Training loops on native JAX models for tests/test_jax_native.py: a flax nnx model with
Dropout and BatchNorm (its `nnx.Rngs` inside) under `nnx.Optimizer(adamw)`, and an
equinox MLP under optax adamw, each with gradient accumulation over WINDOW micro-steps.

`python tests/jax_native_loops.py KIND CHECKPOINT OUT` resumes KIND from CHECKPOINT in
this fresh process, trains to STEPS and writes the final model and optimizer as a record."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import trainrec
import trainrec.adapters.jax as trj
from trainrec import DefaultRecorder, GradientsAccumulator, RngRecord, TrainingRecord

WINDOW, STEPS = 4, 8


@trainrec.record
class State:
    micro: int
    rng: RngRecord | None = None  # the numpy Generator that draws the data


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(jax.nn.relu(self.norm(self.linear(x)))))


def _nnx_loss(model: Net, x: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - x.sum(1, keepdims=True)) ** 2)


@nnx.jit
def _nnx_grads(model: Net, x: jax.Array) -> Any:
    return nnx.grad(_nnx_loss)(model, x)  # Dropout and BatchNorm update the module


TX = optax.adamw(1e-2)


@nnx.jit
def _nnx_update(optimizer: Any, model: Net, grads: Any) -> None:
    optimizer.update(model, grads)


@eqx.filter_jit
def _eqx_update(model: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state


@eqx.filter_jit
def _eqx_grads(model: Any, x: jax.Array) -> Any:
    return eqx.filter_grad(lambda m, x: jnp.mean((jax.vmap(m)(x) - x.sum(1, keepdims=True)) ** 2))(model, x)


def build(kind: str) -> tuple[Any, Any, GradientsAccumulator, State, np.random.Generator]:
    data = np.random.default_rng(0)
    if kind == "nnx":  # built under jit: one compilation, not one per initializer op
        model = nnx.jit(lambda: Net(nnx.Rngs(params=0, dropout=1)))()
        optimizer: Any = nnx.jit(lambda m: nnx.Optimizer(m, TX, wrt=nnx.Param))(model)
    else:
        # its structure from eqx.nn.MLP, its weights from numpy: equinox's initializers
        # compile for seconds, which a fresh process would pay again
        shapes = eqx.filter_eval_shape(eqx.nn.MLP, 6, 1, 16, 2, activation=jax.nn.relu, key=jax.random.key(0))
        init = np.random.default_rng(1)
        model = jax.tree.map(lambda s: jnp.asarray(init.normal(scale=0.3, size=s.shape).astype(s.dtype))
                             if isinstance(s, jax.ShapeDtypeStruct) else s,
                             shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        optimizer = trj.JaxOptimizer(TX, jax.jit(TX.init)(eqx.filter(model, eqx.is_inexact_array)))
    return model, optimizer, GradientsAccumulator(), State(micro=0), data


def train(model: Any, optimizer: Any, acc: GradientsAccumulator, state: State,
          data: np.random.Generator, until: int) -> Any:
    """Micro-steps until `state.micro == until`; returns the model (a new one for equinox)."""
    while state.micro < until:
        x = jnp.asarray(data.normal(size=(8, 6)).astype(np.float32))
        grads = _nnx_grads(model, x) if isinstance(model, nnx.Module) else _eqx_grads(model, x)
        acc.accumulate(model, trj.grads_from(jax.tree.map(lambda g: g / WINDOW, grads), model))
        state.micro += 1
        if state.micro % WINDOW == 0:
            window = trj.to_tree(acc.grads(), model)
            if isinstance(model, nnx.Module):
                _nnx_update(optimizer, model, window)
            else:
                model, optimizer.opt_state = _eqx_update(model, optimizer.opt_state, window)
    return model


def final(model: Any, optimizer: Any) -> TrainingRecord[Any]:
    """The end of a run as a record (no pending gradients)."""
    return TrainingRecord.capture(model, optimizer, None, GradientsAccumulator(), State(micro=STEPS))


def checkpoint(kind: str, at: int, path: Path) -> None:
    model, optimizer, acc, state, data = build(kind)
    model = train(model, optimizer, acc, state, data, at)
    state.rng = RngRecord.capture(data)
    TrainingRecord.capture(model, optimizer, None, acc, state).save(DefaultRecorder(), path)


def resume(kind: str, path: Path) -> TrainingRecord[Any]:
    model, optimizer, _, _, data = build(kind)
    record = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=State)
    restored = record.restore(model, optimizer, None, "cpu")
    assert restored.state.rng is not None
    restored.state.rng.apply(data)
    model = train(restored.model, optimizer, restored.accumulator, restored.state, data, STEPS)
    return final(model, optimizer)


if __name__ == "__main__":
    kind, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    resume(kind, ckpt).save(trainrec.NamedMpkFileRecorder(trainrec.NativePrecisionSettings()), out)
