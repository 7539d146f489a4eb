"""A pytree's leaves as record items and back: each leaf captured (`_host`), a record's
leaves checked against the live tree's (`_check_tree`), and a new tree of the live
structure built from them, each leaf of its recorded dtype placed as its live leaf is
(`_rebuild`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from trainrec import DType, RecordMismatchError, TensorData
from trainrec.adapter_kit import Item, check_tensor_map, kind_mismatches

from .backend import _BACKEND
from .placement import (
    abstract_error,
    capture_tensor,
    is_abstract,
    is_array_like,
    place_tensor,
    restored_dtype,
    sharding_of,
)
from .rng import is_typed_key, key_from_item, key_item, key_problems


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
