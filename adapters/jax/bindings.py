"""JAX bindings: `JaxBackend`, and holders for immutable JAX state.

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

import asyncio
import functools
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrec import (
    DType,
    FloatDType,
    GradientsParams,
    RecordMismatchError,
    StateRecord,
    TensorData,
)
from trainrec.adapter_kit import (
    Change,
    Item,
    UncheckedIdentityWarning,
    check_tensor_map,
    expect_kind,
    kind_mismatches,
    settle,
    unchecked,
)

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
from .placement import (
    DeletedArrayError,
    abstract_error,
    capture_tensor,
    host_copy,
    is_abstract,
    is_array_like,
    place_tensor,
    restored_dtype,
    sharding_of,
    start_host_copy,
)
from .rng import is_typed_key, key_from_item, key_item, key_problems

__all__ = ["JaxBackend", "JaxModule", "JaxOptimizer", "JaxLrScheduler", "grads_from", "to_tree",
           "accumulate_tree", "JaxAdapter", "ADAPTER", "key_path", "flatten"]


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def key_path(path: tuple[Any, ...]) -> str:
    """A pytree key path as a ParamId: the keys joined with `.` (a flax nnx Variable's
    trailing `.value` is left out: `l.kernel`, not `l.kernel.value`)."""
    names = [_key_name(k) for k in path]
    if len(names) > 1 and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names.pop()
    return ".".join(names)


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """Leaves by ParamId, in pytree order, and the treedef to rebuild the tree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, Any] = {}
    for path, leaf in leaves:
        name = key_path(path)
        if name in out:
            raise ValueError(f"two pytree leaves share the ParamId {name!r}")
        out[name] = leaf
    return out, treedef


