"""A trainrec adapter for minigrad (tests/minigrad.py), written from spec/ADAPTERS.md as an
adapter author outside trainrec writes one (it imports only `trainrec` and
`trainrec.adapter_kit`).

It is the base of the conformance suite's mutation test (tests/test_conformance_mutants.py)
wherever the numpy reference cannot be broken the way a real framework's adapter is:
gradients pending on the tensors themselves (`.grad`), mutable tensors whose `add` is not in
place, a framework-global RNG (kept per run, `own_rng`), a model that is a plain user class
(bound by the wrapper `MiniModule(net)`, spec/ADAPTERS.md section 3), and an optimizer that
holds its state by position and keeps no step count.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import minigrad
import numpy as np
from minigrad import Adam, Linear, Tensor, get_parameters, get_state_dict

import trainrec
from trainrec import GradientsParams, RecordMismatchError, RngRecord, StateRecord, TensorData
from trainrec.adapter_kit import (
    DType,
    Parts,
    Workload,
    check_tensor_map,
    expect_kind,
    kind_mismatches,
)

# -- backend ------------------------------------------------------------------------------


def _td(t: Tensor) -> TensorData:
    return TensorData.from_array(np.array(t.data, copy=True, order="C"), copy=False)


class MiniBackend:
    """minigrad tensors on its one device, "cpu"."""

    name = "minigrad"

    def device(self, spec: Any) -> str:
        if spec is None or spec in ("cpu", "cpu:0"):
            return "cpu"
        raise ValueError(f"minigrad has one device, 'cpu' (also 'cpu:0'); got {spec!r}")

    def device_of(self, tensor: Tensor) -> str:
        return "cpu"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, Tensor)

    def dtype_of(self, tensor: Tensor) -> DType:
        return DType.from_numpy(tensor.dtype)

    def shape_of(self, tensor: Tensor) -> tuple[int, ...]:
        return tensor.shape

    def to_host(self, tensor: Tensor) -> np.ndarray[Any, Any]:
        return np.array(tensor.data, copy=True, order="C")

    async def to_host_async(self, tensor: Tensor) -> np.ndarray[Any, Any]:
        return self.to_host(tensor)

    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> Tensor:
        self.device(device)
        return Tensor(array, array.dtype)

    def cast(self, tensor: Tensor, dtype: DType) -> Tensor:
        return tensor.cast(dtype.numpy)

    def clone(self, tensor: Tensor) -> Tensor:
        return tensor.clone()

    def add(self, pending: Tensor, grad: Tensor) -> Tensor:
        """A new tensor (minigrad's `+` is not in place)."""
        return (pending + grad).cast(pending.dtype)


BACKEND = MiniBackend()

# -- bindings -----------------------------------------------------------------------------


class MiniModule:
    """A minigrad model, any object holding Tensors, as an AutodiffModule.

    minigrad models are plain user classes, which `trainrec.adapt` cannot tell from any
    other object: the caller wraps its model once (`model = MiniModule(net)`) and passes
    the wrapper wherever trainrec takes a model. Gradients pending in the tensors' own
    `.grad` are part of the record (`grads`), so a checkpoint between two backward calls
    resumes them."""

    kind = "minigrad.Module"
    backend = BACKEND

    def __init__(self, net: Any) -> None:
        self.net = net

    def tensors(self) -> dict[str, Tensor]:
        return get_state_dict(self.net)

    def param_ids(self) -> list[str]:
        return list(self.tensors())

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: t.shape for k, t in self.tensors().items()}

    def into_record(self) -> StateRecord:
        tensors = self.tensors()
        return StateRecord(self.kind, {
            "tensors": {k: _td(t) for k, t in tensors.items()},
            "grads": {k: _td(t.grad) for k, t in tensors.items() if t.grad is not None},
        })

    def _checked(self, record: Any) -> tuple[dict[str, Tensor], dict[str, TensorData], dict[str, TensorData]]:
        item = expect_kind(record, self.kind, "model")
        if not isinstance(item, dict) or set(item) != {"tensors", "grads"}:
            raise RecordMismatchError("minigrad module record must be {tensors, grads}", key="model")
        live = self.tensors()
        expected = {k: (t.shape, BACKEND.dtype_of(t)) for k, t in live.items()}
        return (live, check_tensor_map(item["tensors"], expected, "model"),
                check_tensor_map(item["grads"], expected, "model.grads", allow_subset=True))

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any, device: Any) -> None:
        BACKEND.device(device)
        live, tensors, grads = self._checked(record)
        staged = {k: t.array.astype(live[k].dtype) for k, t in tensors.items()}
        staged_grads = {k: Tensor(t.array, live[k].dtype) for k, t in grads.items()}
        for k, t in live.items():  # in place: the optimizer keeps pointing at these tensors
            t.assign(staged[k])
            t.grad = staged_grads.get(k)


