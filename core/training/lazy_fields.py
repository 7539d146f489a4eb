"""A record's lazy fields: tensors read on first use (`lazy_fields`), and the hooks that
defer and then materialize them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..items.tensor import TensorData
from ..items.tree import Item

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
