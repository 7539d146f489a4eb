"""flax nnx natively: `NnxModule(model)` and `NnxOptimizer(optimizer)`.

An `nnx.Module` is mutable, so these bind the live object and a restore writes into it
(`nnx.update`): `RestoredTraining.model` is the module that was passed. `trainrec.adapt`
finds them for an `nnx.Module` / `nnx.Optimizer` (so `TrainingRecord.capture(model,
optimizer, ...)` takes the nnx objects themselves).

ParamIds are the key paths of `nnx.state(model)` (`block.linear.kernel`). `nnx.Param`
variables are trainable; every other variable (`BatchStat`, `RngCount`, the `RngKey`s
of `nnx.Rngs` held by the module, user variables) is recorded and restored but receives
no gradients. Key arrays are recorded as `JaxRngRecord` records a key (`_arrays`).
A module from `nnx.eval_shape` (abstract: `jax.ShapeDtypeStruct` values) is a restore
target: the restore writes concrete arrays into it, placed by each value's sharding.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from flax import nnx

from trainrec import StateRecord
from trainrec.adapter_kit import Item, UncheckedIdentityWarning, expect_kind

from . import _arrays
from .bindings import JaxModule, flatten, optimizer_identity, without_identity

__all__ = ["NnxModule", "NnxOptimizer"]

_HINT = ("keep only arrays in nnx Variables (a value that is not an array belongs in a plain "
         "attribute, which nnx does not count as state)")


def _state(obj: Any) -> tuple[dict[str, Any], Any]:
    return flatten(nnx.state(obj))


def _snapshot(obj: Any) -> Any:
    """The leaves of `obj`'s state (immutable arrays) and its structure: a backup that
    later writes into `obj` do not change."""
    return jax.tree_util.tree_flatten(nnx.state(obj))


def _revert(obj: Any, snapshot: Any) -> None:
    leaves, treedef = snapshot
    nnx.update(obj, jax.tree_util.tree_unflatten(treedef, leaves))


def _write(obj: Any, record: Any, kind: str, component: str, device: Any) -> None:
    leaves, treedef = _state(obj)
    new = _arrays.rebuild(leaves, _arrays.check(record, kind, leaves, component), device)
    nnx.update(obj, jax.tree_util.tree_unflatten(treedef, list(new.values())))


class NnxModule(JaxModule):
    """A flax `nnx.Module` as an `AutodiffModule`, bound to the live object: `.module`
    (also `.native`). `.params` is `nnx.state(module)`; assigning it updates the module."""

    kind = "flax.nnx.Module"

    def __init__(self, module: Any) -> None:
        if not isinstance(module, nnx.Module):
            raise TypeError(f"NnxModule takes an nnx.Module, got {type(module).__name__}")
        self.module = module

    @property
    def native(self) -> Any:
        """The module itself (restored in place)."""
        return self.module

    @property  # JaxModule's field, here a view of the live module
    def params(self) -> Any:
        return nnx.state(self.module)

    @params.setter
    def params(self, value: Any) -> None:
        nnx.update(self.module, value)

    def _trainable_prefix(self) -> str:
        return ""

    def trainable(self) -> Any:
        """The `nnx.Param` state: what `nnx.grad` differentiates and `to_tree` gives."""
        return nnx.state(self.module, nnx.Param)

    def snapshot(self) -> Any:
        return _snapshot(self.module)

    def revert(self, snapshot: Any) -> None:
        _revert(self.module, snapshot)

    def into_record(self) -> StateRecord:
        return _arrays.capture(self.kind, _state(self.module)[0], _HINT)

    def check_record(self, record: Any) -> None:
        _arrays.check(record, self.kind, _state(self.module)[0], "model")

    def load_record(self, record: Any, device: Any) -> None:
        _write(self.module, record, self.kind, "model", device)


class NnxOptimizer:
    """A flax `nnx.Optimizer` as an `Optimizer`: its `step` and `opt_state` are recorded
    by key path (`opt_state.0.mu.linear.kernel`) and restored into the live object. As
    `JaxOptimizer` does, the record also names the optimizer: `#transforms`, `#identity`
    (the optax transforms with their hyperparameters) and `#state_types`; a restore into
    an `nnx.Optimizer` of another transformation or other hyperparameters is refused,
    naming each difference."""

    kind = "flax.nnx.Optimizer"

    def __init__(self, optimizer: Any) -> None:
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(f"NnxOptimizer takes an nnx.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @property
    def native(self) -> Any:
        return self.optimizer

    def snapshot(self) -> Any:
        return _snapshot(self.optimizer)

    def revert(self, snapshot: Any) -> None:
        _revert(self.optimizer, snapshot)

    def into_record(self, module: Any) -> StateRecord:
        # every leaf is under `step` or `opt_state.`: none is named like the identity keys
        record = _arrays.capture(self.kind, _state(self.optimizer)[0], _HINT)
        item: dict[str, Item] = dict(record.item) if isinstance(record.item, dict) else {}
        item.update(optimizer_identity(self.optimizer.tx, self.optimizer.opt_state))
        return StateRecord(self.kind, item)

    def _state_record(self, record: Any, allow: frozenset[str]) -> StateRecord:
        item = expect_kind(record, self.kind, "optimizer")
        return StateRecord(self.kind, without_identity(item, self.optimizer.tx, self.optimizer.opt_state,
                                                       allow))

    def check_record(self, record: Any, module: Any, *,
                     allow_changes: frozenset[str] = frozenset()) -> None:
        _arrays.check(self._state_record(record, allow_changes), self.kind, _state(self.optimizer)[0],
                      "optimizer")

    def load_record(self, record: Any, module: Any, device: Any, *,
                    allow_changes: frozenset[str] = frozenset()) -> None:
        with warnings.catch_warnings():  # said by check_record, which restore runs first
            warnings.simplefilter("ignore", UncheckedIdentityWarning)
            state = self._state_record(record, allow_changes)
        _write(self.optimizer, state, self.kind, "optimizer", device)
