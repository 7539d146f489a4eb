"""Records of model, optimizer and scheduler state, and of the caller's own state.

`StateRecord` is what adapters produce for their components: a kind name and an item
tree of host copies. `@record` turns a dataclass into a `Record`; `RngRecord` holds
Python's and numpy's random states.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import numpy as np

from ..errors import CorruptRecordError, RecordMismatchError
from ..items.tensor import TensorData
from ..items.tree import Item, check_item, join_key, map_tree, walk_pairs
from ..precision import convert_item
from .protocols import PrecisionSettings
from .registry import backend_for

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


class RecordDeclarationError(TypeError):
    """A `@record` class whose fields cannot load back as declared, whatever they hold:
    annotations that cannot be resolved, or a union of several types that the item
    cannot tell apart. Raised at save and at load (a `TypeError`: the class is at fault,
    not the file)."""


@dataclass(frozen=True)
class StateRecord:
    """A component's state as an item tree of host copies, tagged with its `kind`."""

    kind: str
    item: Item

    RECORD_NAME = "StateRecord"

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"kind": self.kind, "state": convert_item(self.item, settings)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None, *, key: str = "") -> StateRecord:
        if not isinstance(item, dict) or set(item) != {"kind", "state"}:
            raise CorruptRecordError("component record must be {kind, state}", key=key)
        kind = item["kind"]
        if not isinstance(kind, str):
            raise CorruptRecordError("component kind must be a string", key=join_key(key, "kind"))
        return cls(kind, check_item(item["state"], join_key(key, "state")))


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


# -- lazy fields: `Recorder.load(..., mmap=True)` ------------------------------------------

_LAZY: ContextVar[bool] = ContextVar("trainrec_lazy_fields", default=False)
_VIEWS: ContextVar[bool] = ContextVar("trainrec_mapped_views", default=False)
_PENDING = "__trainrec_pending__"


@contextmanager
def lazy_fields() -> Iterator[None]:
    """While active, `from_item` of a `@record` leaves each field whose item holds a tensor
    not read yet (a mapped load's) unbuilt until the field is first read: then its
    tensors are verified (`ChecksumError` when damaged: the field stays unread), array
    fields are read-only views of the map and framework tensors are copied from it."""
    token = _LAZY.set(True)
    try:
        yield
    finally:
        _LAZY.reset(token)


def _unread(item: Item) -> bool:
    """Whether `item` holds a tensor whose bytes were not read (nor verified) yet."""
    if isinstance(item, TensorData):
        return not item.is_loaded
    if isinstance(item, dict):
        return any(_unread(v) for v in item.values())
    if isinstance(item, list):
        return any(_unread(v) for v in item)
    return False


def _can_defer(cls: type) -> bool:
    """A class whose instances may have fields built later: the dataclass's own
    `__init__` (which only assigns them), no `__post_init__`, an instance `__dict__`."""
    code = getattr(getattr(cls, "__init__", None), "__code__", None)
    return (code is not None and code.co_filename == "<string>"  # made by dataclasses
            and not hasattr(cls, "__post_init__") and "__slots__" not in cls.__dict__
            and all(f.init for f in dataclasses.fields(cls)))


