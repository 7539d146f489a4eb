"""Item trees: the serializable form of every record, and the one walker over them.

An item is `None`, `bool`, `int` (fits in 64 bits), `float`, `str`, `bytes`,
`TensorData`, a `list` of items or a `dict` with `str` keys of items. Recorders move
items to bytes and back; records convert themselves to and from items.

Walking a tree: `walk` (every node, containers before their contents), `walk_pairs` (two
trees side by side) and `map_tree` (a new tree, contents before their container) are the
only walks; `path_of`, `iter_tensors`, `map_leaves`, `map_tensors`, `check_item` and
`compare_items` are built on them. All three visit maps in insertion order and lists by
index, descend only into `dict` and `list` (anything else is a leaf, `TensorData`
included) and name each node by its dotted key path (`join_key`): `"model.layers.0"`,
`""` for the root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Union

import numpy as np

from ..errors import CorruptRecordError
from .tensor import TensorData

__all__ = [
    "Item",
    "TENSOR_KEY",
    "check_item",
    "compare_items",
    "iter_tensors",
    "join_key",
    "map_leaves",
    "map_tensors",
    "map_tree",
    "path_of",
    "walk",
    "walk_pairs",
]

Item = Union[None, bool, int, float, str, bytes, TensorData, list["Item"], dict[str, "Item"]]  # noqa: UP007 - a runtime alias with forward references

TENSOR_KEY = "__tensor__"
"""Reserved map key marking a tensor in the NamedMpk format; item dicts may not use it."""

_INT_MIN = -(2**63)
_UINT_MAX = 2**64 - 1
_MAX_DEPTH = 256


def join_key(prefix: str, key: str | int) -> str:
    """The key path of `key` under `prefix`: `"a.b"`, or `"b"` under the root."""
    return f"{prefix}.{key}" if prefix else str(key)


def walk(item: Any, prefix: str = "", *, paths: bool = True) -> Iterator[tuple[str, Any, int]]:
    """`(path, node, depth)` for every node of `item` (the root at depth 0), depth first,
    each container before its contents.

    A container's contents are read when the walk moves past it, so the caller may
    change them (or raise) when the container is yielded. Takes any object (only dict
    and list are descended into) and keeps no recursion: a check may walk a tree it has
    not validated yet, bounding the depth itself (`check_item`). `paths=False` gives
    every node the path `""` and walks about a third faster, for checks that name a key
    only when one fails (`path_of` then finds it)."""
    stack: list[tuple[str, Any, int]] = [(prefix, item, 0)]
    pop, push = stack.pop, stack.extend
    while stack:
        node = pop()
        yield node
        path, value, depth = node
        # key paths written out, not `join_key` calls: every save walks its tree several times
        if isinstance(value, dict):
            if paths:
                above = f"{path}." if path else ""
                push([(f"{above}{k}", v, depth + 1) for k, v in reversed(value.items())])
            else:
                push([("", v, depth + 1) for v in reversed(value.values())])
        elif isinstance(value, list):
            if paths:
                above = f"{path}." if path else ""
                push([(f"{above}{i}", value[i], depth + 1) for i in range(len(value) - 1, -1, -1)])
            else:
                push([("", v, depth + 1) for v in reversed(value)])


def path_of(item: Any, node: Any, depth: int, prefix: str = "") -> str:
    """The key path of `node` (the object itself), met at `depth` by `walk(item, prefix)`:
    of the first such node in walk order, which is the one a check that depends only on
    the node and its depth fails at first."""
    return next(path for path, n, d in walk(item, prefix) if n is node and d == depth)


def walk_pairs(a: Any, b: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """`(path, x, y)` for the nodes of `a` and `b` at the same key path, depth first in
    `a`'s order. Descends where both are dicts with the same keys or both lists of the
    same length; yields every other pair: leaves, and nodes whose kinds, keys or lengths
    differ (whose contents are then not walked)."""
    stack: list[tuple[str, Any, Any]] = [(prefix, a, b)]
    while stack:
        path, x, y = stack.pop()
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            stack.extend((join_key(path, k), v, y[k]) for k, v in reversed(x.items()))
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            stack.extend((join_key(path, i), x[i], y[i]) for i in range(len(x) - 1, -1, -1))
        else:
            yield path, x, y


def map_tree(item: Any, fn: Callable[[str, Any], Any], prefix: str = "") -> Any:
    """A new tree: `fn(path, node)` for every node, contents before their container,
    which `fn` gets as a new dict or list of what it returned for the contents (so `fn`
    may replace a whole subtree, or turn containers into something else). Leaves are
    passed as they are; the containers of `item` are never changed."""
    return _rebuild(item, fn, fn, prefix)


def map_leaves(item: Any, fn: Callable[[str, Any], Any], prefix: str = "") -> Any:
    """A new tree of the same dicts and lists with `fn(path, leaf)` for every leaf."""
    return _rebuild(item, fn, None, prefix)


def _rebuild(item: Any, leaf: Callable[[str, Any], Any],
             container: Callable[[str, Any], Any] | None, path: str) -> Any:
    if isinstance(item, dict):
        above = f"{path}." if path else ""
        new: Any = {k: _rebuild(v, leaf, container, f"{above}{k}") for k, v in item.items()}
    elif isinstance(item, list):
        above = f"{path}." if path else ""
        new = [_rebuild(v, leaf, container, f"{above}{i}") for i, v in enumerate(item)]
    else:
        return leaf(path, item)
    return new if container is None else container(path, new)


def iter_tensors(item: Item, prefix: str = "") -> Iterator[tuple[str, TensorData]]:
    """Every tensor in the tree with its dotted key path, depth first, in order."""
    return ((path, v) for path, v, _ in walk(item, prefix) if isinstance(v, TensorData))


def map_tensors(item: Item, fn: Callable[[str, TensorData], TensorData], prefix: str = "") -> Item:
    """A new tree with `fn(path, tensor)` in place of every tensor; other leaves are shared."""
    return map_leaves(item, lambda path, v: fn(path, v) if isinstance(v, TensorData) else v, prefix)  # type: ignore[no-any-return]


def check_item(item: object, prefix: str = "", *, source: str = "", depth: int = 0) -> Item:
    """`item` itself when it is a well-formed item tree; raises `CorruptRecordError`
    naming the first offending key otherwise (tuples are not accepted: use lists)."""
    for _, node, below in walk(item, prefix, paths=False):
        if depth + below > _MAX_DEPTH:
            problem = "item tree nested too deeply"
        elif node is None or isinstance(node, (bool, float, str, bytes, TensorData, list)):
            continue
        elif isinstance(node, int):
            if _INT_MIN <= node <= _UINT_MAX:
                continue
            problem = f"integer {node} does not fit in 64 bits"
        elif isinstance(node, dict):
            for k in node:
                if not isinstance(k, str):
                    problem = f"item keys must be str, got {type(k).__name__}"
                    break
                if k == TENSOR_KEY:
                    problem = f"the key {TENSOR_KEY!r} is reserved for tensors"
                    break
            else:
                continue
        else:
            problem = (f"{type(node).__name__} is not an item (None, bool, int, float, str, "
                       "bytes, TensorData, list or dict)")
        raise CorruptRecordError(problem, source=source, key=path_of(item, node, below, prefix))
    return item  # type: ignore[return-value]


def compare_items(a: Item, b: Item, path: str = "") -> tuple[bool, float, list[str]]:
    """(bitwise equal, max |a - b| over float tensors, the key paths that differ): tensors
    by dtype, shape and bytes, other leaves by type and value, dicts by keys, lists by
    length (a path whose keys or length differ counts as an infinite difference)."""
    differing: list[str] = []
    worst = 0.0
    for where, x, y in walk_pairs(a, b, path):
        if isinstance(x, TensorData) and isinstance(y, TensorData):
            if x.shape != y.shape or x.dtype is not y.dtype:
                differing.append(where)
                worst = float("inf")
            elif x.array.tobytes() != y.array.tobytes():
                differing.append(where)
                if x.dtype.is_float and x.numel:
                    gap = np.abs(x.array.astype(np.float64) - y.array.astype(np.float64))
                    worst = max(worst, float(np.nanmax(gap)))
        elif isinstance(x, (dict, list)) or isinstance(y, (dict, list)):
            differing.append(where)  # another kind, other keys or another length
            worst = float("inf")
        elif type(x) is not type(y) or repr(x) != repr(y):
            differing.append(where)
    return not differing, worst, differing