class JaxBackend:
    """`AutodiffBackend` over JAX arrays. Devices: `jax.Device` or strings `"cpu"`,
    `"cpu:N"`, `"gpu"`, `"gpu:N"` (also `"cuda:N"`). Arrays are immutable: `add` returns a
    new array and `clone` may return its argument."""

    name = "jax"

    def device(self, spec: Any) -> Any:
        """A `jax.Device`; a `jax.sharding.Sharding` passes through as it is (where a
        parameter's pending gradient goes: its parameter's sharding)."""
        if spec is None:
            return jax.devices()[0]
        if isinstance(spec, (jax.Device, jax.sharding.Sharding)):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"{spec!r} is not a JAX device")
        kind, _, index = spec.partition(":")
        kind = {"cuda": "gpu"}.get(kind, kind)
        try:
            devices = jax.devices(kind)
        except RuntimeError:
            what = "no CUDA device is visible to JAX" if kind == "gpu" else f"JAX has no {kind} devices"
            raise ValueError(f"{spec!r}: {what}; restore to 'cpu'") from None
        i = int(index) if index.isdigit() else 0 if not index else -1
        if not 0 <= i < len(devices):
            raise ValueError(f"{spec!r}: JAX has {len(devices)} {kind} devices")
        return devices[i]

    def device_of(self, tensor: Any) -> jax.Device:
        return next(iter(tensor.devices()))

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, jax.Array)

    def dtype_of(self, tensor: Any) -> DType:
        return DType.from_numpy(tensor.dtype)

    def shape_of(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def to_host(self, tensor: Any) -> np.ndarray[Any, Any]:
        if is_typed_key(tensor):
            raise TypeError(f"a typed JAX key ({tensor.dtype}) is not a tensor: record it with "
                            "trainrec.adapters.jax.JaxRngRecord.capture(key) (a state field "
                            "`rng: JaxRngRecord | None`)")
        return host_copy(tensor)  # a sharded array shard by shard, never gathered

    def to_tensor(self, tensor: Any) -> TensorData:
        """A record of `tensor`: a `ShardedTensor` (this process's shards) for an array
        that spans other processes, else its host copy."""
        if is_typed_key(tensor):
            self.to_host(tensor)  # raises, naming JaxRngRecord
        return capture_tensor(tensor)

    def from_tensor(self, tensor: TensorData, device: Any) -> jax.Array:
        """A new array of `tensor` laid out by `device` (a device or a sharding); a
        `ShardedTensor` built from its shards."""
        return place_tensor(tensor, None, self.device(device), tensor.dtype.numpy)

    async def to_host_async(self, tensor: Any) -> np.ndarray[Any, Any]:
        if isinstance(tensor, jax.Array) and not tensor.is_fully_addressable:
            return self.to_tensor(tensor)  # type: ignore[return-value]  # the accumulator keeps it
        if isinstance(tensor, jax.Array) and not is_typed_key(tensor):
            start_host_copy(tensor)  # each distinct shard, not the replicas
            while not tensor.is_ready():  # type: ignore[attr-defined]  # missing from jax.Array's stub
                await asyncio.sleep(0.0005)
        return self.to_host(tensor)

    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> jax.Array:
        """A new array of `array` on `device` (a device, or a sharding to lay it out by)."""
        out: jax.Array = jax.device_put(np.array(array, copy=True), self.device(device))
        return out

    def cast(self, tensor: Any, dtype: DType) -> jax.Array:
        if tensor.dtype == dtype.numpy:
            return tensor  # type: ignore[no-any-return]
        return tensor.astype(dtype.numpy)  # type: ignore[no-any-return]

    def clone(self, tensor: Any) -> jax.Array:
        return tensor  # type: ignore[no-any-return]  # immutable: sharing is safe

    def gradient_problem(self, grad: Any) -> str | None:
        """What makes `grad` no gradient the accumulator can hold (None: it can): not an
        array, a tracer (a call inside `jax.jit`/`jax.grad`), or not a recordable float
        dtype. Called for every gradient of every `accumulate`: the usual case is two
        lookups."""
        kind = type(grad)
        if kind not in _ARRAY_TYPES:
            if isinstance(grad, jax.core.Tracer):
                return (f"is a traced value ({kind.__name__}): accumulate and adopt run outside "
                        "jax.jit; inside a jitted step sum with trainrec.adapters.jax."
                        "accumulate_tree and adopt the sum outside it")
            if not isinstance(grad, (jax.Array, np.ndarray)):
                return f"is a {kind.__name__}, not a JAX array"
            _ARRAY_TYPES.add(kind)
        if kind is not np.ndarray and isinstance(grad, jax.Array) and grad.is_deleted():
            return ("was deleted (donated to a jitted step through donate_argnums, or .delete()): "
                    "accumulate the gradients the step returned")
        if grad.dtype not in _GRAD_DTYPES:
            return (f"has dtype {grad.dtype}, not a float dtype a record holds "
                    "(float64, float32, float16, bfloat16)")
        return None

    def add(self, pending: Any, grad: Any) -> jax.Array:
        return pending + grad  # type: ignore[no-any-return]

    def add_many(self, pending: list[Any], grads: list[Any], dtype: DType | None) -> list[Any]:
        """`add` for many pairs in one dispatch: one jitted function of the two lists,
        compiled once per tree structure, shapes and dtypes (`pending[i]` None: the
        gradient cast to `dtype`); leaves of 2**18 elements or more get a dispatch each.
        Bitwise what the pair-by-pair casts and adds give.
        No buffer is donated: a pending array may be the caller's own gradient (the first
        `accumulate` keeps it, JAX arrays being immutable) or an adopted tree."""
        name = None if dtype is None else dtype.numpy.name
        big = [i for i, g in enumerate(grads) if g.size >= _OWN_DISPATCH]
        if not big:
            return _add_many(pending, grads, name)  # type: ignore[no-any-return]
        # a large leaf gets its own dispatch: on CPU one program runs its adds one after
        # another, while separate dispatches run on the device's threads side by side
        small = [i for i, g in enumerate(grads) if g.size < _OWN_DISPATCH]
        out: list[Any] = [None] * len(grads)
        for i, v in zip(small, _add_many([pending[i] for i in small], [grads[i] for i in small], name)):
            out[i] = v
        for i in big:
            out[i] = _add_many([pending[i]], [grads[i]], name)[0]
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JaxBackend)

    def __hash__(self) -> int:
        return hash(self.name)


