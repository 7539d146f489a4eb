"""JAX bindings: holders for immutable JAX state (the backend is `backend.py`'s
`JaxBackend`, re-exported here).

JAX values are immutable, so the protocol objects are small holders whose fields the
training loop reassigns: `JaxModule(params)` (`.params`), `JaxOptimizer(tx, opt_state)`
(`.opt_state`), `JaxLrScheduler(schedule, count)` (`.count`). Restoring assigns new
pytrees of the same structure and devices as the live ones, each leaf of its recorded
dtype (the live tree is a template: optax's moments of bf16 params become f32 with f32
gradients, which a fresh `tx.init` does not know).

ParamIds are pytree key paths joined with `.` (dict keys, sequence indices, NamedTuple
field names): `params.Dense_0.kernel`, optax's `1.0.mu.Dense_0.kernel`.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from trainrec import RecordMismatchError, StateRecord
from trainrec.adapter_kit import (
    Change,
    Item,
    UncheckedIdentityWarning,
    expect_kind,
    settle,
    unchecked,
)

from .backend import _BACKEND, JaxBackend, accumulate_tree
from .identity import (
    IDENTITY_KEY,
    STATE_TYPES_KEY,
    changes,
    identity_of,
    leaf_paths,
    schedule_identity,
    state_types_of,
)
from .neutral import TRANSFORMS_KEY
from .paths import flatten, key_path
from .placement import DeletedArrayError, abstract_error, is_abstract
from .trees import _check_tree, _host, _placements, _rebuild

__all__ = ["JaxBackend", "JaxModule", "JaxOptimizer", "JaxLrScheduler", "accumulate_tree", "key_path",
           "flatten"]


def _is_dict(tree: Any) -> bool:
    """A dict or a flax `FrozenDict` (flax linen variables come as either)."""
    if isinstance(tree, dict):
        return True
    frozen = sys.modules.get("flax.core.frozen_dict")
    return frozen is not None and isinstance(tree, frozen.FrozenDict)


_IDS: dict[tuple[Any, str], tuple[str, ...]] = {}


def _param_ids(tree: Any, prefix: str) -> tuple[list[Any], tuple[str, ...]]:
    """The leaves of `tree` and their ParamIds (under `prefix`), the names cached by tree
    structure (a treedef fixes every key path): `accumulate` asks for them every call."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    ids = _IDS.get((treedef, prefix))
    if ids is None:
        ids = tuple(f"{prefix}.{k}" if prefix else k for k in flatten(tree)[0])
        if len(_IDS) >= 256:
            _IDS.clear()
        _IDS[(treedef, prefix)] = ids
    return leaves, ids


class JaxModule:
    """A parameter pytree as an `AutodiffModule`: plain nested dicts, flax linen variables
    (`{"params": ..., "batch_stats": ...}`: only `params` is trainable) or a flax nnx
    `State`. `.params` is the live tree; restore assigns a new one."""

    kind = "jax.pytree"

    def __init__(self, params: Any) -> None:
        self.params = params

    @property
    def backend(self) -> JaxBackend:
        return _BACKEND

    def _trainable_prefix(self) -> str:
        return "params" if _is_dict(self.params) and "params" in self.params else ""

    def trainable(self) -> Any:
        """The subtree that receives gradients (`params` of flax variables, else all)."""
        return self.params["params"] if self._trainable_prefix() else self.params

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        leaves, ids = _param_ids(self.trainable(), self._trainable_prefix())
        return {k: tuple(np.shape(v)) for k, v in zip(ids, leaves)}

    def param_ids(self) -> list[str]:
        return list(self.param_shapes())

    def param_placements(self) -> dict[str, Any]:
        """Each trainable parameter's sharding (a live array's, or an abstract target's
        when it gives one): where `TrainingRecord.restore` places its pending gradient."""
        leaves, ids = _param_ids(self.trainable(), self._trainable_prefix())
        return _placements(leaves, ids)

    def snapshot(self) -> Any:
        """The live tree (immutable arrays: holding it is a backup)."""
        return self.params

    def revert(self, snapshot: Any) -> None:
        """Put back what `snapshot` returned."""
        self.params = snapshot

    def into_record(self) -> StateRecord:
        leaves, _ = flatten(self.params)
        item: dict[str, Item] = {}
        for k, v in leaves.items():
            if is_abstract(v):
                raise abstract_error(k)
            try:
                item[k] = _host(v, k)
            except DeletedArrayError as e:
                raise ValueError(f"leaf {k!r}: {e}") from e
            except TypeError as e:
                code = "a function in a pytree is code, not state: " if callable(v) else ""
                raise TypeError(
                    f"leaf {k!r} ({type(v).__name__}) cannot be recorded: {e}; {code}pass an "
                    "eqx.Module or nnx.Module itself (trainrec binds it as EqxModule / NnxModule), "
                    "or record only the arrays it can hold (eqx.filter(tree, eqx.is_array))") from e
        return StateRecord(self.kind, item)

    def check_record(self, record: Any) -> None:
        leaves, _ = flatten(self.params)
        _check_tree(expect_kind(record, self.kind, "model"), leaves, "model")

    def load_record(self, record: Any, device: Any) -> None:
        leaves, treedef = flatten(self.params)
        recorded = _check_tree(expect_kind(record, self.kind, "model"), leaves, "model")
        self.params = _rebuild(leaves, treedef, recorded, device)


