"""Item trees: the serializable form of every record.

An item is `None`, `bool`, `int` (fits in 64 bits), `float`, `str`, `bytes`,
`TensorData`, a `list` of items or a `dict` with `str` keys of items. Recorders move
items to bytes and back; records convert themselves to and from items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Union

from .errors import CorruptRecordError
from .tensor import TensorData

__all__ = ["Item", "TENSOR_KEY", "iter_tensors", "map_tensors", "check_item", "join_key"]

Item = Union[None, bool, int, float, str, bytes, TensorData, list["Item"], dict[str, "Item"]]  # noqa: UP007 - a runtime alias with forward references

TENSOR_KEY = "__tensor__"
"""Reserved map key marking a tensor in the NamedMpk format; item dicts may not use it."""

_INT_MIN = -(2**63)
_UINT_MAX = 2**64 - 1


def join_key(prefix: str, key: str | int) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def iter_tensors(item: Item, prefix: str = "") -> Iterator[tuple[str, TensorData]]:
    """Every tensor in the tree with its dotted key path, depth first, in order."""
    if isinstance(item, TensorData):
        yield prefix, item
    elif isinstance(item, dict):
        for k, v in item.items():
            yield from iter_tensors(v, join_key(prefix, k))
    elif isinstance(item, list):
        for i, v in enumerate(item):
            yield from iter_tensors(v, join_key(prefix, i))


def map_tensors(item: Item, fn: Callable[[str, TensorData], TensorData], prefix: str = "") -> Item:
    """A new tree with `fn(path, tensor)` in place of every tensor; other leaves are shared."""
    if isinstance(item, TensorData):
        return fn(prefix, item)
    if isinstance(item, dict):
        return {k: map_tensors(v, fn, join_key(prefix, k)) for k, v in item.items()}
    if isinstance(item, list):
        return [map_tensors(v, fn, join_key(prefix, i)) for i, v in enumerate(item)]
    return item


def check_item(item: object, prefix: str = "", *, source: str = "", depth: int = 0) -> Item:
    """`item` itself when it is a well-formed item tree; raises `CorruptRecordError`
    naming the first offending key otherwise (tuples are not accepted: use lists)."""
    if depth > 256:
        raise CorruptRecordError("item tree nested too deeply", source=source, key=prefix)
    if item is None or isinstance(item, (bool, float, str, bytes, TensorData)):
        return item
    if isinstance(item, int):
        if not _INT_MIN <= item <= _UINT_MAX:
            raise CorruptRecordError(
                f"integer {item} does not fit in 64 bits", source=source, key=prefix
            )
        return item
    if isinstance(item, list):
        for i, v in enumerate(item):
            check_item(v, join_key(prefix, i), source=source, depth=depth + 1)
        return item
    if isinstance(item, dict):
        for k, v in item.items():
            if not isinstance(k, str):
                raise CorruptRecordError(
                    f"item keys must be str, got {type(k).__name__}", source=source, key=prefix
                )
            if k == TENSOR_KEY:
                raise CorruptRecordError(
                    f"the key {TENSOR_KEY!r} is reserved for tensors", source=source, key=prefix
                )
            check_item(v, join_key(prefix, k), source=source, depth=depth + 1)
        return item
    raise CorruptRecordError(
        f"{type(item).__name__} is not an item (None, bool, int, float, str, bytes, "
        "TensorData, list or dict)",
        source=source,
        key=prefix,
    )