_BACKEND = JaxBackend()
_ARRAY_TYPES: set[type] = set()  # concrete array types seen (tracers never enter)
_GRAD_DTYPES = frozenset(np.dtype(d) for d in ("float64", "float32", "float16", jnp.bfloat16))
TRACES = [0]  # how many times `_add_many` was traced (compiled): tests count them
_OWN_DISPATCH = 1 << 18  # elements from which a leaf is added in a dispatch of its own


def _sum(pending: Any, grad: Any, dtype: str | None) -> Any:
    if pending is None:
        return grad.astype(dtype or grad.dtype)
    target = dtype or pending.dtype
    return pending.astype(target) + grad.astype(target)


@functools.partial(jax.jit, static_argnums=2)
def _add_many(pending: list[Any], grads: list[Any], dtype: str | None) -> list[Any]:
    TRACES[0] += 1
    return [_sum(p, g, dtype) for p, g in zip(pending, grads)]


def accumulate_tree(pending: Any, grads: Any, dtype: Any = None) -> Any:
    """The pure, jit-able form of `GradientsAccumulator.accumulate` for a loop that sums
    gradients inside its own jitted step: `pending + grads` leaf by leaf, each gradient
    cast to its pending leaf's dtype, or both cast to `dtype` when given (as
    `accumulate_with_dtype`); `pending=None` starts a window (the gradients, cast to
    `dtype` when given). Bitwise what the accumulator computes. Before a checkpoint hand
    the sum to the accumulator: `acc.adopt(module, grads_from(pending, module))`."""
    name = None if dtype is None else _float_dtype_name(dtype)
    if pending is None:
        return jax.tree_util.tree_map_with_path(lambda k, g: _sum(None, _checked(k, g), name), grads)
    return jax.tree_util.tree_map_with_path(lambda k, p, g: _sum(_checked(k, p, g), _checked(k, g), name),
                                            pending, grads)


def _float_dtype_name(dtype: Any) -> str:
    """The numpy name of `dtype` (what `FloatDType.of` takes), which must be a float dtype
    a record holds; else `TypeError` saying where `FloatDType` lives."""
    return str(FloatDType.of(dtype).dtype.numpy.name)


def _checked(path: Any, leaf: Any, grad: Any = None) -> Any:
    """`leaf` (a gradient, or the pending sum beside `grad`) when it is a float array of
    the same shape as `grad`: shapes are static, so under `jit` this costs nothing."""
    where = key_path(path)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(f"gradient {where!r} is a {type(leaf).__name__}, not an array")
    if np.dtype(leaf.dtype) not in _GRAD_DTYPES:
        raise TypeError(f"gradient {where!r} has dtype {leaf.dtype}, not a float dtype a record holds "
                        "(float64, float32, float16, bfloat16)")
    if grad is not None and tuple(leaf.shape) != tuple(getattr(grad, "shape", ())):
        raise ValueError(f"gradient {where!r} has shape {tuple(getattr(grad, 'shape', ()))}, pending "
                         f"{tuple(leaf.shape)}: the sum would broadcast (the gradient is of another model)")
    return leaf


def _host(leaf: Any, name: str = "") -> Item:
    if is_abstract(leaf):
        raise abstract_error(name)
    if is_typed_key(leaf):  # nnx RngKey variables: {impl, data}, restored exactly
        return key_item(leaf)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        if is_typed_key(leaf):
            _BACKEND.to_host(leaf)  # raises, naming JaxRngRecord
        return capture_tensor(leaf)  # a ShardedTensor for an array spanning other processes
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return leaf
    raise TypeError(f"pytree leaf of type {type(leaf).__name__} cannot be recorded")


