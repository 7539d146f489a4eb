"""JAX workloads for `trainrec demo` and the exact-continuation tests.

- `default`: flax linen MLP with dropout, optax adamw with a warm-up cosine schedule
  inside the optimizer, jitted gradient step;
- `injected`: the same with `inject_hyperparams(adamw)` whose learning rate comes from a
  `JaxLrScheduler` each window.

Batches and dropout keys come from a JAX PRNG key held in the caller's state.
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

import trainrec
from trainrec import DType, GradientsParams, Recorder
from trainrec.adapter_kit import Parts, Workload

from .bindings import JaxLrScheduler, JaxModule, JaxOptimizer
from .grads import grads_from, to_tree
from .recorder import FlaxMsgpackFileRecorder

__all__ = ["JaxDemoState", "JaxWorkload", "WORKLOADS", "WORKLOAD"]


@trainrec.record
class JaxDemoState:
    micro: int
    losses: list[float]
    key: np.ndarray  # the PRNG key's data (uint32)


def _mlp() -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any, train: bool) -> Any:
            for width in (32, 32):
                x = nn.relu(nn.Dense(width)(x))
                x = nn.Dropout(0.1, deterministic=not train)(x)
            return nn.Dense(4)(x)

    return MLP()


class JaxWorkload(Workload):
    name = "jax"
    ref = "trainrec.adapters.jax.demo:WORKLOAD"
    state_type = JaxDemoState
    # JAX runs with 32-bit types unless jax_enable_x64 is set
    dtypes = tuple(d for d in DType if d not in (DType.F64, DType.I64, DType.U64))
    recorders: ClassVar[dict[str, Recorder]] = {
        "flax": FlaxMsgpackFileRecorder(trainrec.NativePrecisionSettings()),
        "flax-full": FlaxMsgpackFileRecorder(),
    }

    def __init__(self, variant: str = "default") -> None:
        self.variant = variant
        self.device = os.environ.get("TRAINREC_DEMO_DEVICE")  # None: JAX's default device
        if variant != "default":
            self.ref = f"trainrec.adapters.jax.demo:WORKLOADS_{variant.upper()}"
        self.net = _mlp()
        self._grad = jax.jit(jax.value_and_grad(self._loss))
        self._update = jax.jit(self._apply, static_argnums=0)

    def _loss(self, params: Any, x: Any, y: Any, key: Any) -> Any:
        out = self.net.apply({"params": params}, x, train=True, rngs={"dropout": key})
        return jnp.mean((out - y) ** 2)

    def _apply(self, tx: Any, grads: Any, opt_state: Any, params: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def build(self, seed: int) -> Parts:
        random.seed(seed)
        np.random.seed(seed)
        key = jax.random.PRNGKey(seed)
        key, init_key = jax.random.split(key)
        variables = self.net.init(init_key, jnp.zeros((1, 16)), train=False)
        model = JaxModule(variables)
        schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
        if self.variant == "injected":
            tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.01)
            scheduler: Any = JaxLrScheduler(schedule)
        else:
            tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
            scheduler = None
        opt = JaxOptimizer(tx, tx.init(variables["params"]))
        return Parts(model, opt, scheduler, JaxDemoState(0, [], np.asarray(key)))

    def micro_step(self, parts: Parts) -> None:
        state = parts.state
        key, data_key, dropout_key = jax.random.split(jnp.asarray(state.key), 3)
        x = jax.random.normal(data_key, (8, 16))
        y = jnp.tanh(x[:, :4] * 2.0)
        loss, grads = self._grad(parts.model.params["params"], x, y, dropout_key)
        parts.accumulator.accumulate(parts.model, grads_from(grads, parts.model))
        state.losses.append(float(loss))
        state.key = np.asarray(key)

    def apply_window(self, parts: Parts, window: int) -> None:
        summed = parts.accumulator.grads()
        grads = to_tree(GradientsParams({k: v / window for k, v in summed.items()}), parts.model)
        opt: JaxOptimizer = parts.optimizer
        if parts.scheduler is not None:
            opt.opt_state.hyperparams["learning_rate"] = jnp.asarray(parts.scheduler.step())
        params, opt.opt_state = self._update(opt.tx, grads, opt.opt_state, parts.model.params["params"])
        parts.model.params = {**parts.model.params, "params": params}

    # before_capture / after_restore: nothing to do, the PRNG key lives in the state


WORKLOADS = {name: JaxWorkload(name) for name in ("default", "injected")}
WORKLOAD = WORKLOADS["default"]
WORKLOADS_INJECTED = WORKLOADS["injected"]
