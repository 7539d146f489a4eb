"""The `timeout` cases of the spawned 2-rank harnesses (`ddp_run.py`, `fsdp_run.py`): what
a rank records of each call, and what their tests check of a call that timed out."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import trainrec


def attempt(out: Path, case: str, rank: int, call: Callable[[], Any],
            snapshot: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Run `call` on this rank and write OUT/timeout-CASE-RANK.json: the `RecorderError`'s
    type and message (None without one), the seconds it took, and whether `snapshot()` (this
    rank's own tensors, by name) is the same after it."""
    before = snapshot()
    start = time.monotonic()
    try:
        call()
        result: dict[str, Any] = {"error": None}
    except trainrec.RecorderError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    after = snapshot()
    result["unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)
    (out / f"timeout-{case}-{rank}.json").write_text(json.dumps(result))


def outcome(out: Path, case: str, rank: int) -> dict[str, Any]:
    """What `attempt` wrote of `case` on `rank`."""
    return json.loads((out / f"timeout-{case}-{rank}.json").read_text())


def assert_timed_out(got: dict[str, Any], missing: int, what: str) -> None:
    """`got` (an `outcome`) is `what` (e.g. "DCPRecorder.save") called on one rank with
    timeout=2: a RecorderError in seconds, not at the group's timeout, naming the rank
    `missing` that did not join and saying what to do, the live tensors unchanged."""
    assert got["error"] == "RecorderError" and got["seconds"] < 20, got
    assert got["message"].startswith(f"rank(s) {missing} of the process group did not join "
                                     f"{what} within 2 s"), got
    assert "must be called on every rank" in got["message"] and "restart the run" in got["message"]
    assert got["unchanged"]