def _dtype(leaf: Any) -> Any:
    return leaf.dtype if is_array_like(leaf) else np.asarray(leaf).dtype


def _expected(leaves: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], DType]]:
    return {k: (tuple(np.shape(v)), DType.from_numpy(_dtype(v)))
            for k, v in leaves.items() if not isinstance(v, (bool, int, float, str)) and v is not None
            and not is_typed_key(v)}


def _rebuild(live: dict[str, Any], treedef: Any, recorded: dict[str, Item], device: Any) -> Any:
    """A new tree of the live structure whose leaves are the recorded values, each of its
    recorded dtype (`restored_dtype`) placed as its live leaf is: a live array's sharding,
    an abstract leaf's (`jax.ShapeDtypeStruct`) sharding, else `device` for an abstract
    leaf without one; a host (numpy) leaf stays on the host."""
    new: list[Any] = []
    dev = None
    for name, leaf in live.items():
        value = recorded[name]
        if is_typed_key(leaf):
            new.append(key_from_item(value, leaf, name))
        elif isinstance(value, TensorData):
            if is_array_like(leaf):
                if dev is None and sharding_of(leaf) is None:
                    dev = _BACKEND.device(device)
                new.append(place_tensor(value, leaf, dev, restored_dtype(value, name), name))
            else:
                new.append(np.array(value.array, copy=True))
        else:
            new.append(value)
    return jax.tree_util.tree_unflatten(treedef, new)


def _placements(leaves: list[Any], ids: Iterable[str]) -> dict[str, Any]:
    return {pid: s for pid, s in ((pid, sharding_of(v)) for pid, v in zip(ids, leaves)) if s is not None}


def _check_tree(item: Item, live: dict[str, Any], component: str) -> dict[str, Item]:
    if not isinstance(item, dict):
        raise RecordMismatchError("expected a map of leaves", key=component)
    tensors = {k: v for k, v in item.items() if isinstance(v, TensorData)}
    scalars = {k: v for k, v in item.items() if not isinstance(v, TensorData)}
    expected = _expected(live)
    check_tensor_map(tensors, expected, component, allow_subset=True, keep_dtype=False)
    for k, v in tensors.items():  # what JAX cannot hold (64-bit without x64) is refused now
        if k in live and is_array_like(live[k]):
            restored_dtype(v, f"{component}.{k}")
    missing = [k for k in live if k not in item]
    wrong = [k for k in scalars if k not in live or k in expected]
    if missing or wrong:
        raise RecordMismatchError(
            f"structure differs from the live pytree: missing {missing}, unexpected {wrong}",
            key=component)
    problems = [p for k, v in scalars.items() for p in
                (key_problems(v, live[k], k) if is_typed_key(live[k]) else kind_mismatches(v, _host(live[k]), k))]
    if problems:
        raise RecordMismatchError("; ".join(problems), key=component)
    return dict(item)


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


def _as_module(module: Any) -> JaxModule:
    """`module`, or the `JaxModule` this adapter binds it to (an `nnx.Module`, an `eqx.Module`)."""
    bound = module if isinstance(module, JaxModule) else ADAPTER.adapt(module)
    if not isinstance(bound, JaxModule):
        raise TypeError(f"module must be a JaxModule, an nnx.Module or an eqx.Module, got {type(module).__name__}")
    return bound


