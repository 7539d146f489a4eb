"""The array leaves of a native JAX model (flax nnx, equinox) as a record, and back.

Leaves are given by ParamId (`bindings.flatten`). An array leaf is recorded as a tensor;
a typed PRNG key array (`jax.random.key`, nnx `RngKey` values) as the key item every
JAX record uses (`rng.key_item`: `{"impl": NAME, "data": uint32 tensor}`, as in
`JaxRngRecord` and `JaxModule`), restored with its implementation. Records written
before that form was shared (nnx and equinox keys as bare key data, their
implementations under `#rng_impl`) are read as key items. A restore checks every leaf
first (names, shapes, dtype kinds, key implementations) and gives new leaves of the
recorded dtypes (the live leaves are templates: an nnx optimizer's bf16 moments may
have been f32 when saved), placed as the live leaves are. A live leaf may be abstract (a
`jax.ShapeDtypeStruct`, as `nnx.eval_shape` / `eqx.filter_eval_shape` give): the new leaf
is placed by its sharding (the restore's device when it has none); capturing one is a
`TypeError`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from trainrec import RecorderError, RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import Item, check_tensor_map, expect_kind

from .backend import _BACKEND
from .placement import (
    DeletedArrayError,
    abstract_error,
    capture_tensor,
    is_abstract,
    is_array_like,
    place_tensor,
    restored_dtype,
    sharding_of,
)
from .rng import is_typed_key, key_from_item, key_item, key_problems
from .trees import _expected

LEGACY_RNG_IMPL_KEY = "#rng_impl"  # the earlier form: {ParamId: implementation name}


def capture(kind: str, leaves: dict[str, Any], hint: str) -> StateRecord:
    """A record of `leaves` (arrays by ParamId). Raises `TypeError` naming the leaf's key
    path and `hint` (how to leave it out) for a leaf no record can hold (a tracer, a
    complex array)."""
    item: dict[str, Item] = {}
    for name, leaf in leaves.items():
        if is_abstract(leaf):
            raise abstract_error(name)
    for name, leaf in leaves.items():
        try:
            item[name] = key_item(leaf, name) if is_typed_key(leaf) else \
                capture_tensor(leaf)  # a ShardedTensor for one spanning processes
        except RecorderError:
            raise
        except DeletedArrayError as e:
            raise ValueError(f"leaf {name!r}: {e}") from e
        except Exception as e:  # TypeError, jax's TracerArrayConversionError
            raise TypeError(f"leaf {name!r} ({type(leaf).__name__}) cannot be recorded: {e}; {hint}") from e
    return StateRecord(kind, item)


def _current(item: dict[str, Item], component: str) -> dict[str, Item]:
    """`item` with the earlier form's keys (key data and `#rng_impl`) as key items."""
    if LEGACY_RNG_IMPL_KEY not in item:
        return item
    impls = item[LEGACY_RNG_IMPL_KEY]
    if not isinstance(impls, dict) or not all(isinstance(v, str) and isinstance(item.get(k), TensorData)
                                              for k, v in impls.items()):
        raise RecordMismatchError("expected a map of key ParamIds to PRNG implementation names",
                                  key=f"{component}.{LEGACY_RNG_IMPL_KEY}")
    out = {k: v for k, v in item.items() if k != LEGACY_RNG_IMPL_KEY}
    out.update({k: {"impl": impl, "data": out[k]} for k, impl in impls.items()})
    return out


def _key_problems(item: dict[str, Item], leaves: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    for name, leaf in leaves.items():
        value = item.get(name)
        if name not in item:
            continue  # reported with the other missing leaves
        if is_typed_key(leaf):
            if isinstance(value, TensorData):
                problems.append(f"{name}: a {value.dtype.value} tensor in the record, a "
                                f"{jax.random.key_impl(leaf)} key array live")
            else:
                problems += key_problems(value, leaf, name)
        elif isinstance(value, dict):
            problems.append(f"{name}: a {value.get('impl')!s} key array in the record, a "
                            f"{getattr(leaf, 'dtype', type(leaf).__name__)} array live")
    return problems


def check(record: Any, kind: str, leaves: dict[str, Any], component: str) -> dict[str, Item]:
    """The record's leaves by ParamId (tensors, and key items for key leaves), once each
    live leaf has one of its shape and dtype kind and every key its implementation;
    else `RecordMismatchError` listing the differences. Mutates nothing."""
    item = expect_kind(record, kind, component)
    if not isinstance(item, dict):
        raise RecordMismatchError("expected a map of leaves", key=component)
    item = _current(item, component)
    problems = _key_problems(item, leaves)
    if problems:
        raise RecordMismatchError("; ".join(problems), key=component)
    keys = [k for k, v in leaves.items() if is_typed_key(v)]
    arrays = {k: v for k, v in item.items() if k not in keys}
    missing_keys = [k for k in keys if k not in item]
    if missing_keys:
        raise RecordMismatchError(f"missing {missing_keys}", key=component)
    tensors: dict[str, Item] = dict(check_tensor_map(arrays, _expected(leaves), component, keep_dtype=False))
    for k, v in tensors.items():  # what JAX cannot hold (64-bit without x64) is refused now
        if is_array_like(leaves[k]):
            assert isinstance(v, TensorData)
            restored_dtype(v, f"{component}.{k}")
    return {**tensors, **{k: item[k] for k in keys}}


def rebuild(leaves: dict[str, Any], recorded: dict[str, Item], device: Any = None) -> dict[str, Any]:
    """New leaves holding the recorded values (`check` first), each of its recorded dtype
    (`restored_dtype`; a key of its live leaf's implementation) placed as its live leaf
    is: its sharding, a live or abstract leaf's; `device` (None: the default device) for
    an abstract leaf without one."""
    out: dict[str, Any] = {}
    dev = None
    for name, leaf in leaves.items():
        value = recorded[name]
        if is_typed_key(leaf):
            out[name] = key_from_item(value, leaf, name)  # placed by the key's sharding
            continue
        assert isinstance(value, TensorData)
        if is_array_like(leaf):
            if dev is None and sharding_of(leaf) is None:  # only an abstract leaf lacks one
                dev = _BACKEND.device(device)
            out[name] = place_tensor(value, leaf, dev, restored_dtype(value, name), name)
        else:
            out[name] = np.array(value.array, copy=True)
    return out
