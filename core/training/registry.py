"""Finding the adapter for a native object: `adapt`, `register_adapter`.

Resolution order, for `adapt(obj)`:

1. An object that already satisfies a trainrec protocol (`AutodiffModule`,
   `Optimizer`, `LrScheduler`, `Backend`) is returned as it is.
2. Otherwise trainrec looks at the root package of every class in the object's MRO (for
   a type, its own MRO), most derived first: a user's `MyNet(torch.nn.Module)` has the
   roots of `MyNet`'s module and then `torch`.
3. For each root, in that order, the candidate adapters are: those registered with
   `register_adapter(adapter, roots=...)` (most recent first), then the ones declared in
   the entry-point group `trainrec.adapters`, whose entry-point name is the root
   (`torch = "trainrec.adapters.torch:ADAPTER"`). An entry point is loaded only when
   its root is already in `sys.modules`: trainrec never imports a framework the caller
   has not imported (a class from `torch` exists only if torch was imported).
4. The first candidate whose `adapt(obj)` returns something other than None wins;
   the winning adapter is cached per type. Nothing found raises `TypeError`.

Registration is explicit: importing an adapter module registers nothing.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

from .protocols import AutodiffModule, Backend, LrScheduler, Optimizer

__all__ = ["Adapter", "adapt", "register_adapter", "adapt_module", "adapt_optimizer",
           "adapt_scheduler", "backend_for"]

ENTRY_POINT_GROUP = "trainrec.adapters"


@runtime_checkable
class Adapter(Protocol):
    """Binds one framework: `adapt(obj)` returns a protocol object for `obj` (a
    `Backend` for a tensor or tensor type) or None when `obj` is not its own."""

    @property
    def name(self) -> str: ...
    def adapt(self, obj: Any) -> Any: ...


_registered: list[tuple[frozenset[str], Adapter]] = []
_entry_points: dict[str, list[Any]] | None = None
_cache: dict[type, Adapter] = {}


def register_adapter(adapter: Adapter, *, roots: tuple[str, ...] | list[str]) -> None:
    """Make `adapter` a candidate for objects whose classes live under the root
    packages `roots` (e.g. `("torch",)`); later registrations are tried first."""
    if not isinstance(adapter, Adapter):
        raise TypeError("an adapter needs a `name` and an `adapt(obj)` method")
    if isinstance(roots, str) or not roots:
        raise TypeError("roots must be a non-empty list of package names")
    _registered.insert(0, (frozenset(roots), adapter))
    _cache.clear()


def _entry_points_for(root: str) -> list[Any]:
    global _entry_points
    if _entry_points is None:
        found: dict[str, list[Any]] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            found.setdefault(ep.name, []).append(ep)
        _entry_points = found
    return _entry_points.get(root, [])


def _candidates(root: str) -> list[Adapter]:
    out = [a for roots, a in _registered if root in roots]
    if root in sys.modules:
        for ep in _entry_points_for(root):
            loaded = ep.load()
            out.append(loaded() if isinstance(loaded, type) else loaded)
    return out


def _is_protocol_object(obj: Any) -> bool:
    if isinstance(obj, type):
        return False
    return isinstance(obj, (AutodiffModule, Optimizer, LrScheduler, Backend))


def adapt(obj: Any) -> Any:
    """The protocol object for `obj` (see the module docstring for the order); raises
    `TypeError` when no adapter knows it."""
    if _is_protocol_object(obj):
        return obj
    cls = obj if isinstance(obj, type) else type(obj)
    cached = _cache.get(cls)
    if cached is not None:
        found = cached.adapt(obj)
        if found is not None:
            return found
    seen: set[str] = set()
    for klass in cls.__mro__:
        root = klass.__module__.partition(".")[0]
        if root in seen or root == "builtins":
            continue
        seen.add(root)
        for adapter in _candidates(root):
            found = adapter.adapt(obj)
            if found is not None:
                _cache[cls] = adapter
                return found
    raise TypeError(
        f"no trainrec adapter for {cls.__module__}.{cls.__qualname__}: install the adapter "
        "(e.g. `pip install trainrec[torch]`), implement trainrec's protocols, or call "
        "trainrec.register_adapter(...)"
    )


def _adapt_as(obj: Any, protocol: type, what: str) -> Any:
    bound = adapt(obj)
    if not isinstance(bound, protocol):
        raise TypeError(f"{type(obj).__qualname__} is not a {what} (its adapter gave "
                        f"{type(bound).__qualname__})")
    return bound


def adapt_module(obj: Any) -> AutodiffModule:
    """`obj` as an `AutodiffModule` (native model or protocol object); `TypeError` otherwise."""
    bound: AutodiffModule = _adapt_as(obj, AutodiffModule, "model")
    return bound


def adapt_optimizer(obj: Any) -> Optimizer:
    bound: Optimizer = _adapt_as(obj, Optimizer, "optimizer")
    return bound


def adapt_scheduler(obj: Any) -> LrScheduler:
    bound: LrScheduler = _adapt_as(obj, LrScheduler, "learning-rate scheduler")
    return bound


def backend_for(obj: Any) -> Backend | None:
    """The backend of a tensor (or tensor type), or None when no adapter claims it."""
    try:
        bound = adapt(obj)
    except TypeError:
        return None
    return bound if isinstance(bound, Backend) else None
