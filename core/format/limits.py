"""The limits NamedMpk writers and readers share (`Limits`, one set for both sides, so what
saves also loads), the payload alignment and chunking, and what a decoded value costs
against the object budget (`Limits.object_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import (
    CorruptRecordError,
)
from ..items.tensor import TensorData
from ..items.tree import Item, path_of, walk

__all__ = ["ALIGNMENT", "Limits", "check_limits"]

ALIGNMENT = 64
CHUNK_BYTES = 2**31
"""Payloads longer than this are written as an array of `bin` chunks (bin32 holds < 4 GiB)."""
MIN_CHUNK_BYTES = 1 << 20
"""Readers refuse a chunked payload whose chunks but the last hold fewer bytes, or whose last
chunk is empty (writers cut at `CHUNK_BYTES`)."""


@dataclass(frozen=True)
class Limits:
    """Bounds the reader enforces before allocating (see spec/FORMAT.md, "Limits"). The
    writer enforces the same ones, so nothing that saves fails to load."""

    max_header_bytes: int = 1 << 20
    max_depth: int = 64
    max_str_bytes: int = 16 << 20
    max_dims: int = 32
    object_bytes: int = 16 << 20
    """The object budget: decoded values (containers, scalars, tensor objects: their
    CPython size as `_cost` estimates it) may take this many bytes ..."""
    object_bytes_per_byte: int = 8
    """... plus this many per byte of the document. A document that needs more is refused
    as soon as it does, so a load's memory and time stay proportional to its size."""

    def object_budget(self, size: int) -> int:
        """The object budget of a document of `size` bytes."""
        return self.object_bytes + self.object_bytes_per_byte * size


def check_limits(
    item: Item, limits: Limits | None = None, *, depth: int = 1, tensor_depth: int = 2,
    source: str = "",
) -> None:
    """Raise `CorruptRecordError` naming the key when a reader bounded by `limits` would
    refuse `item`: nesting deeper than `max_depth`, a str (value or map key) longer than
    `max_str_bytes` in UTF-8, a tensor of more than `max_dims` dimensions.

    How deep a value sits is the format's: `depth` is the level of `item` itself
    (NamedMpk: 1, under the top-level map) and a tensor with a non-empty shape takes
    `tensor_depth` levels below its own (NamedMpk: its map's fields, then the shape's
    elements; a 0-d tensor one fewer). `check_item(item)` must have passed."""
    lim = limits or Limits()

    def fail(message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(f"{message}: it would save but never load", source=source, key=key)

    def too_long(s: str) -> str:
        if len(s) > lim.max_str_bytes // 4 and len(s.encode("utf-8")) > lim.max_str_bytes:
            return (f"string of {len(s.encode('utf-8'))} bytes is longer than readers accept "
                    f"(Limits.max_str_bytes = {lim.max_str_bytes})")
        return ""

    for _, node, below in walk(item, paths=False):
        level = depth + below
        if isinstance(node, TensorData):
            level += tensor_depth if node.shape else max(0, tensor_depth - 1)
        if level > lim.max_depth:
            problem = (f"nested {level} levels deep, more than readers accept "
                       f"(Limits.max_depth = {lim.max_depth})")
        elif isinstance(node, TensorData):
            if len(node.shape) <= lim.max_dims:
                continue
            problem = (f"tensor of {len(node.shape)} dimensions, more than readers accept "
                       f"(Limits.max_dims = {lim.max_dims})")
        elif isinstance(node, str):
            problem = too_long(node)
        elif isinstance(node, dict):
            problem = next(filter(None, map(too_long, node)), "")
        else:
            continue
        if problem:
            raise fail(problem, path_of(item, node, below))


# -- the object budget (Limits.object_bytes): what a decoded value costs, estimated as
# CPython's sizes; the writer charges the same amounts for what it writes (`_Writer.cost`),
# so a document that saves also loads.

_SHARED_STR_BYTES = 32
"""The reader decodes a str this short once and shares it; only the first is charged."""
_NUMBER_COST = 28


def _str_cost(n: int) -> int:
    return 49 + n


def _bytes_cost(n: int) -> int:
    return 33 + n


def _list_cost(n: int) -> int:
    return 56 + 8 * n


def _dict_cost(n: int) -> int:
    return 64 + 40 * n


def _tensor_cost(ndim: int) -> int:
    return 256 + 8 * ndim


_EMPTY_DICT_COST = _dict_cost(0)
_VIEW_COST = 256
"""A memoryview and what it is wrapped in (`Ext`)."""
