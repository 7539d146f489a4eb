"""The array leaves of a native JAX model (flax nnx, equinox) as a record, and back.

Leaves are given by ParamId (`bindings.flatten`). An array leaf is recorded as a tensor;
a typed PRNG key array (`jax.random.key`) as its key data (`jax.random.key_data`, uint32),
with its implementation's name under `#rng_impl` (`{ParamId: "threefry2x32"}`), and
restored with `jax.random.wrap_key_data` under that implementation. A restore checks
every leaf first (names, shapes, dtype kinds, key implementations) and gives new leaves
of the live dtypes, placed as the live leaves are. A live leaf may be abstract (a
`jax.ShapeDtypeStruct`, as `nnx.eval_shape` / `eqx.filter_eval_shape` give): the new leaf
is placed by its sharding (the default device when it has none); capturing one is a
`TypeError`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrec import RecorderError, RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import Item, check_tensor_map, expect_kind

from .bindings import _BACKEND, _expected
from .placement import (
    abstract_error,
    capture_tensor,
    is_abstract,
    is_array_like,
    key_data_like,
    key_impl_name,
    place_tensor,
    sharding_of,
)

RNG_IMPL_KEY = "#rng_impl"


def is_key(leaf: Any) -> bool:
    """Whether `leaf` is a typed PRNG key array (`jax.random.key`, nnx `RngKey` values),
    or an abstract one."""
    return is_array_like(leaf) and bool(jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _impls(leaves: dict[str, Any]) -> dict[str, str]:
    return {k: key_impl_name(v) for k, v in leaves.items() if is_key(v)}


def _view(leaves: dict[str, Any]) -> dict[str, Any]:
    """The leaves as plain arrays: a key array as its key data."""
    return {k: key_data_like(v) if is_key(v) else v for k, v in leaves.items()}


def capture(kind: str, leaves: dict[str, Any], hint: str) -> StateRecord:
    """A record of `leaves` (arrays by ParamId). Raises `TypeError` naming the leaf's key
    path and `hint` (how to leave it out) for a leaf no record can hold (a tracer, a
    complex array)."""
    item: dict[str, Item] = {}
    for name, leaf in leaves.items():
        if is_abstract(leaf):
            raise abstract_error(name)
    for name, leaf in _view(leaves).items():
        try:
            item[name] = capture_tensor(leaf)  # a ShardedTensor for one spanning processes
        except RecorderError:
            raise  # an array spanning other processes: host_copy says what to use
        except Exception as e:  # TypeError, jax's TracerArrayConversionError
            raise TypeError(f"leaf {name!r} ({type(leaf).__name__}) cannot be recorded: {e}; {hint}") from e
    impls = _impls(leaves)
    if impls:
        item[RNG_IMPL_KEY] = dict(impls)
    return StateRecord(kind, item)


def check(record: Any, kind: str, leaves: dict[str, Any], component: str) -> dict[str, TensorData]:
    """The record's tensors by ParamId, once each live leaf has one of its shape and dtype
    kind and every key its implementation; else `RecordMismatchError` listing every
    difference. Mutates nothing."""
    item = expect_kind(record, kind, component)
    if not isinstance(item, dict):
        raise RecordMismatchError("expected a map of leaves", key=component)
    recorded = item.get(RNG_IMPL_KEY, {})
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise RecordMismatchError("expected a map of PRNG implementation names",
                                  key=f"{component}.{RNG_IMPL_KEY}")
    live = _impls(leaves)
    if recorded != live:
        raise RecordMismatchError(f"PRNG key implementations differ: the record has {recorded}, "
                                  f"the live {component} {live}", key=component)
    tensors = {k: v for k, v in item.items() if k != RNG_IMPL_KEY}
    return check_tensor_map(tensors, _expected(_view(leaves)), component)


def rebuild(leaves: dict[str, Any], tensors: dict[str, TensorData], device: Any = None) -> dict[str, Any]:
    """New leaves holding `tensors`, each with its live leaf's dtype (key implementation)
    and placement: its sharding, a live or abstract leaf's; `device` (None: the default
    device) for an abstract leaf without one (`check` first)."""
    out: dict[str, Any] = {}
    dev = None
    for name, leaf in leaves.items():
        like = key_data_like(leaf) if is_key(leaf) else leaf
        if is_array_like(leaf):
            if dev is None and sharding_of(leaf) is None:  # only an abstract leaf lacks one
                dev = _BACKEND.device(device)
            # a key's sharding lays out its key data too
            value: Any = place_tensor(tensors[name], leaf, dev, like.dtype)
            out[name] = jax.random.wrap_key_data(value, impl=key_impl_name(leaf)) if is_key(leaf) else value
        else:
            out[name] = np.asarray(tensors[name].array).astype(like.dtype)
    return out
