"""Reference LR schedulers. `step()` returns the rate for the next optimizer step and
advances (optax's convention: the first call returns the rate at count 0)."""

from __future__ import annotations

import math
from typing import Any

from trainrec import RecordMismatchError, StateRecord
from trainrec.adapter_kit import expect_kind

__all__ = ["ConstantLr", "StepLr", "CosineAnnealingLr", "LinearWarmupCosineLr"]


class _Scheduler:
    kind = ""

    def __init__(self, **config: float | int) -> None:
        self.config = dict(config)
        self.count = 0

    def lr_at(self, count: int) -> float:
        raise NotImplementedError

    def step(self) -> float:
        lr = self.lr_at(self.count)
        self.count += 1
        return lr

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {"count": self.count, "config": dict(self.config)})

    def _checked(self, record: Any) -> tuple[int, dict[str, Any]]:
        item = expect_kind(record, self.kind, "scheduler")
        if not isinstance(item, dict) or set(item) != {"count", "config"}:
            raise RecordMismatchError("scheduler record must be {count, config}", key="scheduler")
        count, config = item["count"], item["config"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise RecordMismatchError(f"count must be an int >= 0, got {count!r}", key="scheduler.count")
        if not isinstance(config, dict) or set(config) != set(self.config):
            raise RecordMismatchError("scheduler configuration keys differ", key="scheduler.config")
        return count, dict(config)

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any) -> None:
        self.count, self.config = self._checked(record)


class ConstantLr(_Scheduler):
    kind = "trainrec.numpy.ConstantLr"

    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr)

    def lr_at(self, count: int) -> float:
        return float(self.config["lr"])


class StepLr(_Scheduler):
    """`lr * gamma ** (count // step_size)`, as torch's StepLR."""

    kind = "trainrec.numpy.StepLr"

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1) -> None:
        super().__init__(lr=lr, step_size=step_size, gamma=gamma)

    def lr_at(self, count: int) -> float:
        c = self.config
        return float(c["lr"]) * float(c["gamma"]) ** (count // int(c["step_size"]))


class CosineAnnealingLr(_Scheduler):
    """torch's closed form `eta_min + (lr - eta_min) * (1 + cos(pi * count / t_max)) / 2`
    (periodic past `t_max`, as torch)."""

    kind = "trainrec.numpy.CosineAnnealingLr"

    def __init__(self, lr: float, t_max: int, eta_min: float = 0.0) -> None:
        super().__init__(lr=lr, t_max=t_max, eta_min=eta_min)

    def lr_at(self, count: int) -> float:
        c = self.config
        lr, lo = float(c["lr"]), float(c["eta_min"])
        return lo + (lr - lo) * (1 + math.cos(math.pi * count / int(c["t_max"]))) / 2


class LinearWarmupCosineLr(_Scheduler):
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `eta_min`
    at `total` steps (clamped after, as optax's warmup_cosine_decay_schedule)."""

    kind = "trainrec.numpy.LinearWarmupCosineLr"

    def __init__(self, lr: float, warmup: int, total: int, eta_min: float = 0.0) -> None:
        if not 0 <= warmup < total:
            raise ValueError("need 0 <= warmup < total")
        super().__init__(lr=lr, warmup=warmup, total=total, eta_min=eta_min)

    def lr_at(self, count: int) -> float:
        c = self.config
        lr, warm, total, lo = float(c["lr"]), int(c["warmup"]), int(c["total"]), float(c["eta_min"])
        if count < warm:
            return lr * count / warm
        frac = min(1.0, (count - warm) / (total - warm))
        return lo + (lr - lo) * (1 + math.cos(math.pi * frac)) / 2