class MiniAdam:
    """A minigrad `Adam` as an Optimizer: its positional lists keyed by ParamId. It keeps
    no step count, so the record holds what it keeps, `b1_t` and `b2_t`, exactly."""

    kind = "minigrad.Adam"

    def __init__(self, optimizer: Adam) -> None:
        self.optimizer = optimizer

    def _names(self, module: Any) -> list[str]:
        ids = {id(t): k for k, t in trainrec.adapt(module).tensors().items()}
        missing = [i for i, p in enumerate(self.optimizer.params) if id(p) not in ids]
        if missing:
            raise TypeError(f"the optimizer's parameters {missing} are not in the model")
        return [ids[id(p)] for p in self.optimizer.params]

    def _hyper(self) -> dict[str, Any]:
        o = self.optimizer
        return {"lr": float(o.lr), "b1": float(o.b1), "b2": float(o.b2), "eps": float(o.eps)}

    def into_record(self, module: Any) -> StateRecord:
        o = self.optimizer
        state = {n: {"m": _td(m), "v": _td(v)} for n, m, v in zip(self._names(module), o.m, o.v)}
        return StateRecord(self.kind, {"hyper": self._hyper(), "b1_t": float(o.b1_t),
                                       "b2_t": float(o.b2_t), "state": state})

    def _checked(self, record: Any, module: Any) -> tuple[dict[str, Any], list[str]]:
        item = expect_kind(record, self.kind, "optimizer")
        if not isinstance(item, dict) or set(item) != {"hyper", "b1_t", "b2_t", "state"}:
            raise RecordMismatchError("minigrad Adam record must be {hyper, b1_t, b2_t, state}", key="optimizer")
        problems = (kind_mismatches(item["hyper"], self._hyper(), "optimizer.hyper")
                    + kind_mismatches(item["b1_t"], 1.0, "optimizer.b1_t")
                    + kind_mismatches(item["b2_t"], 1.0, "optimizer.b2_t"))
        if problems:
            raise RecordMismatchError("; ".join(problems), key="optimizer")
        names, state = self._names(module), item["state"]
        if not isinstance(state, dict):
            raise RecordMismatchError("optimizer state must be a map", key="optimizer.state")
        unknown = [k for k in state if k not in names]
        if unknown:
            raise RecordMismatchError(f"state for parameters the model lacks: {unknown}", key="optimizer.state")
        shapes = trainrec.adapt(module).param_shapes()
        for pid in names:  # minigrad's Adam holds buffers for every parameter from the start
            check_tensor_map(state.get(pid), {"m": (shapes[pid], DType.F32), "v": (shapes[pid], DType.F32)},
                             f"optimizer.state.{pid}")
        return item, names

    def check_record(self, record: Any, module: Any) -> None:
        self._checked(record, module)

    def load_record(self, record: Any, module: Any, device: Any) -> None:
        BACKEND.device(device)
        item, names = self._checked(record, module)
        o = self.optimizer
        staged = [(item["state"][n]["m"].array, item["state"][n]["v"].array) for n in names]
        for (m, v), live_m, live_v in zip(staged, o.m, o.v):
            live_m.assign(m)
            live_v.assign(v)
        o.b1_t, o.b2_t = float(item["b1_t"]), float(item["b2_t"])
        for k, v in item["hyper"].items():
            setattr(o, k, float(v))


class CosineLr:
    """minigrad has no schedulers: the adapter's own, `lr * (1 + cos(pi * count / total)) / 2`."""

    kind = "trainrec_minigrad.CosineLr"

    def __init__(self, lr: float, total: int) -> None:
        self.lr, self.total, self.count = lr, total, 0

    def step(self) -> float:
        rate = self.lr * (1 + np.cos(np.pi * min(self.count, self.total) / self.total)) / 2
        self.count += 1
        return float(rate)

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {"count": self.count})

    def _checked(self, record: Any) -> int:
        item = expect_kind(record, self.kind, "scheduler")
        count = item.get("count") if isinstance(item, dict) and set(item) == {"count"} else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise RecordMismatchError(f"scheduler record must be {{count: int >= 0}}, got {item!r}", key="scheduler")
        return count

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any) -> None:
        self.count = self._checked(record)


