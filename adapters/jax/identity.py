"""What makes an optax optimizer the one a `JaxOptimizer` record was captured from.

`identity_of(tx)`: one map per transform, in chain order (as `transforms_of` walks
them), naming the transform and every hyperparameter its closures hold, schedules
included (a schedule is its function's name and the constants it captured, so
`warmup_cosine_decay_schedule(0, 1e-2, 2, 10)` and `exponential_decay(1e-2, ...)` differ);
`optax.MultiSteps` with its `every_k_schedule` and inner transforms; `inject_hyperparams`
with the numeric values, schedules and static arguments it was given.
`state_types_of(opt_state)`: the optax state types per chain position.
`differences(recorded, live)`: where two of them differ, each naming its path.

Only values (numbers, strings, small arrays by value, larger ones by digest) and names
go in, never an object's address: the same optimizer rebuilt in another process is the
same identity.
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

import numpy as np

from trainrec.adapter_kit import Change, Item

__all__ = ["IDENTITY_KEY", "STATE_TYPES_KEY", "identity_of", "state_types_of", "differences", "changes",
           "leaf_paths", "schedule_identity"]

IDENTITY_KEY = "#identity"  # the transforms and their hyperparameters, chain order
STATE_TYPES_KEY = "#state_types"  # the optax state types, per chain position

_DEPTH = 8  # closures within closures: schedules of joined schedules, and so on
_ENTRIES = 256  # a container longer than this is recorded by its type and length
_LIBRARIES = ("optax", "jax", "flax", "equinox", "numpy")  # their functions: by name and captures only
CONSTS_KEY = "#consts"  # a function of yours: the literals of its code (absent in older records)
_VALUES = 64  # arrays up to this many elements are recorded by value, larger by digest


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__qualname__)).split(".<locals>")[0]


def _cells(fn: Any) -> dict[str, Any]:
    out = {}
    code = getattr(fn, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            continue
    return out


def _array(v: Any) -> Item:
    try:
        arr = np.asarray(v)
    except TypeError:  # a typed JAX key: its dtype names its implementation
        return {"type": str(getattr(v, "dtype", type(v).__qualname__)), "shape": list(np.shape(v))}
    if arr.dtype.kind not in "biuf" and arr.dtype.name != "bfloat16":  # objects, strings, complex
        return {"type": type(v).__qualname__, "array": str(arr.dtype), "shape": list(arr.shape)}
    if arr.shape == () and arr.dtype.kind in "biuf":  # a number, however held (optax turns ints to floats)
        number: Item = _number(float(arr.astype(np.float64))) if arr.dtype.kind == "f" else arr.item()
        return number
    out: dict[str, Item] = {"array": str(arr.dtype), "shape": list(arr.shape)}
    if arr.size <= _VALUES:
        out["values"] = [_number(x) for x in arr.astype(np.float64).reshape(-1).tolist()] \
            if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else arr.tolist()
    else:
        out["sha256"] = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return out


def _number(v: float) -> Item:
    """An integral float as an int: optax's schedules turn their int constants into floats
    when first called (`nonlocal decay_steps`), and a record taken before and one taken
    after must be the same."""
    return int(v) if v.is_integer() and abs(v) < 2**53 else v


def _value(v: Any, depth: int, seen: frozenset[int]) -> Item:
    """`v` as an item of values and names (see the module docstring)."""
    if isinstance(v, float):
        return _number(v)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if depth <= 0 or id(v) in seen:
        return {"type": type(v).__qualname__}
    if isinstance(v, types.ModuleType):  # a module a closure holds (`optax` itself): its name
        return {"module": v.__name__}
    seen = seen | {id(v)}
    if isinstance(v, np.generic) or hasattr(v, "__array__") and hasattr(v, "shape") and hasattr(v, "dtype"):
        return _array(v)
    if isinstance(v, type):
        try:
            return {"dtype": str(np.dtype(v))}
        except TypeError:
            return {"class": v.__qualname__}
    if isinstance(v, np.dtype):
        return {"dtype": str(v)}
    if hasattr(v, "init") and hasattr(v, "update") and not isinstance(v, type):  # a GradientTransformation
        return list(identity_of(v))
    if isinstance(v, (list, tuple)):
        if len(v) > _ENTRIES:
            return {"type": type(v).__qualname__, "len": len(v)}
        return [_value(x, depth - 1, seen) for x in v]
    if isinstance(v, dict):
        if len(v) > _ENTRIES:
            return {"type": type(v).__qualname__, "len": len(v)}
        return {str(k): _value(x, depth - 1, seen) for k, x in v.items()}
    if isinstance(v, functools.partial):
        return {"fn": _name(v.func), "args": [_value(x, depth - 1, seen) for x in v.args],
                "keywords": {k: _value(x, depth - 1, seen) for k, x in sorted(v.keywords.items())}}
    if hasattr(v, "__wrapped__"):  # jax.jit and functools.wraps
        return _value(v.__wrapped__, depth, seen)
    if callable(v):
        out: dict[str, Item] = {"fn": _name(v)}
        if hasattr(v, "__self__"):  # a bound method: its object's state
            out["self"] = _object(v.__self__, depth - 1, seen)
        for k, x in sorted(_cells(v).items()):
            out[k] = _value(x, depth - 1, seen)
        code = getattr(v, "__code__", None)
        if isinstance(code, types.CodeType) and not _of_library(v):
            # your own function (a schedule, a MultiSteps k, a mask): its literals decide
            # what it returns (`lambda step: 4` is not `lambda step: 8`)
            out[CONSTS_KEY] = _consts(code, getattr(v, "__doc__", None))
        if not hasattr(v, "__code__") and not hasattr(v, "__self__"):  # a callable object
            out.update(_object(v, depth - 1, seen))
        return out
    return _object(v, depth - 1, seen)


def _of_library(fn: Any) -> bool:
    module = str(getattr(fn, "__module__", None) or "")
    return module.split(".")[0] in _LIBRARIES


def _consts(code: types.CodeType, doc: Any = None) -> list[Item]:
    """The literals of a function's code and of the functions defined in it, in order
    (numbers, strings, bytes; the docstring and None left out, which Python versions
    place differently)."""
    out: list[Item] = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.extend(_consts(c))
        elif isinstance(c, tuple):
            out.extend(_number(x) if isinstance(x, float) else x for x in c
                       if isinstance(x, (bool, int, float, str)))
        elif isinstance(c, (bool, int, str)) and not (isinstance(c, str) and c == doc):
            out.append(c)
        elif isinstance(c, float):
            out.append(_number(c))
        elif isinstance(c, bytes):
            out.append(c.hex())
        if len(out) > _ENTRIES:
            return out[:_ENTRIES]
    return out


def _object(v: Any, depth: int, seen: frozenset[int]) -> dict[str, Item]:
    out: dict[str, Item] = {"type": type(v).__qualname__}
    attrs = getattr(v, "__dict__", None)
    if isinstance(attrs, dict) and depth > 0 and len(attrs) <= _ENTRIES:
        for k, x in sorted(attrs.items()):
            out[str(k)] = _value(x, depth, seen | {id(v)})
    return out


def identity_of(tx: Any) -> list[Item]:
    """One map per transform of `tx`, in chain order: `{"transform": NAME, ...}` with its
    hyperparameters (see the module docstring)."""
    out: list[Item] = []
    _walk(getattr(tx, "update", tx), getattr(tx, "init", None), out)
    return out


def _walk(fn: Any, init: Any, out: list[Item]) -> None:
    name = _name(fn)
    cells = _cells(fn) if callable(fn) else {}
    if name in ("chain", "named_chain"):
        inits = [list(v) for v in _cells(init).values() if isinstance(v, (tuple, list))] if init else []
        for value in cells.values():
            for i, member in enumerate(value if isinstance(value, (tuple, list)) else ()):
                member = member[-1] if isinstance(member, tuple) else member  # named_chain: (name, tx)
                member_init = inits[0][i] if inits and i < len(inits[0]) else None
                member_init = member_init[-1] if isinstance(member_init, tuple) else member_init
                _walk(getattr(member, "update", member), getattr(member, "init", member_init), out)
        return
    if name == "with_extra_args_support":  # chain's wrapper of each member
        for value in cells.values():
            if hasattr(value, "update") or callable(value):
                _walk(getattr(value, "update", value), getattr(value, "init", None), out)
                return
    if name.startswith("MultiSteps.") and hasattr(fn, "__self__"):
        multi = fn.__self__
        out.append({"transform": "MultiSteps",
                    "every_k_schedule": _value(getattr(multi, "_every_k_schedule", None), _DEPTH, frozenset()),
                    "use_grad_mean": _value(getattr(multi, "_use_grad_mean", None), _DEPTH, frozenset()),
                    "should_skip_update_fn": _value(getattr(multi, "_should_skip_update_fn", None), _DEPTH,
                                                    frozenset()),
                    "inner": identity_of(getattr(multi, "_opt", None))})
        return
    entry: dict[str, Item] = {"transform": name}
    if hasattr(fn, "__self__"):  # a method of an object (optax's WrappedSchedule): its state
        entry["self"] = _object(fn.__self__, _DEPTH, frozenset())
    merged = {**(_cells(init) if callable(init) else {}), **cells}  # inject_hyperparams: numeric_hps in init
    for k, v in sorted(merged.items()):
        entry[k] = _value(v, _DEPTH, frozenset())
    out.append(entry)


def schedule_identity(schedule: Any) -> Item:
    """An optax schedule (or any function of the count) as values and names: its
    function's name and the constants it captured, as inside `identity_of`."""
    return _value(schedule, _DEPTH, frozenset())


