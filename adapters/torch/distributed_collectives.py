"""How the ranks of a distributed save or load act together: this rank and the world
size, gathering every rank's outcome (`agree`), and meeting in the process group's store
within a timeout (`meet`) so that a rank that never comes fails the others before
anything is written or read.
"""

from __future__ import annotations

import datetime
import math
import numbers
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainrec import RecorderError


def _rank_world(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _src(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _broadcast(message: list[Any], group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(message, src=_src(group), group=group)


def _all_gather(out: list[Any], value: Any, group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_gather_object(out, value, group=group)
    else:
        out[0] = value


def agree(failure: Exception | None, group: Any, source: str) -> None:
    """Collective, for loads: every rank tells the others whether its part went well. Raises
    this rank's own `failure`, else `RecorderError` naming the first rank that failed and
    its error, so that no rank restores while another cannot (and then waits for it at its
    next collective until the group's timeout)."""
    world = _rank_world(group)[1]
    outcomes: list[Any] = [None] * world
    if world > 1:
        _all_gather(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}",
                    group)
    if failure is not None:
        raise failure
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise RecorderError(f"rank {r} could not load its part of the checkpoint ({msg}); no "
                            "rank restores from it", source=source)


_NOT_COMMITTED = "nothing was committed, and earlier checkpoints are untouched"


def timeout_seconds(timeout: Any) -> float | None:
    """The distributed recorders' `timeout=`: seconds (a positive finite number or
    `datetime.timedelta`) as a float, or None. `TypeError` / `ValueError` otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError("timeout must be a number of seconds or a datetime.timedelta (or None: "
                        f"the process group's own timeout), got {type(timeout).__name__}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be positive and finite, got {timeout!r} (None waits as "
                         "long as the process group's own timeout)")
    return seconds


_meetings: dict[str, int] = {}  # group name -> meetings this process held on it


def meet(group: Any, timeout: float | None, what: str, path: Path) -> None:
    """With a `timeout` and several ranks: every rank of `group` meets before `what` (a save
    or load, e.g. "DCPRecorder.save") touches anything, in the group's store (not a
    collective: any backend, and never interleaved with the group's collectives). Returns
    once every rank arrived; raises `RecorderError` on every rank that arrived when one had
    not within `timeout` seconds of the first wait's start. The ranks agree on the outcome
    (the store's compare-and-set decides it once), so either all that arrived go on or all
    raise; one arriving after the others gave up raises at once.

    The ranks number their meetings on a group alike when every rank makes the same calls
    (after a failed one they are out of step, and every later one fails too); a meeting's
    keys are removed once the next one succeeded (every rank has left it by then)."""
    if timeout is None:
        return
    rank, world = _rank_world(group)
    if world == 1:
        return
    pg: Any = dist.group.WORLD if group is None else group
    name = str(pg.group_name)
    number = _meetings.get(name, 0)
    _meetings[name] = number + 1
    key = f"trainrec/meeting/{number}/{what}"
    outcome_key, arrived_key = f"{key}/outcome", f"{key}/arrived"
    try:
        get_store = getattr(pg, "get_group_store", None)
        store: Any = (get_store() if get_store is not None  # older torch: the private map
                      else dist.distributed_c10d._get_process_group_store(pg))
        store.set(f"{key}/rank/{rank}", "")
        if store.add(arrived_key, 1) == world:
            outcome = store.compare_set(outcome_key, "", "go")
        elif _appears(store, outcome_key, timeout):
            outcome = store.get(outcome_key)
        else:
            missing = [r for r in range(world) if not store.check([f"{key}/rank/{r}"])]
            outcome = store.compare_set(  # none missing: the last one is between its set and add
                outcome_key, "", "missing:" + ",".join(map(str, missing)) if missing else "go")
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if outcome == "go":  # every rank came here, so every rank has left the last meeting
            _forget_meeting(store, _previous.pop(name, None), rank)
            _previous[name] = key
            return
    except RuntimeError as e:  # the store is gone (its host, rank 0, died) or refuses
        raise RecorderError(f"the ranks could not meet before {what} in the process group's "
                            f"store: {e}", source=str(path)) from e
    missing = [int(r) for r in outcome.removeprefix("missing:").split(",") if r]
    done = ("nothing was written, and earlier checkpoints are untouched" if what.endswith("save")
            else "nothing was loaded: the live objects are unchanged")
    if rank in missing:
        happened = (f"this rank (rank {rank}) joined {what} more than {timeout:g} s after the "
                    "rank(s) waiting for it, which gave up")
    else:
        happened = (f"rank(s) {', '.join(map(str, missing))} of the process group did not "
                    f"join {what} within {timeout:g} s")
    raise RecorderError(
        f"{happened}: {what} is collective and must be called on every rank of the group (not "
        f"under `if rank == 0:`); {done}. The ranks are out of step now, and the process "
        "group may be unusable: restart the run", source=str(path))


_previous: dict[str, str] = {}  # group name -> the last meeting's keys, removed at the next


def _appears(store: Any, key: str, timeout: float) -> bool:
    """Whether `key` is in `store` within `timeout` seconds (polled: a store's own `wait`
    rounds a FileStore's timeout up to whole seconds, and a TCPStore logs each one)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.02)
    return True


def _forget_meeting(store: Any, key: str | None, rank: int) -> None:
    if key is None:
        return
    store.delete_key(f"{key}/rank/{rank}")
    if rank == 0:
        store.delete_key(f"{key}/arrived")
        store.delete_key(f"{key}/outcome")


def _collective(call: Any, path: Path, what: str, abandon: Any,
                outcome: str = _NOT_COMMITTED) -> None:
    """Run a collective; when it fails (a peer died, a timeout), `abandon` the save and
    raise `RecorderError` saying `outcome`."""
    try:
        call()
    except RuntimeError as e:  # gloo and NCCL errors (DistBackendError too) are RuntimeErrors
        abandon()
        raise RecorderError(
            f"the ranks could not meet while {what} (a rank died, or the process group timed "
            f"out: {e}); {outcome}", source=str(path)) from e
