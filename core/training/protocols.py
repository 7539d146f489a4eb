"""The protocols generic trainrec code is written against.

An adapter binds a framework by implementing these (see spec/PROTOCOLS.md and
spec/ADAPTERS.md). Every method that receives a record validates it and raises
`RecordMismatchError` (a `RecorderError`) instead of failing half way; `check_record`
never mutates, so `TrainingRecord.restore` can check every component before it
changes any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ..items.dtypes import DType
from ..precision import PrecisionSettings

if TYPE_CHECKING:
    from ..format.header import Header
    from ..items.tree import Item
    from .state_record import StateRecord

__all__ = [
    "ParamId",
    "PrecisionSettings",
    "Record",
    "Recorder",
    "Backend",
    "AutodiffBackend",
    "Module",
    "AutodiffModule",
    "Optimizer",
    "LrScheduler",
]

ParamId = str
"""A parameter's stable name: torch `named_parameters()` name, JAX key path joined with `.`."""


@runtime_checkable
class Record(Protocol):
    """A value that converts to and from an item tree.

    `into_item(settings)` returns a tree whose float/int tensors follow `settings` and
    that shares no mutable storage with live objects. `from_item(item, device)` rebuilds
    the record, raising `RecorderError` when `item` is not of the expected shape.
    """

    def into_item(self, settings: PrecisionSettings) -> Item: ...

    @classmethod
    def from_item(cls, item: Item, device: Any = None) -> Any: ...


@runtime_checkable
class Recorder(Protocol):
    """Moves records to a payload (file, bytes) and back; it never interprets them.

    `record` writes `record.into_item(...)` following `settings` and returns the output
    (a path, bytes); `load` reads a payload and returns `record_type.from_item(item,
    device)`. `save_item` / `load_item` are the same without the record conversion;
    `read` returns the payload's header with its item (`TrainingRecord.load` checks the
    header's record type before rebuilding). `settings` choose each tensor's storage
    dtype; a load gives every tensor back in the dtype it was saved with. A save raises
    `LossyPrecisionError` when the settings would change a value, unless
    `allow_lossy=True` and the value is a float's (integers never change). Every failure raises a `RecorderError`; a
    failed save never damages an existing payload.
    """

    @property
    def settings(self) -> PrecisionSettings: ...
    def record(self, record: Record, args: Any, *, allow_lossy: bool = ...) -> Any: ...
    def load(self, args: Any, device: Any, record_type: type[Any]) -> Any: ...
    def save_item(
        self, item: Item, args: Any, record_type: str = ..., *, allow_lossy: bool = ...
    ) -> Any: ...
    def load_item(self, args: Any) -> Item: ...
    def read(self, args: Any) -> tuple[Header, Item]: ...


@runtime_checkable
class Backend(Protocol):
    """Tensor operations trainrec needs from a framework.

    `to_host` returns a new C-contiguous numpy array (never a view of device or live
    memory); `to_host_async` the same without blocking the event loop on device copies;
    `from_host` a new tensor on `device` that does not alias the array. `device(spec)`
    turns a user's device (native object or string) into the backend's own, raising
    `ValueError` for one it does not have.
    """

    @property
    def name(self) -> str: ...
    def device(self, spec: Any) -> Any: ...
    def device_of(self, tensor: Any) -> Any: ...
    def is_tensor(self, obj: Any) -> bool: ...
    def dtype_of(self, tensor: Any) -> DType: ...
    def shape_of(self, tensor: Any) -> tuple[int, ...]: ...
    def to_host(self, tensor: Any) -> np.ndarray[Any, Any]: ...
    async def to_host_async(self, tensor: Any) -> np.ndarray[Any, Any]: ...
    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> Any: ...
    def cast(self, tensor: Any, dtype: DType) -> Any: ...
    def clone(self, tensor: Any) -> Any: ...


@runtime_checkable
class AutodiffBackend(Backend, Protocol):
    """A backend whose tensors are gradients to accumulate.

    `add(pending, grad)` returns `pending + grad` in `pending`'s dtype; it may write into
    `pending` (which the accumulator owns) and never writes into `grad`.

    Optional: `add_many(pending, grads, dtype)` with lists of equal length, where
    `pending[i]` may be None; it returns for each pair what the accumulator's per-pair
    path gives (cast both to `dtype`, else to pending's dtype, and add; with no pending a
    new tensor of the gradient cast to `dtype`, else its own), in one call: the JAX
    backend runs one jitted function. The accumulator uses it when present.
    """

    def add(self, pending: Any, grad: Any) -> Any: ...


@runtime_checkable
class Module(Protocol):
    """A model whose whole state (parameters and buffers) is one record.

    `into_record()` copies: later training does not change it. `check_record(r)` raises
    `RecordMismatchError` unless `load_record(r, device)` would fit (same names, shapes,
    dtypes castable) and never mutates. `load_record` writes the values into the live
    model (in place: objects that point at parameters keep pointing at them).
    """

    def into_record(self) -> StateRecord: ...
    def check_record(self, record: StateRecord) -> None: ...
    def load_record(self, record: StateRecord, device: Any) -> None: ...


@runtime_checkable
class AutodiffModule(Module, Protocol):
    """A module with trainable parameters that receive gradients.

    `param_shapes()` maps every trainable ParamId, in a stable order, to its shape;
    `backend` is the backend of its tensors.
    """

    @property
    def backend(self) -> AutodiffBackend: ...
    def param_ids(self) -> Sequence[str]: ...
    def param_shapes(self) -> Mapping[str, tuple[int, ...]]: ...


@runtime_checkable
class Optimizer(Protocol):
    """An optimizer whose state is keyed by ParamId.

    `kind` names the algorithm (restore refuses a record of another kind).
    `into_record(module)` copies every per-parameter state and hyperparameter;
    `check_record` / `load_record` as for `Module`. A record must survive a different
    parameter order: it is keyed by ParamId, never by position.
    """

    @property
    def kind(self) -> str: ...
    def into_record(self, module: AutodiffModule) -> StateRecord: ...
    def check_record(self, record: StateRecord, module: AutodiffModule) -> None: ...
    def load_record(self, record: StateRecord, module: AutodiffModule, device: Any) -> None: ...


@runtime_checkable
class LrScheduler(Protocol):
    """A learning-rate schedule with a position.

    `step()` returns the learning rate for the next optimizer step and advances.
    `into_record` / `check_record` / `load_record` as for `Module`; loading performs no
    step.
    """

    def step(self) -> float: ...
    def into_record(self) -> StateRecord: ...
    def check_record(self, record: StateRecord) -> None: ...
    def load_record(self, record: StateRecord) -> None: ...
