"""A linear model with a hand-written gradient, SGD with momentum and a step schedule,
each implementing trainrec's protocols directly."""

from __future__ import annotations

from typing import Any

import array_api_strict as xp
import numpy as np

from trainrec import DType, GradientsParams, RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import check_tensor_map, expect_kind, kind_mismatches

from .adapter import BACKEND as _B
from .adapter import StrictBackend


def _td(a: Any) -> TensorData:
    return _B.to_tensor_data(a)


class Linear:
    """y = x @ w + b with mean-squared error; ParamIds `w` and `b`."""

    kind = "arraystrict.Linear"

    def __init__(self, n_in: int, n_out: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.params = {"w": xp.asarray(rng.normal(size=(n_in, n_out)).astype(np.float32)),
                       "b": xp.zeros((n_out,), dtype=xp.float32)}

    @property
    def backend(self) -> StrictBackend:
        return _B

    def param_ids(self) -> list[str]:
        return list(self.params)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.params.items()}

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, GradientsParams]:
        diff = x @ self.params["w"] + self.params["b"] - y
        n = diff.shape[0] * diff.shape[1]
        d = diff * (2.0 / n)
        return float(xp.sum(diff * diff)) / n, GradientsParams({"w": xp.matrix_transpose(x) @ d,
                                                                 "b": xp.sum(d, axis=0)})

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {k: _td(v) for k, v in self.params.items()})

    def _checked(self, record: Any) -> dict[str, TensorData]:
        expected = {k: (tuple(v.shape), DType.F32) for k, v in self.params.items()}
        return check_tensor_map(expect_kind(record, self.kind, "model"), expected, "model")

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any, device: Any) -> None:
        staged = {k: _B.from_tensor_data(t, device, DType.F32) for k, t in self._checked(record).items()}
        self.params = staged  # arrays are values: assigning is restoring


class SGD:
    """SGD with momentum (torch's formula); `step(lr, model, grads)`."""

    kind = "arraystrict.SGD"

    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = momentum
        self.buffers: dict[str, Any] = {}

    def step(self, lr: float, model: Linear, grads: GradientsParams) -> None:
        for pid, g in grads.items():
            buf = self.buffers.get(pid)
            buf = g if buf is None else buf * self.momentum + g
            self.buffers[pid] = buf
            model.params[pid] = model.params[pid] - lr * buf

    def into_record(self, module: Any) -> StateRecord:
        return StateRecord(self.kind, {"momentum": self.momentum,
                                       "buffers": {k: _td(v) for k, v in self.buffers.items()}})

    def _checked(self, record: Any, module: Any) -> dict[str, Any]:
        item = expect_kind(record, self.kind, "optimizer")
        if not isinstance(item, dict) or set(item) != {"momentum", "buffers"}:
            raise RecordMismatchError("SGD record must be {momentum, buffers}", key="optimizer")
        problems = kind_mismatches(item["momentum"], self.momentum, "optimizer.momentum")
        if problems:
            raise RecordMismatchError("; ".join(problems), key="optimizer.momentum")
        shapes = {k: (s, DType.F32) for k, s in module.param_shapes().items()}
        check_tensor_map(item["buffers"], shapes, "optimizer.buffers", allow_subset=True)
        return item

    def check_record(self, record: Any, module: Any) -> None:
        self._checked(record, module)

    def load_record(self, record: Any, module: Any, device: Any) -> None:
        item = self._checked(record, module)
        self.buffers = {k: _B.from_tensor_data(t, device) for k, t in item["buffers"].items()}
        self.momentum = float(item["momentum"])


class StepSchedule:
    """`lr * gamma ** (count // every)`; `step()` returns the rate, then advances."""

    kind = "arraystrict.StepSchedule"

    def __init__(self, lr: float, every: int, gamma: float) -> None:
        self.lr, self.every, self.gamma, self.count = lr, every, gamma, 0

    def step(self) -> float:
        lr = self.lr * self.gamma ** (self.count // self.every)
        self.count += 1
        return lr

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {"count": self.count})

    def check_record(self, record: Any) -> None:
        item = expect_kind(record, self.kind, "scheduler")
        if not isinstance(item, dict) or not isinstance(item.get("count"), int):
            raise RecordMismatchError("schedule record must hold an int count", key="scheduler")

    def load_record(self, record: Any) -> None:
        self.check_record(record)
        self.count = record.item["count"]
