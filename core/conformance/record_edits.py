"""Where the conformance suite finds parameters in a record, and how it edits them: the
map of an optimizer record keyed by parameters (`_param_keyed`), each parameter's key
path in a model record (`_located`), and copies of a record with one value replaced,
added or removed (`_edited`, `_replace_first`, `_with_unknown_param`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors, map_leaves, map_tree, walk
from .contract import _expect


def _param_keyed(item: Item, ids: set[str]) -> dict[str, Item] | None:
    """The first map in an optimizer record whose keys name parameters (ParamIds, or key
    paths ending in one without its collection prefix)."""
    tails = {i.split(".", 1)[1] for i in ids if "." in i}
    for _, node, _ in walk(item):
        if isinstance(node, dict) and any(k in ids or any(k.endswith("." + t) for t in tails) for k in node):
            return node
    return None


def _copy(item: Item) -> Item:
    """New maps and lists all the way down; leaves are shared."""
    return map_tree(item, lambda _, node: node)  # type: ignore[no-any-return]


def _replace_first(item: Item, found: Callable[[Item], bool],
                   make: Callable[[Any], Item]) -> tuple[Item, str | None]:
    """A copy of `item` whose first leaf (depth first) for which `found` holds is
    `make(leaf)`, and that leaf's dotted key path (None when no leaf matched)."""
    hit: list[str] = []

    def swap(path: str, leaf: Item) -> Item:
        if not hit and found(leaf):
            hit.append(path)
            return make(leaf)
        return leaf

    return map_leaves(item, swap), (hit[0] if hit else None)


def _with_unknown_param(optimizer_state: Item, m: Any) -> bool:
    """Adds state for an unknown parameter (`no.such.param`) beside an existing
    parameter's; False when the record holds no per-parameter state (no tensor shaped like
    a parameter). A record that holds such tensors, but in no map keyed by ParamId, breaks
    the layout the suite reads (spec/ADAPTERS.md section 6)."""
    known = set(m.param_ids())
    keyed = _param_keyed(optimizer_state, known)
    if keyed is None:
        shapes = {tuple(s) for s in m.param_shapes().values() if int(np.prod(s)) > 1}
        buffers = [p for p, t in iter_tensors(optimizer_state) if tuple(t.shape) in shapes]
        _expect(not buffers, "optimizer.into_record",
                "keys per-parameter state by ParamId: the suite looks for it in a map whose keys are "
                "ParamIds (or key paths ending in one), anywhere in the record (spec/ADAPTERS.md "
                f"section 6); the record holds tensors shaped like parameters ({', '.join(buffers[:3])}) "
                "but no such map")
        return False
    key = next(k for k in keyed if k in known or any(k.endswith("." + i.split(".", 1)[-1]) for i in known))
    tail = next((i.split(".", 1)[-1] for i in known if key != i and key.endswith("." + i.split(".", 1)[-1])), None)
    keyed["no.such.param" if tail is None else key[: -len(tail)] + "no_such_param"] = keyed[key]
    return True


Key = str | int


def _leaves(item: Item, keys: tuple[Key, ...] = ()) -> list[tuple[tuple[Key, ...], TensorData]]:
    """Every tensor of `item` with its keys from the root, in record order."""
    if isinstance(item, TensorData):
        return [(keys, item)]
    children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
    return [found for k, v in children for found in _leaves(v, (*keys, k))]


def _located(state: Item, m: Any) -> dict[str, tuple[Key, ...]]:
    """Where each parameter of the module is in its record's state: the keys of the first
    tensor of its shape whose dotted key path is its ParamId, else ends in `.ParamId`
    (`layers.0.weight` at the top level, or under `tensors`, or nested as maps). The layout
    the suite reads (spec/ADAPTERS.md section 6): a record with none of its parameters so
    fails, naming it."""
    shapes = {pid: tuple(s) for pid, s in m.param_shapes().items()}
    leaves = [(".".join(map(str, keys)), keys, t) for keys, t in _leaves(state)]
    found: dict[str, tuple[Key, ...]] = {}
    for pid, shape in shapes.items():
        for exact in (True, False):
            hit = next((keys for dotted, keys, t in leaves if tuple(t.shape) == shape and (
                dotted == pid if exact else dotted.endswith("." + pid))), None)
            if hit is not None:
                found[pid] = hit
                break
    missing = [pid for pid in shapes if pid not in found]
    _expect(not missing, "model.into_record",
            "holds each parameter as a tensor of its shape at a key path that is its ParamId or ends in "
            "`.ParamId` (`w`, `tensors.w` or `params.dense.w` for `w`; spec/ADAPTERS.md section 6, the "
            f"layout the suite damages records in); not found: {', '.join(missing[:3])}")
    return found


def _at(item: Item, keys: tuple[Key, ...]) -> Any:
    for k in keys:
        item = item[k]  # type: ignore[index]
    return item


def _edited(item: Item, keys: tuple[Key, ...], value: Item | None) -> Item:
    """A copy of `item` (new maps and lists, leaves shared) whose node at `keys` is `value`,
    or is deleted for None."""
    out = _copy(item)
    parent = _at(out, keys[:-1])
    if value is None:
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = value
    return out
