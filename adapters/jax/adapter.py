"""`JaxAdapter` (`ADAPTER`, the `trainrec.adapters` entry point): what `trainrec.adapt`
finds for JAX arrays, devices and native models (flax nnx, equinox), and the flax
containers it refuses, saying what to pass instead. It sits above every binding it
hands out (`bindings`, `nnx`, `equinox`), so none of them imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from .backend import _BACKEND


class JaxAdapter:
    """Claims JAX arrays, the `jax.Array` type and JAX devices for `JaxBackend`, binds a
    flax `nnx.Module` / `nnx.Optimizer` (`NnxModule`, `NnxOptimizer`) and an equinox
    `eqx.Module` (`EqxModule`), found only when the caller imported flax nnx or equinox;
    the holders above implement the protocols themselves."""

    name = "jax"

    def adapt(self, obj: Any) -> Any:
        if isinstance(obj, (jax.Array, jax.Device)):
            return _BACKEND
        if isinstance(obj, type) and issubclass(obj, jax.Array):
            return _BACKEND
        _refuse_containers(obj)
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(obj, nnx.Optimizer):
            from .nnx import NnxOptimizer
            return NnxOptimizer(obj)
        if nnx is not None and isinstance(obj, nnx.Module):
            from .nnx import NnxModule
            return NnxModule(obj)
        eqx = sys.modules.get("equinox")
        if eqx is not None and isinstance(obj, eqx.Module):
            from .equinox import EqxModule
            return EqxModule(obj)
        return None


def _refuse_containers(obj: Any) -> None:
    """`TypeError` saying what to pass instead, for flax containers that are no model or
    optimizer of their own: a linen `TrainState` (both at once) and a bare `nnx.State`
    (which says nothing of which variables are trainable)."""
    train_state = sys.modules.get("flax.training.train_state")
    if train_state is not None and isinstance(obj, train_state.TrainState):
        raise TypeError(
            "a flax TrainState holds the model's params and the optimizer's state together: pass "
            "trainrec.adapters.jax.JaxModule(state.params) as the model and JaxOptimizer(state.tx, "
            "state.opt_state) as the optimizer (record state.step in your own @trainrec.record state), "
            "and after a restore state.replace(params=model.params, opt_state=optimizer.opt_state)")
    statelib = sys.modules.get("flax.nnx.statelib")
    if statelib is not None and isinstance(obj, statelib.State):
        raise TypeError(
            "a bare nnx.State says nothing of which variables are trainable: pass the nnx.Module "
            "(or nnx.Optimizer) it came from, which trainrec binds as it is, or hold the state in "
            "trainrec.adapters.jax.JaxModule(state), where every leaf is trainable")


ADAPTER = JaxAdapter()
