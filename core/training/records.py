"""Records of model, optimizer and scheduler state, and of the caller's own state.

`StateRecord` is what adapters produce for their components: a kind name and an item
tree of host copies. `@record` turns a dataclass into a `Record`; `RngRecord` holds
Python's and numpy's random states.

This module holds the item conversions (`to_item`, `from_item_as`) and `@record`; beside it,
one idea each: `state_record` (`StateRecord`), `field_types` (what a declared field may be),
`lazy_fields` (tensors read on first use), `rng_record` (`RngRecord`) and `item_checks`
(`check_tensor_map`, `kind_mismatches`). Every name is importable from here as before.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import numpy as np

from ..errors import CorruptRecordError, RecordMismatchError
from ..items.tensor import TensorData
from ..items.tree import Item, check_item, join_key, map_tree, walk_pairs  # noqa: F401
from ..precision import PrecisionSettings, convert_item

# every name this module held before its split, from its new home (tests and users import them)
from .field_types import (  # noqa: F401
    _LOCALS,
    RecordDeclarationError,
    _bad_union,
    _check_declared,
    _held,
    _hints,
    _is_namedtuple,
    _is_tensor,
    _is_tensor_type,
    _mismatch,
    _plain,
    _tuple_hints,
    _type_name,
    _union_message,
)
from .item_checks import (  # noqa: F401
    _kind_of,
    _scalar,
    _value_kind,
    check_tensor_map,
    kind_mismatches,
)
from .item_checks import cast_problem as cast_problem  # imported from here by trainrec itself
from .lazy_fields import (  # noqa: F401
    _LAZY,
    _PENDING,
    _VIEWS,
    _can_defer,
    _deferred,
    _lazy_hooks,
    _materialize,
    _pending_fields,
    _unread,
)
from .lazy_fields import lazy_fields as lazy_fields  # imported from here by trainrec itself
from .registry import backend_for
from .rng_record import (  # noqa: F401
    _ARRAY_DTYPES,
    RngRecord,
    _decode_state,
    _encode_state,
)
from .state_record import StateRecord

__all__ = [
    "StateRecord",
    "record",
    "RngRecord",
    "to_item",
    "from_item_as",
    "expect_kind",
    "check_tensor_map",
    "kind_mismatches",
    "RecordDeclarationError",
]


T = TypeVar("T")


# -- caller state: @record ----------------------------------------------------------------


def to_item(value: Any, settings: PrecisionSettings, key: str = "") -> Item:
    """A caller value as an item: scalars, str, bytes, None, lists/tuples/dicts of them,
    numpy arrays and scalars, framework tensors and nested records."""
    if isinstance(value, enum.Enum):  # rebuilt from its value by a field declared its enum
        return to_item(value.value, settings, key)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return check_item(value, key)
    if isinstance(value, TensorData):
        return convert_item(value, settings)
    if hasattr(value, "into_item") and not isinstance(value, type):
        item: Item = value.into_item(settings)
        return item
    if isinstance(value, (np.ndarray, np.generic)):
        return convert_item(TensorData.from_array(np.asarray(value)), settings)
    if isinstance(value, (list, tuple)):
        return [to_item(v, settings, join_key(key, i)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, Item] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"dict keys in records must be str (at {key or 'root'!r})")
            out[k] = to_item(v, settings, join_key(key, k))
        return out
    backend = backend_for(value)
    if backend is not None and backend.is_tensor(value):
        try:
            host = backend.to_host(value)
        except TypeError as e:  # a tensor the backend cannot copy (a typed JAX key): say where
            raise TypeError(f"{key or 'root'!r}: {e}") from e
        return convert_item(TensorData.from_array(host, copy=False), settings)
    raise TypeError(
        f"{type(value).__qualname__} at {key or 'root'!r} cannot be recorded: use scalars, str, "
        "bytes, None, lists, tuples, dicts, arrays, tensors or records"
    )


def from_item_as(tp: Any, item: Item, device: Any, key: str = "") -> Any:
    """Rebuild a value of annotated type `tp` from `item` (raises `CorruptRecordError`)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if item is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) > 1 and not all(_plain(a) for a in non_none):
            raise RecordDeclarationError(_union_message(tp, key))
        return from_item_as(non_none[0] if len(non_none) == 1 else Any, item, device, key)
    if isinstance(tp, type) and hasattr(tp, "from_item") and not isinstance(item, TensorData):
        return tp.from_item(item, device)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(item)
        except ValueError:
            raise CorruptRecordError(f"{item!r:.40} is not a {tp.__qualname__}", key=key) from None
    if _is_namedtuple(tp):
        hints = _tuple_hints(tp)
        if not isinstance(item, list) or len(item) != len(tp._fields):
            raise CorruptRecordError(f"a {tp.__qualname__} is a list of {len(tp._fields)}", key=key)
        return tp(*(from_item_as(hints.get(f, Any), v, device, join_key(key, f))
                    for f, v in zip(tp._fields, item)))
    if isinstance(item, TensorData):
        return _tensor_as(tp, item, device, key)
    if isinstance(item, list):
        args = typing.get_args(tp)
        if origin is tuple or tp is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(from_item_as(args[0], v, device, join_key(key, i)) for i, v in enumerate(item))
            if args and len(args) == len(item):
                return tuple(
                    from_item_as(a, v, device, join_key(key, i))
                    for i, (a, v) in enumerate(zip(args, item))
                )
            return tuple(from_item_as(Any, v, device, join_key(key, i)) for i, v in enumerate(item))
        inner = args[0] if origin is list and args else Any
        return [from_item_as(inner, v, device, join_key(key, i)) for i, v in enumerate(item)]
    if isinstance(item, dict):
        args = typing.get_args(tp)
        inner = args[1] if origin is dict and len(args) == 2 else Any
        return {k: from_item_as(inner, v, device, join_key(key, k)) for k, v in item.items()}
    if tp is float and isinstance(item, int) and not isinstance(item, bool):
        return float(item)
    return item


