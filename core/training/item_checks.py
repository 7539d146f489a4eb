"""Checks of a restored item against what a caller holds: tensor maps, casts that would
change values, and kind mismatches, each named by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import RecordMismatchError
from ..items.tensor import TensorData
from ..items.tree import Item, walk_pairs


def check_tensor_map(
    item: Item | Mapping[str, Item],
    expected: dict[str, tuple[tuple[int, ...], Any]],
    component: str,
    *,
    allow_subset: bool = False,
    keep_dtype: bool = True,
) -> dict[str, TensorData]:
    """Check that `item` maps exactly the names of `expected` (or a subset, when
    `allow_subset`) to tensors of the expected shapes and dtype kinds (float, int, bool:
    a float may be restored into another float dtype). `expected` maps a name to
    (shape, DType). Reports every mismatch at once in a `RecordMismatchError`.

    `keep_dtype` (the default) says the restore casts each tensor to its expected dtype
    (the live tensor's, as a torch parameter keeps its own): a tensor the cast would
    change (f32 `1e6` into f16 is `inf`, i32 `300` into i8 is `44`, f32 into bf16
    rounds) is refused, naming the leaf, both dtypes and the first changed element
    (`cast_problem`). An adapter whose restored leaf takes the recorded dtype (the live
    value only a template, as JAX's) passes `keep_dtype=False`."""
    if not isinstance(item, dict):
        raise RecordMismatchError("expected a map of tensors", key=component)
    problems: list[str] = []
    missing = [] if allow_subset else [k for k in expected if k not in item]
    extra = [k for k in item if k not in expected]
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"not in the live {component}: {extra}")
    out: dict[str, TensorData] = {}
    for name, value in item.items():
        if name not in expected:
            continue
        shape, dtype = expected[name]
        if not isinstance(value, TensorData):
            problems.append(f"{name}: not a tensor")
            continue
        if value.shape != tuple(shape):
            problems.append(f"{name}: shape {value.shape} in the record, {tuple(shape)} live")
        elif _kind_of(value.dtype) != _kind_of(dtype):
            problems.append(f"{name}: dtype {value.dtype.value} in the record, {dtype.value} live")
        elif keep_dtype and value.dtype is not dtype:
            problem = cast_problem(name, value, dtype)
            if problem is not None:
                problems.append(problem)
        out[name] = value
    if problems:
        raise RecordMismatchError("; ".join(problems), key=component)
    return out


def cast_problem(name: str, value: TensorData, dtype: Any, why: str = "the live dtype") -> str | None:
    """What casting the recorded tensor `value` to `dtype` (a `DType`) would change, as
    one problem naming `name`, both dtypes and the first changed element, with how many
    change; None when every element keeps its value (a NaN stays a NaN). Overflow (f32
    `1e6` into f16), rounding (f32 into bf16) and wrapping ints (i32 `300` into i8, `-5`
    into u8) all change values. `why` says what makes `dtype` the target."""
    if value.dtype is dtype:
        return None
    source = np.asarray(value.array)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = source.astype(dtype.numpy)
        back = cast.astype(source.dtype)
    same = back == source
    if value.dtype.is_float:
        same |= np.isnan(back) & np.isnan(source)
    if bool(np.all(same)):
        return None
    changed = ~same.reshape(-1)
    first = int(np.argmax(changed))
    at = tuple(int(i) for i in np.unravel_index(first, source.shape)) if source.ndim else ()
    return (f"{name}: the record holds {value.dtype.value}, {why} is {dtype.value}, and the cast would "
            f"change {int(changed.sum())} of {source.size} elements, first at index {list(at)}: "
            f"{_scalar(source.reshape(-1)[first])} becomes {_scalar(cast.reshape(-1)[first])} (build the live "
            f"tensor as {value.dtype.value}, as the recorded run held it)")


def _scalar(x: Any) -> float | int | bool:
    kind = np.dtype(type(x)).kind if not isinstance(x, np.generic) else x.dtype.kind
    return bool(x) if kind == "b" else int(x) if kind in "iu" else float(x)


def kind_mismatches(item: Item, like: Item, key: str) -> list[str]:
    """Where `item` (from a record) is not of the kind of `like` (the live value, as an
    item): a list of problems, each naming its key path; empty when it fits.

    Kinds: bool, number (int or float, never bool), str, bytes, tensor (the same shape
    and dtype kind), list (the same length, element by element), map (the same keys, key
    by key). None and bool may stand for each other (optional flags such as torch's
    `foreach=None`); None stands for nothing else."""
    problems: list[str] = []
    for path, want, have in walk_pairs(like, item, key):
        where = path or "root"
        if isinstance(want, TensorData):
            if not isinstance(have, TensorData):
                problems.append(f"{where}: {_value_kind(have)} in the record, a tensor live")
            elif have.shape != want.shape:
                problems.append(f"{where}: shape {have.shape} in the record, {want.shape} live")
            elif _kind_of(have.dtype) != _kind_of(want.dtype):
                problems.append(f"{where}: dtype {have.dtype.value} in the record, {want.dtype.value} live")
        elif isinstance(want, list):  # `walk_pairs` yields lists only of another kind or length
            problems.append(f"{where}: {_value_kind(have)} in the record, a list of {len(want)} live")
        elif isinstance(want, dict):  # ... and maps only of another kind or other keys
            keys = sorted(have) if isinstance(have, dict) else _value_kind(have)
            problems.append(f"{where}: {keys} in the record, {sorted(want)} live")
        else:
            kind, wanted = _value_kind(have), _value_kind(want)
            if kind != wanted and {kind, wanted} != {"bool", "None"}:
                problems.append(f"{where}: {kind} {have!r:.40} in the record, {wanted} live")
    return problems


def _value_kind(value: Item) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, TensorData):
        return "tensor"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _kind_of(dtype: Any) -> str:
    return "float" if dtype.is_float else "int" if dtype.is_int else "bool"