def state_types_of(state: Any) -> Item:
    """The optax state types of `state` by position: a NamedTuple state is
    `{"type": NAME, FIELD: ...}` for its fields that hold states, a chain's tuple a list;
    parameter trees (which hold no states) are left out."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        out: dict[str, Item] = {"type": type(state).__qualname__}
        for f in state._fields:
            inner = state_types_of(getattr(state, f))
            if inner is not None:
                out[f] = inner
        return out
    if isinstance(state, (tuple, list)):
        members = [state_types_of(s) for s in state]
        return members if any(m is not None for m in members) else None
    if isinstance(state, dict):
        found = {str(k): state_types_of(v) for k, v in state.items()}
        found = {k: v for k, v in found.items() if v is not None}
        return found or None
    return None


def differences(recorded: Item, live: Item, path: str = "", limit: int = 5) -> list[str]:
    """Where `recorded` and `live` differ, each as `PATH: X in the record, Y live` (at
    most `limit`)."""
    return [c.text for c in changes(recorded, live, path, limit)]


def changes(recorded: Item, live: Item, path: str = "", limit: int = 64) -> list[Change]:
    """Where `recorded` and `live` differ, as `Change`s (at most `limit`), each saying
    `PATH: X in the record, Y live`."""
    out: list[Change] = []
    _diff(recorded, live, path, out, limit)
    return out


def _show(v: Item) -> str:
    if isinstance(v, dict) and ("transform" in v or "fn" in v or "type" in v):
        return str(v.get("transform", v.get("fn", v.get("type"))))
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _say(out: list[Change], where: str, a: Item, b: Item, text: str) -> None:
    out.append(Change(where, a, b, f"{where}: {text}"))


def _diff(a: Item, b: Item, path: str, out: list[Change], limit: int) -> None:
    if len(out) >= limit:
        return
    where = path or "root"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("transform", a.get("fn", a.get("type"))) != b.get("transform", b.get("fn", b.get("type"))):
            _say(out, where, a, b, f"{_show(a)} in the record, {_show(b)} live")
            return
        for k in sorted(set(a) | set(b)):
            if k not in b:
                _say(out, f"{where}.{k}", a[k], None, f"{_show(a[k])} in the record, absent live")
            elif k not in a and k == CONSTS_KEY:
                continue  # a record written before functions' literals were recorded
            elif k not in a:
                _say(out, f"{where}.{k}", None, b[k], f"absent in the record, {_show(b[k])} live")
            else:
                _diff(a[k], b[k], f"{path}.{k}" if path else k, out, limit)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            _say(out, where, a, b, f"{len(a)} entries in the record, {len(b)} live: {_show(a)} vs {_show(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}.{i}" if path else str(i), out, limit)
        return
    if _same(a, b):
        return
    _say(out, where, a, b, f"{_show(a)} in the record, {_show(b)} live")


def leaf_paths(item: Item, path: str) -> list[str]:
    """The path of every leaf of an identity (maps and lists walked)."""
    if isinstance(item, dict) and item:
        return [p for k, v in item.items() for p in leaf_paths(v, f"{path}.{k}")]
    if isinstance(item, list) and item:
        return [p for i, v in enumerate(item) for p in leaf_paths(v, f"{path}.{i}")]
    return [path]


def _same(a: Item, b: Item) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (a != a and b != b)  # NaN is NaN
    return a == b