def _deferred(build: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        token = _VIEWS.set(True)
        try:
            return build()
        finally:
            _VIEWS.reset(token)
    return run


def _pending_fields(obj: Any) -> dict[str, Callable[[], Any]] | None:
    try:
        pending: dict[str, Callable[[], Any]] | None = object.__getattribute__(obj, "__dict__").get(_PENDING)
        return pending
    except AttributeError:
        return None


def _materialize(obj: Any, name: str) -> Any:
    pending = _pending_fields(obj)
    assert pending is not None
    value = pending[name]()  # may raise ChecksumError: the field stays pending
    object.__setattr__(obj, name, value)
    del pending[name]
    if not pending:
        del object.__getattribute__(obj, "__dict__")[_PENDING]
    return value


def _lazy_hooks(cls: type) -> None:
    """`__getattr__` (a field not built yet is built when first read) and `__getstate__`
    (pickling and `copy` build every field first) on a `@record` class, around the
    class's own when it has them."""
    own_getattr = cls.__dict__.get("__getattr__")

    def __getattr__(self: Any, name: str) -> Any:  # noqa: N807 - the protocol's name
        pending = _pending_fields(self)
        if pending is not None and name in pending:
            return _materialize(self, name)
        if own_getattr is not None:
            return own_getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    own_getstate = cls.__dict__.get("__getstate__")

    def __getstate__(self: Any) -> Any:  # noqa: N807
        pending = _pending_fields(self)
        for name in list(pending or ()):
            _materialize(self, name)
        if own_getstate is not None:
            return own_getstate(self)
        return object.__getstate__(self)

    setattr(cls, "__getattr__", __getattr__)  # noqa: B010 - a class the caller declared
    setattr(cls, "__getstate__", __getstate__)  # noqa: B010


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


# -- RNG state ----------------------------------------------------------------------------

_ARRAY_DTYPES = {"uint32": np.uint32, "uint64": np.uint64, "int64": np.int64}


def _encode_state(value: Any) -> Item:
    """numpy bit-generator state (which holds 128-bit ints and uint arrays) as an item."""
    if isinstance(value, dict):
        return {str(k): _encode_state(v) for k, v in value.items()}
    if isinstance(value, (bool, str, float)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return v if -(2**63) <= v < 2**64 else {"bigint": hex(v)}
    if isinstance(value, np.ndarray) and value.dtype.name in _ARRAY_DTYPES:
        return {"array": value.dtype.name, "shape": list(value.shape),
                "bytes": np.ascontiguousarray(value, value.dtype.newbyteorder("<")).tobytes()}
    raise TypeError(f"cannot record RNG state value of type {type(value).__name__}")


def _decode_state(item: Item, key: str) -> Any:
    """The inverse of `_encode_state`."""

    def decode(path: str, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if set(node) == {"bigint"} and isinstance(node["bigint"], str):
            try:
                return int(node["bigint"], 16)
            except ValueError:
                raise CorruptRecordError("malformed bigint", key=path) from None
        if set(node) == {"array", "shape", "bytes"}:
            name, shape, data = node["array"], node["shape"], node["bytes"]
            if name not in _ARRAY_DTYPES or not isinstance(data, bytes) or not isinstance(shape, list):
                raise CorruptRecordError("malformed RNG state array", key=path)
            dt = np.dtype(_ARRAY_DTYPES[str(name)]).newbyteorder("<")
            if len(data) % dt.itemsize:
                raise CorruptRecordError("malformed RNG state array", key=path)
            arr = np.frombuffer(data, dt).astype(dt.newbyteorder("="))
            try:
                return arr.reshape([int(d) for d in shape if isinstance(d, int)])
            except (ValueError, TypeError):
                raise CorruptRecordError("malformed RNG state array shape", key=path) from None
        return node

    return map_tree(item, decode, key)


@dataclass(frozen=True)
class RngRecord:
    """Python `random`'s state, numpy's legacy global state and the states of any
    `numpy.random.Generator`s given to `capture` (in order)."""

    python: Any
    numpy_global: Any
    generators: tuple[Any, ...] = ()

    RECORD_NAME = "RngRecord"

    @classmethod
    def capture(cls, *generators: np.random.Generator) -> RngRecord:
        """The current states (copies: later draws do not change the record)."""
        for g in generators:
            if not isinstance(g, np.random.Generator):
                raise TypeError(f"expected numpy.random.Generator, got {type(g).__name__} (JAX keys and "
                                "flax nnx Rngs: the JAX adapter's JaxRngRecord; torch generators: the "
                                "torch adapter's TorchRngRecord)")
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return cls(
            python={"version": version, "state": list(internal), "gauss_next": gauss},
            numpy_global=_encode_state(
                {"bit_generator": name, "keys": np.array(keys), "pos": pos,
                 "has_gauss": has_gauss, "cached_gaussian": cached}
            ),
            generators=tuple(_encode_state(g.bit_generator.state) for g in generators),
        )

    def apply(self, *generators: np.random.Generator) -> None:
        """Put the recorded states back into `random`, numpy's global RNG and `generators`
        (as many, in the same order, of the same bit generators, as were captured)."""
        if len(generators) != len(self.generators):
            raise ValueError(
                f"record holds {len(self.generators)} generator states, {len(generators)} given"
            )
        states = [_decode_state(s, f"generators.{i}") for i, s in enumerate(self.generators)]
        for i, (g, s) in enumerate(zip(generators, states)):
            have = type(g.bit_generator).__name__
            if not isinstance(s, dict) or s.get("bit_generator") != have:
                raise RecordMismatchError(
                    f"generator {i} is {have}, the record holds {s.get('bit_generator') if isinstance(s, dict) else s!r}"
                )
        py = self.python
        np_state = _decode_state(self.numpy_global, "numpy_global")
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        np.random.set_state(
            (np_state["bit_generator"], np_state["keys"], np_state["pos"],
             np_state["has_gauss"], np_state["cached_gaussian"])
        )
        for g, s in zip(generators, states):
            g.bit_generator.state = s

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"python": self.python, "numpy_global": self.numpy_global,
                "generators": list(self.generators)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None) -> RngRecord:
        if not isinstance(item, dict) or set(item) != {"python", "numpy_global", "generators"}:
            raise CorruptRecordError("RngRecord must be {python, numpy_global, generators}")
        py = item["python"]
        if (
            not isinstance(py, dict)
            or not isinstance(py.get("state"), list)
            or not all(isinstance(x, int) for x in py["state"])  # type: ignore[union-attr]
            or not isinstance(py.get("version"), int)
        ):
            raise CorruptRecordError("malformed Python random state", key="python")
        gens = item["generators"]
        if not isinstance(gens, list):
            raise CorruptRecordError("generators must be a list", key="generators")
        np_state = _decode_state(item["numpy_global"], "numpy_global")
        if not isinstance(np_state, dict) or not {"bit_generator", "keys", "pos"} <= set(np_state):
            raise CorruptRecordError("malformed numpy global state", key="numpy_global")
        return cls(python=py, numpy_global=item["numpy_global"], generators=tuple(gens))


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