class MiniAdapter:
    """Claims minigrad tensors, their type and its optimizer (a model is bound by `MiniModule`)."""

    name = "minigrad"

    def adapt(self, obj: Any) -> Any:
        if obj is Tensor or isinstance(obj, Tensor):
            return BACKEND
        if isinstance(obj, Adam):
            return MiniAdam(obj)
        return None


ADAPTER = MiniAdapter()
trainrec.register_adapter(ADAPTER, roots=["minigrad"])

# -- the workload -------------------------------------------------------------------------


@trainrec.record
class MiniState:
    micro: int
    losses: list[float]
    rng: RngRecord | None = None


class Net:
    """A user's model: a plain class."""

    def __init__(self) -> None:
        self.l1 = Linear(8, 16)
        self.l2 = Linear(16, 3)


def take_grads(model: MiniModule) -> GradientsParams:
    """Each tensor's `.grad` into a GradientsParams, by ParamId, leaving `.grad` None."""
    grads = GradientsParams()
    for name, t in model.tensors().items():
        if t.grad is not None:
            grads.register(name, t.grad)
            t.grad = None
    return grads


@contextmanager
def own_rng(parts: Parts) -> Iterator[None]:
    """This run's RNG as minigrad's global one while it draws: the conformance suite runs
    several runs side by side in one process, and each must draw from its own."""
    gen: np.random.Generator = parts.extras["gen"]
    saved = minigrad.rng_state()
    minigrad.set_rng_state(gen.bit_generator.state)
    try:
        yield
    finally:
        gen.bit_generator.state = minigrad.rng_state()
        minigrad.set_rng_state(saved)


class MiniWorkload(Workload):
    name = "minigrad"
    ref = "trainrec_minigrad:WORKLOAD"
    state_type = MiniState
    device = "cpu"
    dtypes = tuple(d for d in DType if d is not DType.BF16)

    def build(self, seed: int) -> Parts:
        random.seed(seed)  # RngRecord records Python's and numpy's global RNGs too
        np.random.seed(seed)
        minigrad.manual_seed(seed)  # the initial weights come from the global RNG
        net = Net()
        model = MiniModule(net)
        return Parts(model, Adam(get_parameters(net), lr=0.01), CosineLr(0.01, 20), MiniState(0, []),
                     extras={"gen": np.random.Generator(np.random.PCG64(seed + 1))})

    def micro_step(self, parts: Parts) -> None:
        net = parts.model.net
        with own_rng(parts):
            x = minigrad.randn(6, 8).data
            loss = minigrad.mlp_backward([net.l1, net.l2], x, np.tanh(x[:, :3]), dropout=0.2)
        parts.accumulator.accumulate(parts.model, take_grads(parts.model))
        parts.state.losses.append(loss)

    def apply_window(self, parts: Parts, window: int) -> None:
        grads = parts.accumulator.grads()
        for name, t in parts.model.tensors().items():
            g = grads.get(name)
            t.grad = None if g is None else Tensor.wrap(g.data / np.float32(window))
        parts.optimizer.lr = parts.scheduler.step()
        parts.optimizer.step()
        parts.optimizer.zero_grad()

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = RngRecord.capture(parts.extras["gen"])

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply(parts.extras["gen"])

    def reorder(self, parts: Parts) -> bool:
        net = parts.model.net
        net.__dict__ = dict(reversed(vars(net).items()))  # l2 before l1: another param_ids() order
        return True

    def native_grads(self, parts: Parts) -> dict[str, np.ndarray[Any, Any]] | None:
        return {k: t.grad.numpy() for k, t in parts.model.tensors().items() if t.grad is not None}

    def set_native_grads(self, parts: Parts, grads: dict[str, np.ndarray[Any, Any]]) -> None:
        for k, t in parts.model.tensors().items():
            t.grad = Tensor(grads[k], t.dtype) if k in grads else None

    def overwrite(self, parts: Parts, tensor: Any, array: np.ndarray[Any, Any]) -> bool:
        tensor.assign(array)
        return True

    def native_objects(self, parts: Parts) -> list[object]:
        return [parts.model, parts.optimizer, parts.scheduler, Tensor([1.0])]


WORKLOAD = MiniWorkload()
