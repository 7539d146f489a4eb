"""What a caller tells the manager besides the record: which checkpoints to keep (`KeepBest`,
metrics), preemption, and the checks of its step and metrics arguments.
"""

from __future__ import annotations

import math
import operator
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Metrics = Mapping[str, float]


@dataclass(frozen=True)
class KeepBest:
    """Keep the `k` steps with the best value of `metric`: the lowest (`mode="min"`) or
    the highest (`"max"`). Ties go to the newer step; a NaN ranks after every number.

    Raises `TypeError` / `ValueError` for a metric that is not a non-empty str, a mode
    other than "min" or "max", or a `k` that is not an int >= 1."""

    metric: str
    mode: Literal["min", "max"]
    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"KeepBest.metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"KeepBest.k must be an int >= 1, got {self.k!r}")


class Preemption:
    """The flag `CheckpointManager.preemption()` yields: true once one of its signals
    arrived (`signal` says which). Check it in the training loop."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None

    def __repr__(self) -> str:
        name = None if self.signal is None else signal.Signals(self.signal).name
        return f"Preemption(signal={name})"


def _step_arg(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError("a step is a non-negative int, got a bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"a step is a non-negative int, got {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"a step is a non-negative int, got {value}")
    return value


def _positive_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


def _metrics_arg(metrics: Metrics | None, best: KeepBest | None) -> dict[str, float]:
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of str to numbers, got {type(metrics).__name__}")
    values: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names are str, got {k!r}")
        if isinstance(v, bool):
            raise TypeError(f"metric {k!r} is a bool, not a number")
        try:
            values[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a real number, got {type(v).__name__}") from None
    if best is not None and best.metric not in values:
        raise ValueError(f"metrics must hold {best.metric!r}, the metric best= ranks by; got "
                         f"{sorted(values)}")
    return values


def _rank(value: float, mode: str) -> tuple[int, float]:
    if math.isnan(value):
        return (1, 0.0)
    return (0, value if mode == "min" else -value)
