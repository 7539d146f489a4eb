"""`allow_changes`: what identifies a schedule or an optimizer's hyperparameters, compared
between a record and the live objects, and the fields a restore may take from the live side.

A binding (a torch scheduler or optimizer, an optax optimizer) lists the fields that
identify what it runs as `Change`s where the record and the live object differ (a path
such as `scheduler.T_max`, both values) and the paths of every field it compared;
`settle` refuses the differences the caller did not allow, naming each, and returns the
paths it allowed, whose live values the binding then keeps.

An entry of `allow_changes` is `COMPONENT.FIELD[.FIELD...]` (component `optimizer` or
`scheduler`); it allows every difference whose path holds its fields as a contiguous run
after the component: `optimizer.weight_decay` allows `optimizer.param_groups.0.weight_decay`
and the same key of every other group, `scheduler.T_max` allows `scheduler.T_max` and a
child's `scheduler._schedulers.1.T_max`, `scheduler.lr_lambdas` every difference of the
schedule functions. An entry that names no field compared (a typo) is a `ValueError`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RecordMismatchError
from ..items.tensor import TensorData
from ..items.tree import Item

__all__ = ["ABSENT", "COMPONENTS", "Change", "UncheckedIdentityWarning", "field_changes",
           "for_component", "parse_changes", "same_value", "settle", "show", "unchecked"]

COMPONENTS = ("optimizer", "scheduler")
_SHOWN = 8  # differences named in one message


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT: Any = _Absent()  # a field one side does not have


class UncheckedIdentityWarning(UserWarning):
    """A record written before trainrec kept what identifies a schedule (a `LambdaLR`'s
    functions, a `SequentialLR`'s children's classes): it loads, those fields unchecked.
    Naming them in `allow_changes` says you vouch for them, and silences the warning."""


@dataclass(frozen=True)
class Change:
    """A field that differs: its path (`scheduler.T_max`), the recorded and the live value."""

    path: str
    recorded: Item
    live: Item
    text: str = ""  # how to say it, when not `PATH: RECORDED in the record, LIVE live`
    refusal: str = ""
    """Why the live value cannot be kept even when `allow_changes` names it (it would be
    kept, yet not take effect: a torch `StepLR`'s `base_lrs`), and what to do instead;
    empty for a change `allow_changes` may allow."""

    def __str__(self) -> str:
        return self.text or f"{self.path}: {show(self.recorded)} in the record, {show(self.live)} live"


def parse_changes(allow_changes: Iterable[str] | None) -> frozenset[str]:
    """The entries of an `allow_changes` argument, checked: `TypeError` for a bare string
    or a non-string entry, `ValueError` for an entry that is not `optimizer.FIELD...` or
    `scheduler.FIELD...`."""
    if allow_changes is None:
        return frozenset()
    if isinstance(allow_changes, (str, bytes)):
        raise TypeError(f"allow_changes must be a set of field names such as {{'scheduler.T_max'}}, "
                        f"not the string {allow_changes!r}")
    entries = frozenset(allow_changes)
    for entry in sorted(entries, key=repr):
        if not isinstance(entry, str):
            raise TypeError(f"allow_changes entries are strings such as 'optimizer.weight_decay', "
                            f"got {entry!r}")
        head, _, rest = entry.partition(".")
        if head not in COMPONENTS or not rest or "" in rest.split("."):
            raise ValueError(
                f"allow_changes entry {entry!r} is not COMPONENT.FIELD with COMPONENT one of "
                f"{', '.join(COMPONENTS)} (e.g. 'scheduler.T_max', 'optimizer.weight_decay')")
    return entries


def for_component(entries: frozenset[str], component: str) -> frozenset[str]:
    """The entries of `entries` about `component`."""
    return frozenset(e for e in entries if e.partition(".")[0] == component)


def _allows(entry: str, path: str) -> bool:
    want, have = entry.split("."), path.split(".")
    if want[0] != have[0]:
        return False
    want, have = want[1:], have[1:]
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def settle(changes: list[Change], fields: Iterable[str], allow: frozenset[str],
           what: str, hint: str = "") -> frozenset[str]:
    """The paths of `changes` that `allow` allows; `RecordMismatchError` naming the others
    (each path with both values, and the argument that would allow them; a change with a
    `refusal` is refused even when allowed, with that reason), `ValueError` for
    an entry of `allow` that allows none of `fields` (every path compared) nor of
    `changes`. `what` says what differs ("the live scheduler X: its schedule"), `hint`
    how to resolve it."""
    known = set(fields) | {c.path for c in changes}
    unused = sorted(e for e in allow if not any(_allows(e, p) for p in known))
    if unused:
        shown = ", ".join(sorted(known)[:12]) or "none"
        raise ValueError(f"allow_changes entry {unused[0]!r} names no field compared for "
                         f"{what} (fields: {shown})")
    refused = [c for c in changes if c.refusal or not any(_allows(e, c.path) for e in allow)]
    if refused:
        listed = "; ".join(str(c) for c in refused[:_SHOWN])
        more = f" (and {len(refused) - _SHOWN} more)" if len(refused) > _SHOWN else ""
        names = ", ".join(repr(p) for p in sorted({suggest(c.path) for c in refused if not c.refusal})[:_SHOWN])
        reasons = [f"{c.path} cannot be allowed: {c.refusal}."
                   for c in {c.refusal: c for c in refused if c.refusal}.values()]
        parts = [f"{what} differ from the record's: {listed}{more}.", *([hint] if hint else []), *reasons]
        if names:
            start = ("Once those are as recorded, resume with the others' live values on purpose: pass"
                     if reasons else "To resume with the live value on purpose, pass")
            parts.append(f"{start} allow_changes={{{names}}}")
        raise RecordMismatchError(" ".join(parts), key=refused[0].path)
    return frozenset(c.path for c in changes)


def suggest(path: str) -> str:
    """The `allow_changes` entry a message suggests for a difference at `path`: the path
    without what locates the field in a list that a live optimizer may hold several of (a
    torch `param_groups.N`, an optax `#identity.N`), so that it reads as the field's name
    (and allows it in each of them)."""
    parts = path.split(".")
    for i in range(1, len(parts) - 2):
        if parts[i] in ("param_groups", "#identity") and parts[i + 1].isdigit():
            return ".".join(parts[:i] + parts[i + 2:])
    if len(parts) > 2 and parts[1] == "#identity":
        return ".".join(parts[:1] + parts[2:])
    return path


def unchecked(fields: list[str], allow: frozenset[str], what: str) -> None:
    """Warn (`UncheckedIdentityWarning`) that `fields` of an older record could not be
    compared, unless `allow` names each of them."""
    left = [f for f in fields if not any(_allows(e, f) for e in allow)]
    if left:
        warnings.warn(
            f"trainrec: the record predates the identity of {what}: {', '.join(left)} could "
            "not be compared with the live one's and are taken as they are live; pass "
            f"allow_changes={{{', '.join(repr(f) for f in left)}}} to say they are the "
            "recorded run's (this silences the warning), or save a new checkpoint",
            UncheckedIdentityWarning, stacklevel=4)


def field_changes(recorded: dict[str, Item], live: dict[str, Item]) -> list[Change]:
    """The fields (by path) whose recorded and live values differ (`same_value`), in path
    order; a field one side lacks differs, its value there `ABSENT`."""
    return [Change(p, recorded.get(p, ABSENT), live.get(p, ABSENT))
            for p in sorted(set(recorded) | set(live))
            if p not in recorded or p not in live or not same_value(recorded[p], live[p])]


def same_value(a: Item, b: Item) -> bool:
    """Equal as data: numbers by value (a bool only equals a bool; NaN equals NaN),
    tensors by dtype, shape and value, lists and maps element by element."""
    if isinstance(a, TensorData) or isinstance(b, TensorData):
        return (isinstance(a, TensorData) and isinstance(b, TensorData) and a.dtype is b.dtype
                and a.shape == b.shape and bool(np.array_equal(a.array, b.array, equal_nan=True)))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def show(v: Item) -> str:
    """A value for a message: short."""
    if isinstance(v, TensorData):
        text = repr(v.array.tolist()) if v.array.size <= 8 else f"a {v.dtype.value} tensor {v.shape}"
    elif isinstance(v, dict) and "fn" in v:
        text = str(v["fn"])
    else:
        text = repr(v)
    return text if len(text) <= 100 else text[:97] + "..."