def _cells(fn: Any) -> dict[str, Any]:
    """A function's closure variables by name (empty cells left out)."""
    out = {}
    for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), fn.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            continue
    return out


def _describe(fn: Any, out: list[str]) -> None:
    """Append the optax transforms behind an update function, in chain order: a chain's
    members in turn, `inject_hyperparams(<factory>)`, else the function's factory name
    with its scalar closure variables (`scale_by_adam(b1=0.9, ..., nesterov=False)`)."""
    name = getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]
    cells = _cells(fn) if callable(fn) else {}
    if name in ("chain", "named_chain"):
        for value in cells.values():
            for member in value if isinstance(value, (tuple, list)) else ():
                member = member[-1] if isinstance(member, tuple) else member  # named_chain: (name, tx)
                _describe(getattr(member, "update", member), out)
        return
    if name == "with_extra_args_support":  # chain's wrapper of each member
        for value in cells.values():
            if hasattr(value, "update") or callable(value):
                _describe(getattr(value, "update", value), out)
                return
    if name.startswith("inject_"):
        factories = [v for v in cells.values() if callable(v) and not isinstance(v, type)]
        factory = factories[0] if factories else None
        inner = getattr(factory, "__qualname__", "?")
        if isinstance(factory, functools.partial):  # optax.nadam is partial(adam, nesterov=True)
            bound = ", ".join(f"{k}={v!r}" for k, v in sorted(factory.keywords.items()))
            inner = f"{getattr(factory.func, '__qualname__', '?')}({bound})"
        out.append(f"{name}({inner})")
        return
    scalars = ", ".join(f"{k}={v!r}" for k, v in sorted(cells.items())
                        if isinstance(v, (bool, int, float, str)))
    out.append(f"{name}({scalars})")


def transforms_of(tx: Any) -> list[str]:
    """The optax transforms of `tx`, as `JaxOptimizer` records them (see `_describe`):
    what tells Adam from AdaMax, Yogi, NAdam or RAdam, whose states are alike."""
    out: list[str] = []
    _describe(getattr(tx, "update", tx), out)
    return out


_IDENTITY_KEYS = (TRANSFORMS_KEY, IDENTITY_KEY, STATE_TYPES_KEY)


def reserved_by_record(leaves: dict[str, Any]) -> None:
    """`ValueError` when an optimizer state leaf has a name the record keeps for the
    optimizer's identity (`#transforms`, `#identity`, `#state_types`)."""
    reserved = [k for k in _IDENTITY_KEYS if k in leaves]
    if reserved:
        raise ValueError(f"an optimizer state leaf is named {reserved[0]!r}, which the record reserves")


def optimizer_identity(tx: Any, opt_state: Any) -> dict[str, Item]:
    """What an optimizer record holds beside the state: the transforms' names
    (`#transforms`, for conversion), the transforms with their hyperparameters
    (`#identity`) and the optax state types per chain position (`#state_types`)."""
    return {TRANSFORMS_KEY: list(transforms_of(tx)), IDENTITY_KEY: identity_of(tx),
            STATE_TYPES_KEY: state_types_of(opt_state)}


def without_identity(item: Item, tx: Any, opt_state: Any,
                     allow: frozenset[str] = frozenset()) -> Item:
    """`item` (an optimizer record's) without the identity keys, once what they record
    matches `tx` and `opt_state`; else `RecordMismatchError` naming every difference that
    `allow` (`allow_changes` entries such as `optimizer.b1`) does not allow. A record
    without them (captured before trainrec kept them) loads with an
    `UncheckedIdentityWarning`, unless `allow` names `optimizer.#identity`."""
    if not isinstance(item, dict):
        return item
    if TRANSFORMS_KEY in item:
        names = item[TRANSFORMS_KEY]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RecordMismatchError("expected a list of transform names", key=f"optimizer.{TRANSFORMS_KEY}")
    found: list[Change] = []
    fields: list[str] = []
    at_identity, at_types = f"optimizer.{IDENTITY_KEY}", f"optimizer.{STATE_TYPES_KEY}"
    if IDENTITY_KEY in item:
        live = identity_of(tx)
        found += changes(item[IDENTITY_KEY], live, at_identity)
        fields += leaf_paths(item[IDENTITY_KEY], at_identity) + leaf_paths(live, at_identity)
    else:
        unchecked([at_identity], allow, "the optax optimizer (its transforms and hyperparameters)")
        fields += leaf_paths(identity_of(tx), at_identity)  # what allow_changes may name
    if STATE_TYPES_KEY in item:
        live_types = state_types_of(opt_state)
        found += changes(item[STATE_TYPES_KEY], live_types, at_types)
        fields += leaf_paths(item[STATE_TYPES_KEY], at_types) + leaf_paths(live_types, at_types)
    settle(found, fields, allow, "the transforms and hyperparameters of the live optax optimizer",
           "Build the optimizer as the recorded run did.")
    return {k: v for k, v in item.items() if k not in _IDENTITY_KEYS}