def _tensor_as(tp: Any, t: TensorData, device: Any, key: str) -> Any:
    if isinstance(tp, type) and tp is not np.ndarray and not issubclass(tp, np.generic):
        backend = backend_for(tp)
        if backend is not None:
            try:
                dev = backend.device("cpu" if device is None else device)
            except (TypeError, ValueError) as e:  # a device that is not there: the file is fine
                raise RecordMismatchError(
                    f"cannot rebuild onto device {device!r} ({backend.name}): {e}", key=key
                ) from e
            return backend.from_host(t.take(), dev)
    if isinstance(tp, type) and issubclass(tp, np.generic) or (tp is Any and t.shape == ()):
        return t.array[()]
    if _VIEWS.get():  # a field of a mapped load: the map's read-only view, verified now
        return t.array
    return t.take()


_DC = TypeVar("_DC", bound=type)


@typing.dataclass_transform()
def record(cls: _DC) -> _DC:
    """Make a dataclass a `Record` whose item is a map of its fields.

    Fields may hold scalars, str, bytes, None, lists/tuples/dicts of them, numpy arrays,
    framework tensors and nested records; annotations say what `from_item` rebuilds
    (`np.ndarray`, `torch.Tensor`, a record type, `tuple[...]`). A plain class is made a
    dataclass first.
    """
    if not dataclasses.is_dataclass(cls):
        cls = typing.cast(_DC, dataclass(cls))
    if "<locals>" in cls.__qualname__:  # names its annotations use may be the function's
        used = set(re.findall(r"\w+", " ".join(map(str, cls.__dict__.get("__annotations__", {}).values()))))
        setattr(cls, _LOCALS, {k: v for k, v in sys._getframe(1).f_locals.items() if k in used})

    def into_item(self: Any, settings: PrecisionSettings) -> Item:
        hints = _hints(type(self))
        out: dict[str, Item] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_declared(hints[f.name], value, f"{type(self).__qualname__}.{f.name}")
            out[f.name] = to_item(value, settings, f.name)
        return out

    def from_item(klass: Any, item: Item, device: Any = None) -> Any:
        if not isinstance(item, dict):
            raise CorruptRecordError(f"{klass.__name__} record must be a map")
        hints = _hints(klass)
        fields = dataclasses.fields(klass)
        names = [f.name for f in fields]
        missing = [n for n in names if n not in item]
        extra = [k for k in item if k not in names]
        if missing or extra:
            raise RecordMismatchError(
                f"{klass.__name__} record fields differ: missing {missing}, unexpected {extra}"
            )
        if _LAZY.get() and _can_defer(klass):
            lazy = [n for n in names if _unread(item[n])]
            if lazy:
                return _deferring(klass, hints, item, names, lazy, device)
        values = {n: from_item_as(hints[n], item[n], device, n) for n in names}
        out = klass(**{f.name: values[f.name] for f in fields if f.init})
        for f in fields:  # init=False fields: their saved values, not their defaults again
            if not f.init:
                object.__setattr__(out, f.name, values[f.name])  # frozen ones too
        return out

    cls.into_item = into_item  # type: ignore[attr-defined]
    cls.from_item = classmethod(from_item)  # type: ignore[attr-defined]
    if "__slots__" not in cls.__dict__:
        _lazy_hooks(cls)
    return cls


def _deferring(klass: Any, hints: dict[str, Any], item: dict[str, Item], names: list[str],
               lazy: list[str], device: Any) -> Any:
    """An instance of `klass` whose fields `lazy` are built when first read (its
    dataclass `__init__` only assigns the fields: it is not called)."""
    out = object.__new__(klass)
    for n in names:
        if n not in lazy:
            object.__setattr__(out, n, from_item_as(hints[n], item[n], device, n))

    def build(n: str) -> Callable[[], Any]:
        return _deferred(lambda: from_item_as(hints[n], item[n], device, n))

    out.__dict__[_PENDING] = {n: build(n) for n in lazy}
    return out


# -- helpers adapters use to validate component records -----------------------------------


def expect_kind(record: Any, kind: str, component: str) -> Item:
    """The item of `record` when it is a `StateRecord` of `kind`; `RecordMismatchError`
    (keyed by `component`) otherwise."""
    if not isinstance(record, StateRecord):
        raise RecordMismatchError(
            f"expected a StateRecord, got {type(record).__name__}", key=component
        )
    if record.kind != kind:
        raise RecordMismatchError(
            f"record is of kind {record.kind!r}, the live {component} is {kind!r}", key=component
        )
    return record.item
