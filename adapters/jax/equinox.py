"""equinox natively: `EqxModule(model)`, which `trainrec.adapt` gives for an `eqx.Module`.

An equinox module is an immutable pytree. Its array leaves are recorded by key path
(`layers.0.weight`): inexact (floating) arrays are the trainable parameters, other arrays
(integer counters, typed PRNG keys) are recorded and restored but receive no gradients.
Every other leaf (activation functions such as `jax.nn.relu`, Python numbers, strings)
is code or configuration: it is not recorded, and a restore keeps the live module's.

A restore builds a NEW module (`jax.tree_util.tree_unflatten` of the live structure):
`EqxModule.model` (also `.native`) holds it, and `TrainingRecord.restore(model, ...)`
returns it as `RestoredTraining.model` whether `model` was the `eqx.Module` itself or an
`EqxModule`; continue training with that object. The live module may be abstract
(`eqx.filter_eval_shape(Model, ...)`: `jax.ShapeDtypeStruct` leaves): the restored one
holds concrete arrays, placed by each leaf's sharding.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from trainrec import StateRecord

from . import _arrays
from .bindings import JaxModule, flatten
from .placement import is_abstract

__all__ = ["EqxModule"]

_HINT = ("leave it out of what trainrec records: mark the field `eqx.field(static=True)`, or "
         "split the module with `params, static = eqx.partition(model, eqx.is_array)` and record "
         "`trj.JaxModule(params)` (or `eqx.filter(model, eqx.is_inexact_array)`)")


class EqxModule(JaxModule):
    """An `eqx.Module` as an `AutodiffModule`. `.model` is the live module; a restore
    assigns a new one (equinox modules are immutable), as does assigning `.params`."""

    kind = "equinox.Module"

    def __init__(self, model: Any) -> None:
        if not isinstance(model, eqx.Module):
            raise TypeError(f"EqxModule takes an eqx.Module, got {type(model).__name__}")
        self.model = model

    @property
    def native(self) -> Any:
        """The live module (after a restore: the new one)."""
        return self.model

    @property  # JaxModule's field, here the module itself
    def params(self) -> Any:
        return self.model

    @params.setter
    def params(self, value: Any) -> None:
        self.model = value

    def _trainable_prefix(self) -> str:
        return ""

    def trainable(self) -> Any:
        """`eqx.filter(model, eqx.is_inexact_array)`: the tree `eqx.filter_grad` gives and
        optax updates (`eqx.apply_updates` adds it to the model)."""
        return eqx.filter(self.model, _is_inexact)

    def _arrays(self) -> dict[str, Any]:
        leaves, _ = flatten(self.model)
        return {k: v for k, v in leaves.items() if _is_array(v)}

    def into_record(self) -> StateRecord:
        return _arrays.capture(self.kind, self._arrays(), _HINT)

    def check_record(self, record: Any) -> None:
        _arrays.check(record, self.kind, self._arrays(), "model")

    def load_record(self, record: Any, device: Any) -> None:
        leaves, treedef = flatten(self.model)
        arrays = {k: v for k, v in leaves.items() if _is_array(v)}
        new = _arrays.rebuild(arrays, _arrays.check(record, self.kind, arrays, "model"), device)
        self.model = jax.tree_util.tree_unflatten(treedef, [new.get(k, v) for k, v in leaves.items()])


def _is_array(leaf: Any) -> bool:
    """An array leaf, or an abstract one (a restore target)."""
    return eqx.is_array(leaf) or is_abstract(leaf)


def _is_inexact(leaf: Any) -> bool:
    """A trainable leaf: an inexact array, or an abstract one."""
    return eqx.is_inexact_array(leaf) or is_abstract(leaf) and bool(jnp.issubdtype(leaf.dtype, jnp.inexact))
