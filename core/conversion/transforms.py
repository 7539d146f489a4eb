"""Registered transforms: named functions that change a tensor's layout in a rule
(`register_transform`, the table `TRANSFORMS` and their target-shape functions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

HostArray = np.ndarray[Any, Any]
Shape = tuple[int, ...]
Transform = Callable[[HostArray], HostArray]


# -- transforms -----------------------------------------------------------------------------


def _transpose2(a: HostArray) -> HostArray:
    return a.T if a.ndim == 2 else a


TRANSFORMS: dict[str, Transform] = {
    "none": lambda a: a,
    "transpose": _transpose2,
    "oihw_to_hwio": lambda a: a.transpose(2, 3, 1, 0),
    "hwio_to_oihw": lambda a: a.transpose(3, 2, 0, 1),
    "oiw_to_wio": lambda a: a.transpose(2, 1, 0),
    "wio_to_oiw": lambda a: a.transpose(2, 1, 0),
}
_SHAPES: dict[str, Callable[[Shape], Shape]] = {}


def register_transform(name: str, fn: Transform, *,
                       shape: Callable[[Shape], Shape] | None = None) -> None:
    """Make `fn` (a host array -> a host array, pure) usable as `"transform": name` in rules.

    `shape` maps a source shape to the shape `fn` returns; without it, the shape is found
    by calling `fn` on a read-only array of that shape whose elements all share one byte.
    Raises `TypeError` for a name that is not a string or an `fn` / `shape` that is not
    callable, `ValueError` for an empty name or one already registered (a transform is
    never replaced: a rule file means the same thing all run long).
    """
    if not isinstance(name, str):
        raise TypeError(f"a transform's name must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError("a transform's name must not be empty")
    if not callable(fn):
        raise TypeError(f"transform {name!r}: fn must be callable, got {type(fn).__name__}")
    if shape is not None and not callable(shape):
        raise TypeError(f"transform {name!r}: shape must be callable, got {type(shape).__name__}")
    if name in TRANSFORMS:
        raise ValueError(f"transform {name!r} is already registered")
    TRANSFORMS[name] = fn
    if shape is not None:
        _SHAPES[name] = shape


def _dummy(shape: Shape) -> HostArray:
    """A read-only array of `shape` that takes one byte: for finding result shapes."""
    return np.broadcast_to(np.zeros((), np.uint8), shape)