class JaxOptimizer:
    """An optax `GradientTransformation` and its state as an `Optimizer`. The record is
    the state pytree by key path (NamedTuple field names, chain indices), restored onto
    the structure of the live `opt_state`; under `#transforms` the names of the optax
    transforms (`transforms_of`), which conversion reads to know the algorithm; under
    `#identity` the transforms with their hyperparameters (schedules, `MultiSteps`'
    `every_k_schedule` and `inject_hyperparams`' arguments included) and under
    `#state_types` the optax state types per chain position (`identity.py`). A restore
    into an optimizer whose identity or state types differ is refused, naming the
    differences, unless `allow_changes` names each (`optimizer.b1`: the live `tx` then
    runs with its own); records without them (captured before they were kept) load with
    an `UncheckedIdentityWarning`."""

    kind = "optax.GradientTransformation"

    def __init__(self, tx: Any, opt_state: Any) -> None:
        self.tx = tx
        self.opt_state = opt_state

    def into_record(self, module: Any) -> StateRecord:
        leaves, _ = flatten(self.opt_state)
        reserved_by_record(leaves)
        item: dict[str, Item] = {k: _host(v, k) for k, v in leaves.items()}
        item.update(optimizer_identity(self.tx, self.opt_state))
        return StateRecord(self.kind, item)

    def _leaves_of(self, record: Any, allow: frozenset[str]) -> Any:
        return without_identity(expect_kind(record, JaxOptimizer.kind, "optimizer"), self.tx,
                                self.opt_state, allow)

    def check_record(self, record: Any, module: Any, *,
                     allow_changes: frozenset[str] = frozenset()) -> None:
        leaves, _ = flatten(self.opt_state)
        _check_tree(self._leaves_of(record, allow_changes), leaves, "optimizer")

    def snapshot(self) -> Any:
        """The live state (immutable arrays: holding it is a backup)."""
        return self.opt_state

    def revert(self, snapshot: Any) -> None:
        """Put back what `snapshot` returned."""
        self.opt_state = snapshot

    def load_record(self, record: Any, module: Any, device: Any, *,
                    allow_changes: frozenset[str] = frozenset()) -> None:
        leaves, treedef = flatten(self.opt_state)
        with warnings.catch_warnings():  # said by check_record, which restore runs first
            warnings.simplefilter("ignore", UncheckedIdentityWarning)
            recorded = _check_tree(self._leaves_of(record, allow_changes), leaves, "optimizer")
        self.opt_state = _rebuild(leaves, treedef, recorded, device)


class JaxLrScheduler:
    """An optax schedule (a function of the step count) with its position: `step()`
    returns `schedule(count)` and advances. The function is code: it comes from the
    caller's program; the record holds the count and, under `#identity`, the schedule
    as `identity.py` names it (the function and the constants it captured). A restore
    refuses a live schedule that differs, naming each field, unless `allow_changes`
    names it (`scheduler.decay_steps`: the live schedule then runs from the recorded
    count); a record without `#identity` loads with an `UncheckedIdentityWarning`."""

    kind = "optax.schedule"

    def __init__(self, schedule: Callable[[Any], Any], count: int = 0) -> None:
        self.schedule = schedule
        self.count = count

    def step(self) -> float:
        lr = float(self.schedule(self.count))
        self.count += 1
        return lr

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {"count": int(self.count), IDENTITY_KEY: schedule_identity(self.schedule)})

    def _checked(self, record: Any, allow: frozenset[str], warn: bool = True) -> int:
        item = expect_kind(record, self.kind, "scheduler")
        count = item.get("count") if isinstance(item, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise RecordMismatchError(f"count must be an int >= 0, got {count!r}", key="scheduler")
        at = f"scheduler.{IDENTITY_KEY}"
        assert isinstance(item, dict)  # `count` was found in it
        if IDENTITY_KEY in item:
            live = schedule_identity(self.schedule)
            settle(changes(item[IDENTITY_KEY], live, at), leaf_paths(item[IDENTITY_KEY], at) + leaf_paths(live, at),
                   allow, "the fields of the live optax schedule", "Pass the schedule the recorded run had.")
        elif warn:
            unchecked([at], allow, "the optax schedule")
        return count

    def check_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        self._checked(record, allow_changes)

    def load_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        self.count = self._checked(record, allow_changes, warn=False)