def grads_from(grad_tree: Any, module: Any) -> GradientsParams:
    """Gradients by ParamId from a gradient pytree shaped like the module's trainable
    tree (`jax.grad` of a loss of `variables["params"]`) or like the whole module, in
    any container: dict, flax `FrozenDict`, nnx `State` or `nnx.to_pure_dict`'s dicts.
    `module` may be the `nnx.Module` or `eqx.Module` itself (`nnx.grad`'s `State`,
    `eqx.filter_grad`'s module-shaped tree). Raises `ValueError` when `grad_tree` has
    leaves of which none is for a parameter of `module`.

    A training loop calls this every micro-step, so the ParamIds are worked out once per
    gradient tree structure (a treedef fixes every key path, as `_param_ids` caches the
    module's) and checked against the module then; a later tree of that structure is
    named without walking the module again (`accumulate`, `adopt` and `to_tree` refuse
    gradients none of which is for their module all the same)."""
    module = _as_module(module)
    leaves, treedef = jax.tree_util.tree_flatten(grad_tree)
    prefix = module._trainable_prefix()
    key = (treedef, prefix)
    names = _GRAD_IDS.get(key)
    if names is None:
        names = _grad_names(grad_tree, set(module.param_ids()), prefix)
        if len(_GRAD_IDS) >= 256:
            _GRAD_IDS.clear()
        _GRAD_IDS[key] = names
    return GradientsParams(dict(zip(names, leaves)))


_GRAD_IDS: dict[tuple[Any, str], tuple[str, ...]] = {}


def _grad_names(grad_tree: Any, ids: set[str], prefix: str) -> tuple[str, ...]:
    """The ParamIds of `grad_tree`'s leaves in pytree order: their key paths, under the
    module's trainable `prefix` when that names more of the module's parameters."""
    names = list(flatten(grad_tree)[0])
    if prefix:
        qualified = [f"{prefix}.{k}" for k in names]
        if sum(k in ids for k in qualified) > sum(k in ids for k in names):
            names = qualified
    if names and not ids.intersection(names):
        raise ValueError(
            f"none of the gradient tree's {len(names)} leaves is a parameter of the module: "
            f"leaves {sorted(names)[:3]}, module parameters {sorted(ids)[:3]}"
        )
    return tuple(names)


def to_tree(grads: GradientsParams, module: Any, *, allow_empty: bool = False) -> Any:
    """A pytree shaped like the module's trainable tree, holding `grads` (zeros for
    parameters without a gradient), as optax's `update` expects.

    A tree of zeros would train on nothing: empty `grads` (an accumulator's `grads()` taken
    twice, or before any `accumulate`) raise `ValueError` unless `allow_empty=True`, and
    non-empty `grads` of which none is for a parameter of the module always raise, naming
    a few of each. Gradients of ParamIds the module lacks are otherwise ignored."""
    if not isinstance(grads, GradientsParams):
        raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
    module = _as_module(module)
    if grads.is_empty() and not allow_empty:
        raise ValueError(
            "grads is empty: the tree would be all zeros and the update would train on nothing "
            "(was acc.grads() already taken this window?); pass allow_empty=True for zeros"
        )
    leaves, treedef = flatten(module.trainable())
    prefix = module._trainable_prefix()
    ids = [f"{prefix}.{k}" if prefix else k for k in leaves]
    if not grads.is_empty() and not any(pid in grads for pid in ids):
        raise ValueError(
            f"none of the {len(grads)} gradients is for a parameter of the module: gradients "
            f"for {_some(grads)}, module parameters {_some(ids)}; the tree would be all zeros "
            "(name gradients by the module's ParamIds: grads_from(tree, module) does)"
        )
    out = []
    for pid, v in zip(ids, leaves.values()):
        g = grads.get(pid)
        if g is not None and tuple(getattr(g, "shape", ())) != tuple(v.shape):
            raise ValueError(f"gradient of {pid!r} has shape {tuple(getattr(g, 'shape', ()))}, parameter "
                             f"{tuple(v.shape)} (gradients of another model?)")
        out.append(jnp.zeros_like(v) if g is None else g)
    return jax.tree_util.tree_unflatten(treedef, out)


def _some(ids: Iterable[str], n: int = 3) -> str:
    names = list(ids)
    shown = ", ".join(repr(k) for k in names[:n])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > n else ''}]"


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
