"""`GradientsParams` (live gradients by ParamId) and `GradientsParamsRecord` (their record)."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptRecordError
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, join_key
from ..precision import convert_tensor
from .protocols import ParamId, PrecisionSettings

__all__ = ["GradientsParams", "GradientsParamsRecord"]


class GradientsParams(Mapping[ParamId, Any]):
    """Gradients of a module's parameters, by ParamId, as the framework's tensors.

    A read-only `Mapping` (`g[pid]`, `keys()`, `values()`, `items()`, `dict(g)`) with
    Burn's methods besides: `register`, `get`, `remove`, `len()`, `is_empty()`. Two are
    equal only when they are the same object: tensors do not compare to one bool."""

    def __init__(self, grads: Mapping[ParamId, Any] | None = None) -> None:
        self._grads: dict[ParamId, Any] = dict(grads or {})

    def register(self, param_id: ParamId, tensor: Any) -> None:
        """Set the gradient of `param_id` (replacing any)."""
        self._grads[param_id] = tensor

    def __getitem__(self, param_id: ParamId) -> Any:
        try:
            return self._grads[param_id]
        except KeyError:
            raise KeyError(f"no gradient for ParamId {param_id!r}") from None

    def get(self, param_id: ParamId, default: Any = None) -> Any:
        """The gradient of `param_id`, or `default` (None) when it has none."""
        return self._grads.get(param_id, default)

    def remove(self, param_id: ParamId) -> Any | None:
        """Take the gradient of `param_id` out, returning it (None when absent)."""
        return self._grads.pop(param_id, None)

    def len(self) -> int:
        return len(self._grads)

    def is_empty(self) -> bool:
        return not self._grads

    def __len__(self) -> int:
        return len(self._grads)

    def __iter__(self) -> Iterator[ParamId]:
        return iter(self._grads)

    def __contains__(self, param_id: object) -> bool:
        return param_id in self._grads

    def items(self) -> ItemsView[ParamId, Any]:
        return self._grads.items()

    def keys(self) -> KeysView[ParamId]:
        return self._grads.keys()

    def values(self) -> ValuesView[Any]:
        return self._grads.values()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"GradientsParams({list(self._grads)})"


@dataclass(frozen=True)
class GradientsParamsRecord:
    """The record of pending gradients: host copies by ParamId, each keeping its dtype.

    Its item stores every gradient with its pending dtype, so a checkpoint written with
    other precision settings still restores the pending dtype.
    """

    grads: Mapping[ParamId, TensorData] = field(default_factory=dict)

    RECORD_NAME = "GradientsParamsRecord"

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {
            pid: {"dtype": t.dtype.value, "value": convert_tensor(t, settings)}
            for pid, t in self.grads.items()
        }

    @classmethod
    def from_item(cls, item: Item, device: Any = None, *, key: str = "") -> GradientsParamsRecord:
        """Rebuild from an item; raises `CorruptRecordError` naming the bad entry."""
        if not isinstance(item, dict):
            raise CorruptRecordError("pending gradients must be a map", key=key)
        grads: dict[ParamId, TensorData] = {}
        for pid, entry in item.items():
            where = join_key(key, pid)
            if not isinstance(entry, dict) or set(entry) != {"dtype", "value"}:
                raise CorruptRecordError("gradient entry must be {dtype, value}", key=where)
            value = entry["value"]
            if not isinstance(value, TensorData):
                raise CorruptRecordError("gradient value is not a tensor", key=where)
            try:
                dtype = DType.from_code(entry["dtype"])
            except ValueError:
                raise CorruptRecordError(f"unknown dtype {entry['dtype']!r}", key=where) from None
            if not dtype.is_float or not value.dtype.is_float:
                raise CorruptRecordError(f"gradients must be floats, got {dtype.value}", key=where)
            grads[pid] = value.cast(dtype)
        return cls(grads)
