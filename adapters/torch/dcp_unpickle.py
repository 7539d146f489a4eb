"""The restricted unpicklers `DCPRecorder`'s load reads DCP entries with: nothing a
hostile checkpoint holds is built or run.

- `_LayoutUnpickler`: the pickle `torch.save` writes for one plain tensor, read into a
  `_Layout` (storage key, dtype, offset, shape, strides) without building anything; any
  other global is refused (`_ForbiddenError`).
- `_plain_load` and `_Planner`: DCP's non-tensor entries unpickled as plain values only
  (`torch.load(weights_only=True)`), where DCP's own planner uses `weights_only=False`.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from trainrec import CorruptRecordError

_LEGACY_STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128}
"""The storage classes `torch.save` names for these dtypes (its `persistent_id`); others are
saved as `torch.storage.UntypedStorage` with `_rebuild_tensor_v3` and the dtype."""


@dataclass(frozen=True)
class _Layout:
    """Where a tensor saved by `torch.save` keeps its bytes: storage `key` of `nbytes`
    bytes, and the tensor's dtype, storage offset, shape and strides in it."""

    dtype: torch.dtype
    key: str
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Untyped:
    """`torch.storage.UntypedStorage`, as named in the pickle (nothing is built)."""


@dataclass(frozen=True)
class _Typed:
    """A typed storage class of `_LEGACY_STORAGES`, as named in the pickle: its dtype (a
    dtype named where the pickle names a storage class is refused, as `torch.load` does)."""

    dtype: torch.dtype


class _LayoutUnpickler(pickle._Unpickler):
    """Reads the pickle `torch.save` writes for one plain tensor,
    `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` (or `_v3`,
    which adds the dtype), into a `_Layout`, building nothing; any other global is refused,
    and the entry goes DCP's way. Python's unpickler, whose memo is a dict: C's grows an
    array to twice the index a memo opcode names (a 40-byte pickle asks gigabytes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _layout_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _layout_v3
        if module == "torch" and name in _LEGACY_STORAGES:
            return _Typed(_LEGACY_STORAGES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _Untyped
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise _ForbiddenError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel): checked by `_layout`


def _layout_v2(storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any,
               hooks: Any, metadata: Any = None) -> _Layout:
    """`torch._utils._rebuild_tensor_v2`'s arguments, as a `_Layout`."""
    return _layout(storage, None, offset, shape, stride, hooks, metadata)


def _layout_v3(storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any,
               hooks: Any, dtype: Any, metadata: Any = None) -> _Layout:
    """`torch._utils._rebuild_tensor_v3`'s arguments (a dtype the storage does not name)."""
    return _layout(storage, dtype, offset, shape, stride, hooks, metadata)


def _layout(storage: Any, dtype: Any, offset: Any, shape: Any, stride: Any, hooks: Any,
            metadata: Any) -> _Layout:
    def sizes(v: Any) -> bool:
        return isinstance(v, tuple) and all(type(i) is int and i >= 0 for i in v)

    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"
            and type(storage[2]) is str and type(storage[4]) is int and storage[4] >= 0
            and type(offset) is int and sizes(shape) and sizes(stride)
            and len(shape) == len(stride) and not hooks and not metadata):
        raise _ForbiddenError("not a plain tensor")
    kind = storage[1]
    if kind is _Untyped and isinstance(dtype, torch.dtype):
        nbytes = storage[4]  # an untyped storage counts bytes
    elif isinstance(kind, _Typed) and dtype is None:
        dtype, nbytes = kind.dtype, storage[4] * kind.dtype.itemsize  # a typed one, elements
    else:
        raise _ForbiddenError("not a plain tensor")
    return _Layout(dtype, storage[2], nbytes, offset, shape, stride)


def _plain_load(value: io.BytesIO, name: str) -> Any:
    """A DCP non-tensor entry's value, unpickled by `torch.load(weights_only=True)`."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler raises anything
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptRecordError(f"the DCP entry {name!r} holds something other than plain "
                                 f"values, refused unread ({reason})", key=name) from e


try:  # where DefaultLoadPlanner.load_bytes puts a value (torch 2.2 to 2.13)
    from torch.distributed.checkpoint._traverse import set_element as _set_element
except ImportError:  # pragma: no cover - then the value is pickled again for DCP's own
    _set_element = None  # type: ignore[assignment]


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor entries are the values `_Reader`
    unpickled with `torch.load(weights_only=True)` and checked (DCP's own `load_bytes`
    uses `weights_only=False`, which runs whatever a hostile file holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: dict[str, Any] = {}  # set by `_Reader`: the entries it unpickled and checked

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        # the value `_Reader` checked, not DCP's second read of its bytes (a file changed
        # in between cannot bring another value in)
        obj = self.plain[name] if name in self.plain else _plain_load(value, name)
        if _set_element is not None and self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[name], obj)
            return
        safe = io.BytesIO()
        torch.save(obj, safe)  # DCP unpickles this, made from the checked value
        safe.seek(0)
        super().load_bytes(read_item, safe)


class _ForbiddenError(Exception):
    pass
