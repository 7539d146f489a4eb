"""What a record's declared fields may be, and whether a value fits its declaration: the type
hints resolved, unions and tuples read, a mismatch named (`RecordDeclarationError`).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Union

import numpy as np

from ..items.tensor import TensorData
from .registry import backend_for


class RecordDeclarationError(TypeError):
    """A `@record` class whose fields cannot load back as declared, whatever they hold:
    annotations that cannot be resolved, or a union of several types that the item
    cannot tell apart. Raised at save and at load (a `TypeError`: the class is at fault,
    not the file)."""


_LOCALS = "__trainrec_locals__"


def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of the dataclass `cls` (a class declared in
    a function also sees the function's locals as they were when it was decorated);
    `RecordDeclarationError` when one cannot be resolved or cannot load back as declared."""
    localns: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        localns.update(base.__dict__.get(_LOCALS, {}))
    try:
        hints = typing.get_type_hints(cls, localns=localns or None)
    except Exception as e:  # noqa: BLE001 - NameError, AttributeError, TypeError, SyntaxError
        raise RecordDeclarationError(
            f"{cls.__qualname__}'s field annotations cannot be resolved ({type(e).__name__}: {e}), "
            "so what its fields load back as is unknown: define the class, and the types its "
            "fields name, at module level"
        ) from None
    out = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}
    for name, tp in out.items():
        bad = _bad_union(tp)
        if bad is not None:
            raise RecordDeclarationError(_union_message(bad, f"{cls.__qualname__}.{name}"))
    return out


def _plain(tp: Any) -> bool:
    """Whether `from_item_as` rebuilds `tp` as stored, so that it may share a union."""
    if tp in (Any, int, float, str, bytes, bool, type(None), list, dict):
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return True
    if origin is list:
        return all(_plain(a) for a in typing.get_args(tp))
    if origin is dict:
        return all(_plain(a) for a in typing.get_args(tp)[1:])
    return False


def _bad_union(tp: Any) -> Any:
    """The first union in `tp` of several types not all `_plain` (None when there is none)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(non_none) > 1 and not all(_plain(a) for a in non_none):
            return tp
    if typing.get_origin(tp) is typing.Literal:
        return None
    return next((b for b in map(_bad_union, typing.get_args(tp)) if b is not None), None)


def _union_message(tp: Any, where: str) -> str:
    return (
        f"{where} is declared {_type_name(tp)}: the record stores a value, not which of these "
        "types it was, so it would load back as a plain item; declare one type (such as "
        "`TorchRngRecord | None`)"
    )


def _is_namedtuple(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _tuple_hints(tp: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(tp)
    except Exception as e:  # noqa: BLE001
        raise RecordDeclarationError(
            f"{tp.__qualname__}'s annotations cannot be resolved ({type(e).__name__}: {e}): "
            "define it at module level"
        ) from None


def _check_declared(tp: Any, value: Any, where: str) -> None:
    """Raise `TypeError` when `value` would not load back (`from_item_as`) as a value of
    its declared type `tp`: a record of another type, a tensor where a scalar is
    declared, a list where a tensor is. Saving it would succeed and loading would fail or
    change its type, so the save refuses."""
    why = _mismatch(tp, value)
    if why is not None:
        hint = (f"declare it `{_type_name(type(value))}" + (" | None`" if value is not None and
                typing.get_origin(tp) in (Union, types.UnionType) else "`")
                if hasattr(type(value), "from_item") else "store a value of the declared type")
        raise TypeError(
            f"{where} is declared {_type_name(tp)} but holds {why}, which would not load back "
            f"as one: {hint} (or change the annotation)"
        )


def _mismatch(tp: Any, value: Any) -> str | None:
    """What in `value` does not rebuild as `tp` (None when it does, or when `tp` is a
    type `from_item_as` does not rebuild by)."""
    if tp is Any:  # a class since Python 3.11: never isinstance-checked
        return None
    origin = tp if tp in (list, tuple, dict) else typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            return None if type(None) in args else _held(None)
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _mismatch(non_none[0], value)
        whys = [_mismatch(a, value) for a in non_none]  # plain types only (`_hints`)
        return None if None in whys else _held(value)
    if _is_namedtuple(tp):
        if type(value) is not tp:
            return _held(value)
        hints = _tuple_hints(tp)
        return next((w for w in (_mismatch(hints.get(f, Any), getattr(value, f))
                                 for f in tp._fields) if w), None)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)) or _is_namedtuple(type(value)):
            return _held(value)  # a NamedTuple would come back as a plain list or tuple
        args = typing.get_args(tp)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            inner = args[0] if args else Any
            return next((w for w in (_mismatch(inner, v) for v in value) if w), None)
        if args and len(args) != len(value):
            return f"a tuple of {len(value)}"
        return next((w for w in (_mismatch(a, v) for a, v in zip(args, value)) if w), None)
    if origin is dict:
        if not isinstance(value, dict):
            return _held(value)
        args = typing.get_args(tp)
        inner = args[1] if len(args) == 2 else Any
        return next((w for w in (_mismatch(inner, v) for v in value.values()) if w), None)
    if origin is not None or not isinstance(tp, type) or tp is object:
        return None  # Any, TypeVars, Literal, abstract collections: rebuilt as stored
    if hasattr(tp, "from_item") or issubclass(tp, enum.Enum):
        return None if type(value) is tp else _held(value)  # a subclass would load as `tp`
    if value is None:
        return None if tp is type(None) else _held(None)
    if isinstance(value, enum.Enum):
        return _held(value)  # it would come back as its value
    # what `to_item` records as a tensor (a numpy float64 is a float, np.str_ a str)
    tensor = not isinstance(value, (bool, int, float, str, bytes)) and _is_tensor(value)
    if tp is np.ndarray or issubclass(tp, np.generic) or _is_tensor_type(tp):
        return None if tensor else _held(value)
    if tensor:
        return _held(value)  # a numpy scalar or tensor comes back as an array
    if tp is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else _held(value)
    return None if isinstance(value, tp) else _held(value)


def _held(value: Any) -> str:
    tp = type(value)
    return f"a value of type {tp.__qualname__}" + ("" if tp.__module__ == "builtins" else f" ({tp.__module__})")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__qualname__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None and args:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__qualname__', origin)}[{inner}]"
    return str(tp).replace("typing.", "")


def _is_tensor(value: Any) -> bool:
    if isinstance(value, (np.ndarray, np.generic, TensorData)):
        return True
    backend = backend_for(value)
    return backend is not None and backend.is_tensor(value)


def _is_tensor_type(tp: type) -> bool:
    return backend_for(tp) is not None
