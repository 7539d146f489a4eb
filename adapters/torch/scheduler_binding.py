"""`TorchLrScheduler`: an LR scheduler's state as a record, and back (its live values taken
from the optimizer it drives).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainrec import RecordMismatchError, StateRecord
from trainrec.adapter_kit import Change, Item, expect_kind, field_changes, settle, unchecked

from .identity import IDENTITY_KEY, base_lrs_refusals, flatten, identity_of, scheduler_fields
from .state_values import _kind, decode, encode

# -- scheduler ----------------------------------------------------------------------------


class TorchLrScheduler:
    """A native torch LR scheduler as an `LrScheduler`. `step()` steps it and returns the
    first group's new learning rate (ReduceLROnPlateau needs its metric: call its own
    `step(metric)`).

    The record is the `state_dict` and, under `#identity`, what identifies the schedule
    beyond it (`identity.py`: the children's classes, the functions by name, a
    `functools.partial`'s keywords). A restore compares the schedule's constructor
    arguments and that identity with the live scheduler's and refuses any difference
    (`RecordMismatchError` naming each field with both values) unless `allow_changes`
    names it; an allowed field keeps its live value. A record without `#identity`
    (written before it was kept) loads with its functions and children's classes
    unchecked, and an `UncheckedIdentityWarning` naming them."""

    def __init__(self, scheduler: Any) -> None:
        if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "load_state_dict"):
            raise TypeError(f"{type(scheduler).__name__} is not a torch LR scheduler")
        self.scheduler = scheduler

    @property
    def kind(self) -> str:
        return _kind(self.scheduler)

    def step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    def into_record(self) -> StateRecord:
        item = encode(self.scheduler.state_dict())
        if not isinstance(item, dict) or IDENTITY_KEY in item:
            raise TypeError(f"the state dict of {self.kind} is not a map of str keys without "
                            f"{IDENTITY_KEY!r}")
        item[IDENTITY_KEY] = identity_of(self.scheduler)
        return StateRecord(self.kind, item)

    def _checked(self, record: Any, allow: frozenset[str],
                 warn: bool = True) -> tuple[dict[str, Any], dict[str, Any], frozenset[str]]:
        """(the record's state dict item, the live state dict, the fields allowed to
        differ, whose live values the load keeps)."""
        item = expect_kind(record, self.kind, "scheduler")
        state, live, changes, fields, unknown = self.compare(item)
        if unknown and warn:
            unchecked(sorted({".".join(p.split(".")[:2]) for p in unknown}), allow, f"the {self.kind} schedule")
        accepted = settle(changes, fields | unknown, allow, f"the fields of the live {self.kind} schedule",
                          "Build the scheduler as the recorded run did.")
        return state, live, accepted

    def compare(self, item: Item, path: str = "scheduler") -> tuple[
            dict[str, Any], dict[str, Any], list[Change], set[str], set[str]]:
        """A scheduler record's item against the live scheduler: (its state dict item, the
        live state dict, the fields that differ, every field compared, the fields only an
        identity would say and the item has none: an older record's). `RecordMismatchError`
        for a state dict of other keys (another class) or a malformed identity."""
        live = self.scheduler.state_dict()
        identity = item.get(IDENTITY_KEY) if isinstance(item, dict) else None
        state = {k: v for k, v in item.items() if k != IDENTITY_KEY} if isinstance(item, dict) else item
        if not isinstance(state, dict) or set(state) != set(live):
            raise RecordMismatchError(
                f"scheduler state keys differ: record {sorted(state) if isinstance(state, dict) else state!r}, "
                f"live {sorted(live)}", key=path)
        self._check_children(state, live, path)
        live_identity = identity_of(self.scheduler)
        recorded_fields = scheduler_fields(state, self.scheduler, path)
        live_fields = scheduler_fields(encode(live), self.scheduler, path)
        unknown: set[str] = set()
        if isinstance(identity, dict):
            recorded_fields.update(flatten(identity, path))
            live_fields.update(flatten(live_identity, path))
        elif identity is not None:
            raise RecordMismatchError(f"{IDENTITY_KEY} must be a map, got {type(identity).__name__}",
                                      key=f"{path}.{IDENTITY_KEY}")
        else:  # an older record: what only the identity says goes unchecked
            unknown = {p for p in flatten(live_identity, path) if p != f"{path}.class"}
        refusals = base_lrs_refusals(self.scheduler, state, path)
        changes = [dataclasses.replace(c, refusal=refusals[c.path]) if refusals.get(c.path) else c
                   for c in field_changes(recorded_fields, live_fields)]
        return state, live, changes, set(recorded_fields) | set(live_fields), unknown

    @staticmethod
    def _check_children(state: dict[str, Any], live: dict[str, Any], path: str = "scheduler") -> None:
        """The children of a `SequentialLR` / `ChainedScheduler`, at any depth: as many, each
        with the live one's state keys."""
        recorded, live_children = state.get("_schedulers"), live.get("_schedulers")
        if not isinstance(live_children, list):
            return
        if not isinstance(recorded, list) or len(recorded) != len(live_children):
            raise RecordMismatchError(
                f"the record holds {len(recorded) if isinstance(recorded, list) else 'no'} "
                f"child schedulers, the live scheduler {len(live_children)}", key=f"{path}._schedulers")
        for i, (r, c) in enumerate(zip(recorded, live_children)):
            at = f"{path}._schedulers.{i}"
            if not isinstance(r, dict) or not isinstance(c, dict) or set(r) != set(c):
                raise RecordMismatchError(
                    f"child scheduler {i if path == 'scheduler' else at}'s state keys differ: record "
                    f"{sorted(r) if isinstance(r, dict) else r!r}, live "
                    f"{sorted(c) if isinstance(c, dict) else c!r} (another class?)", key=at)
            TorchLrScheduler._check_children(r, c, at)

    def check_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        self._checked(record, allow_changes)

    def load_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        state, live, accepted = self._checked(record, allow_changes, warn=False)
        decoded = decode(state, live)
        for path in accepted:
            take_live(decoded, live, path.split(".")[1:])
        self.scheduler.load_state_dict(decoded)


def take_live(decoded: Any, live: Any, at: list[str]) -> None:
    """Put the live value of the state-dict field at `at` into `decoded` (a field only the
    identity has, such as a function's name, is left: functions are never loaded)."""
    for i, key in enumerate(at):
        last = i == len(at) - 1 or at[i + 1] == "attributes"
        if isinstance(decoded, dict) and isinstance(live, dict) and key in decoded and key in live:
            if last:
                decoded[key] = live[key]
                return
            decoded, live = decoded[key], live[key]
        elif isinstance(decoded, list) and isinstance(live, list) and key.isdigit() \
                and int(key) < min(len(decoded), len(live)):
            if last:
                decoded[int(key)] = live[int(key)]
                return
            decoded, live = decoded[int(key)], live[int(key)]
        else:
            return


def _is_scheduler(obj: Any) -> bool:
    sched = torch.optim.lr_scheduler
    return isinstance(obj, (sched.LRScheduler, sched.ReduceLROnPlateau))
