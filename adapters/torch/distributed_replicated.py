"""What of a data-parallel `TrainingRecord` is replicated (written once, by rank 0) and
what is a rank's own (pending gradients, caller state), and the leaves of the replicated
part where a rank differs from rank 0, found by per-leaf digests and written as that
rank's overrides.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trainrec import CorruptRecordError, TensorData
from trainrec.adapter_kit import Item

_TRAINING = "TrainingRecord"
_TORCH_MODULE = "torch.nn.Module"

Path_ = tuple[str | int, ...]


def _split(item: Item, record_type: str) -> tuple[dict[str, Item] | None, dict[str, Item]]:
    """(replicated part or None, this rank's part). A `TrainingRecord`'s model state,
    optimizer and scheduler are replicated; the model's pending `.grad`, the accumulator's
    pending gradients and the caller state are the rank's. Any other record is the rank's
    whole."""
    if record_type != _TRAINING or not isinstance(item, list) or len(item) != 5:
        return None, {"item": item}
    model, optimizer, scheduler, grads, state = item
    model_grads: Item = None
    if isinstance(model, dict) and model.get("kind") == _TORCH_MODULE:
        inner = model.get("state")
        if isinstance(inner, dict) and "grads" in inner:
            model_grads = inner["grads"]
            model = {**model, "state": {**inner, "grads": {}}}
    return ({"model": model, "optimizer": optimizer, "scheduler": scheduler},
            {"model_grads": model_grads, "grads": grads, "state": state})


def _merge(rep: dict[str, Item], local: dict[str, Item], source: Path) -> Item:
    if set(rep) != {"model", "optimizer", "scheduler", "save_id"} or not {
            "model_grads", "grads", "state", "overrides"} <= set(local):
        raise CorruptRecordError("a part of a distributed TrainingRecord lacks components",
                                 source=str(source))
    tree: Item = {k: rep[k] for k in ("model", "optimizer", "scheduler")}
    overrides = local["overrides"]
    if not isinstance(overrides, list):
        raise CorruptRecordError("overrides must be a list", source=str(source))
    for entry in overrides:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and all(isinstance(k, str) or type(k) is int for k in entry[0])):
            raise CorruptRecordError("an override must be [path of keys and indices, value]",
                                     source=str(source))
        at: Path_ = tuple(k for k in entry[0] if isinstance(k, (str, int)))
        tree = _set(tree, at, entry[1], at, source)
    if not (isinstance(tree, dict) and {"model", "optimizer", "scheduler"} <= set(tree)):
        raise CorruptRecordError("the overrides leave no model, optimizer and scheduler",
                                 source=str(source))
    model = tree["model"]
    if local["model_grads"] is not None:
        if not (isinstance(model, dict) and isinstance(model.get("state"), dict)):
            raise CorruptRecordError("the replicated model holds no state map", source=str(source))
        model = {**model, "state": {**model["state"], "grads": local["model_grads"]}}  # type: ignore[dict-item]
    return [model, tree["optimizer"], tree["scheduler"], local["grads"], local["state"]]


def _leaves(item: Item, at: Path_ = ()) -> list[tuple[Path_, Item]]:
    """Every leaf (tensor, scalar, empty container) with its path of keys and indices."""
    if isinstance(item, dict) and item:
        return [leaf for k, v in item.items() for leaf in _leaves(v, (*at, k))]
    if isinstance(item, list) and item:
        return [leaf for i, v in enumerate(item) for leaf in _leaves(v, (*at, i))]
    return [(at, item)]


def _digest(leaf: Item) -> bytes:
    """SHA-1 of a leaf's kind, dtype, shape and bytes: told apart from rank 0's to find
    accidental divergence, not forgery (SHA-1 is hardware-accelerated on most CPUs and
    releases the GIL, so tensors are hashed on several threads)."""
    h = hashlib.sha1(usedforsecurity=False)
    if isinstance(leaf, TensorData):
        h.update(f"T{leaf.dtype.value}{leaf.shape}".encode())
        h.update(np.ascontiguousarray(leaf.array).reshape(-1).view(np.uint8).data)
    else:
        h.update(f"{type(leaf).__name__}:{leaf!r}".encode())
    return h.digest()


def _digests(replicated: dict[str, Item]) -> tuple[bytes, list[bytes]]:
    """(digest of the tree's structure, digest of each leaf in order)."""
    leaves = _leaves(replicated)
    shape = hashlib.sha1(repr([p for p, _ in leaves]).encode(), usedforsecurity=False).digest()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return shape, list(pool.map(_digest, [v for _, v in leaves]))


def _overrides(replicated: dict[str, Item], ours: Any, theirs: Any) -> Item:
    """The leaves of this rank's replicated state that differ from rank 0's, as
    `[[path...], value]` pairs; the whole tree at the root path when its structure differs."""
    if ours == theirs:
        return []
    if ours[0] != theirs[0]:
        return [[[], dict(replicated)]]
    return [[list(p), v] for (p, v), a, b in zip(_leaves(replicated), ours[1], theirs[1]) if a != b]


def _set(tree: Item, at: Path_, value: Item, whole: Path_, source: Path) -> Item:
    """`tree` with the node at `at` replaced by `value` (`whole`: the override's path)."""
    if not at:
        return value
    head, rest = at[0], at[1:]
    if isinstance(tree, dict) and isinstance(head, str) and head in tree:
        return {**tree, head: _set(tree[head], rest, value, whole, source)}
    if isinstance(tree, list) and type(head) is int and 0 <= head < len(tree):
        return [*tree[:head], _set(tree[head], rest, value, whole, source), *tree[head + 1:]]
    raise CorruptRecordError(f"an override's path {list(whole)!r} is not in the replicated state",
                             source=str(source))
