"""Torch state values as record items and back: tensors (through the backend), tuples and
the other values an optimizer's or scheduler's state dict holds; and a component's kind name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainrec import TensorData
from trainrec.adapter_kit import Item, join_key

from .backend import TorchBackend, numpy_to_tensor

_BACKEND = TorchBackend()
_PAIRS = "__pairs__"


# -- plain Python values of state_dicts <-> items -----------------------------------------


def encode(value: Any, key: str = "") -> Item:
    """A state_dict value as an item: tensors become host copies, tuples lists, dicts with
    non-str keys (MultiStepLR's Counter) `{"__pairs__": [[k, v], ...]}`."""
    if isinstance(value, torch.Tensor):
        return TensorData.from_array(_BACKEND.to_host(value), copy=False)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v, join_key(key, i)) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, join_key(key, k)) for k, v in value.items()}
        return {_PAIRS: [[encode(k, key), encode(v, join_key(key, str(k)))] for k, v in value.items()]}
    raise TypeError(
        f"state value {type(value).__qualname__} at {key or 'root'!r} is not data trainrec can "
        "record (tensors, numbers, str, bytes, None, lists, tuples, dicts)"
    )


def decode(item: Item, like: Any = None) -> Any:
    """The inverse of `encode`; `like` (the live value, when known) restores tuples and
    dict subclasses such as `Counter`. Tensors come back as CPU tensors."""
    if isinstance(item, TensorData):
        return numpy_to_tensor(item.array)
    if isinstance(item, list):
        template = list(like) if isinstance(like, (list, tuple)) and len(like) == len(item) else [None] * len(item)
        out = [decode(v, t) for v, t in zip(item, template)]
        return tuple(out) if isinstance(like, tuple) else out
    if isinstance(item, dict):
        raw_pairs = item.get(_PAIRS)
        if set(item) == {_PAIRS} and isinstance(raw_pairs, list):
            pairs = [(decode(p[0]), p[1]) for p in raw_pairs if isinstance(p, list) and len(p) == 2]
            d: dict[Any, Any] = {k: decode(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in pairs}
        else:
            d = {k: decode(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in item.items()}
        if isinstance(like, dict) and type(like) is not dict:
            return type(like)(d)
        return d
    return item


# -- optimizer ----------------------------------------------------------------------------


def _kind(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
