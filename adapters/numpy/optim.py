"""Reference optimizers with torch.optim's update formulas: `SGD`, `Adam`, `AdamW`.

`step(lr, module, grads)` updates the module's parameters in place (as Burn's
`Optimizer::step`); parameters without a gradient are skipped and get no state.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainrec import DType, GradientsParams, RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import Item, check_tensor_map, expect_kind, kind_mismatches

from .mlp import MLP

__all__ = ["SGD", "Adam", "AdamW"]

_Array = np.ndarray[Any, Any]


class _Optimizer:
    kind = ""
    _state_names: tuple[str, ...] = ()  # per-parameter state after a first step

    def __init__(self, **hyper: float | bool) -> None:
        self.hyper: dict[str, float | bool] = dict(hyper)
        self.state: dict[str, dict[str, Any]] = {}

    def step(self, lr: float, module: MLP, grads: GradientsParams) -> None:
        for pid in module.param_ids():
            g = grads.get(pid)
            if g is not None:
                self._update(lr, module.params[pid], g, self.state.setdefault(pid, {}))

    def _update(self, lr: float, p: _Array, g: _Array, s: dict[str, Any]) -> None:
        raise NotImplementedError

    def _state_keys(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The keys of a parameter's state after its first step, under `hyper`."""
        return self._state_names

    def into_record(self, module: Any) -> StateRecord:
        state: dict[str, Item] = {}
        for pid, s in self.state.items():
            entry: dict[str, Item] = {}
            for name, v in s.items():
                entry[name] = TensorData.from_array(v) if isinstance(v, np.ndarray) else v
            state[pid] = entry
        hyper: dict[str, Item] = dict(self.hyper)
        return StateRecord(self.kind, {"hyper": hyper, "state": state})

    def _checked(self, record: Any, module: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        item = expect_kind(record, self.kind, "optimizer")
        if not isinstance(item, dict) or set(item) != {"hyper", "state"}:
            raise RecordMismatchError("optimizer record must be {hyper, state}", key="optimizer")
        hyper, state = item["hyper"], item["state"]
        if not isinstance(hyper, dict) or set(hyper) != set(self.hyper):
            raise RecordMismatchError(
                f"hyperparameters differ: record {sorted(hyper) if isinstance(hyper, dict) else hyper!r}, "
                f"live {sorted(self.hyper)}",
                key="optimizer.hyper",
            )
        problems = kind_mismatches(hyper, dict(self.hyper), "")
        if problems:
            raise RecordMismatchError("; ".join(problems), key="optimizer.hyper")
        if not isinstance(state, dict):
            raise RecordMismatchError("optimizer state must be a map", key="optimizer.state")
        shapes = module.param_shapes()
        unknown = [pid for pid in state if pid not in shapes]
        if unknown:
            raise RecordMismatchError(
                f"state for parameters the model lacks: {unknown}", key="optimizer.state"
            )
        keys = self._state_keys(hyper)
        out: dict[str, dict[str, Any]] = {}
        for pid, entry in state.items():
            dtype = DType.from_numpy(module.params[pid].dtype)
            expected = {b: (shapes[pid], dtype) for b in keys if b != "step"}
            where = f"optimizer.state.{pid}"
            if not isinstance(entry, dict):
                raise RecordMismatchError("per-parameter state must be a map", key=where)
            if entry and set(entry) != set(keys):  # empty: no step yet
                raise RecordMismatchError(
                    f"state keys {sorted(entry)} in the record, the optimizer keeps {sorted(keys)}",
                    key=where)
            tensors = {k: v for k, v in entry.items() if k != "step"}
            check_tensor_map(tensors, expected, where, allow_subset=True)
            step = entry.get("step", 0.0)
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                raise RecordMismatchError(f"step must be a number, got {step!r:.40}", key=where)
            out[pid] = dict(entry)  # the record's order: a restored run re-saves the same bytes
        return dict(hyper), out

    def check_record(self, record: Any, module: Any) -> None:
        self._checked(record, module)

    def load_record(self, record: Any, module: Any, device: Any) -> None:
        hyper, state = self._checked(record, module)
        self.state = {
            pid: {
                k: (np.array(v.array, dtype=module.params[pid].dtype) if isinstance(v, TensorData) else v)
                for k, v in entry.items()
            }
            for pid, entry in state.items()
        }
        self.hyper = hyper


class SGD(_Optimizer):
    """torch.optim.SGD: L2 weight decay, momentum with dampening, nesterov."""

    kind = "trainrec.numpy.SGD"
    _state_names = ("momentum_buffer",)

    def _state_keys(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        return self._state_names if hyper["momentum"] else ()

    def __init__(
        self, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        super().__init__(momentum=momentum, dampening=dampening, nesterov=nesterov,
                         weight_decay=weight_decay)

    def _update(self, lr: float, p: _Array, g: _Array, s: dict[str, Any]) -> None:
        h = self.hyper
        mu, wd = float(h["momentum"]), float(h["weight_decay"])
        if wd:
            g = g + wd * p
        if mu:
            buf = s.get("momentum_buffer")
            if buf is None:
                buf = s["momentum_buffer"] = np.array(g, copy=True)
            else:
                buf *= mu
                buf += (1 - float(h["dampening"])) * g
            g = g + mu * buf if h["nesterov"] else buf
        p -= lr * g


class Adam(_Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient; no AMSGrad)."""

    kind = "trainrec.numpy.Adam"
    _state_names = ("step", "exp_avg", "exp_avg_sq")
    _decoupled = False

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)

    def _update(self, lr: float, p: _Array, g: _Array, s: dict[str, Any]) -> None:
        h = self.hyper
        b1, b2, eps, wd = float(h["beta1"]), float(h["beta2"]), float(h["eps"]), float(h["weight_decay"])
        if "exp_avg" not in s:
            s["step"] = 0.0
            s["exp_avg"] = np.zeros_like(p)
            s["exp_avg_sq"] = np.zeros_like(p)
        s["step"] += 1.0
        if self._decoupled:
            p *= 1 - lr * wd
        elif wd:
            g = g + wd * p
        m, v = s["exp_avg"], s["exp_avg_sq"]
        m += (1 - b1) * (g - m)
        v *= b2
        v += (1 - b2) * (g * g)
        step = s["step"]
        step_size = lr / (1 - b1**step)
        denom = np.sqrt(v) / math.sqrt(1 - b2**step) + eps
        p -= step_size * (m / denom)


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay `p *= 1 - lr*wd` (default 1e-2)."""

    kind = "trainrec.numpy.AdamW"
    _decoupled = True

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
