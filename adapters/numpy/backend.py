"""`NumpyBackend`: host numpy arrays on the device "cpu"."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainrec import DType

__all__ = ["NumpyBackend", "NumpyAdapter", "ADAPTER"]


class NumpyBackend:
    """The reference `AutodiffBackend`: tensors are numpy arrays, the only device is "cpu"."""

    name = "numpy"

    def device(self, spec: Any) -> str:
        if spec is None or spec == "cpu":
            return "cpu"
        raise ValueError(f"the numpy backend has only the device 'cpu', not {spec!r}")

    def device_of(self, tensor: Any) -> str:
        return "cpu"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def dtype_of(self, tensor: Any) -> DType:
        return DType.from_numpy(tensor.dtype)

    def shape_of(self, tensor: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in tensor.shape)

    def to_host(self, tensor: Any) -> np.ndarray[Any, Any]:
        return np.array(tensor, order="C", copy=True)

    async def to_host_async(self, tensor: Any) -> np.ndarray[Any, Any]:
        return self.to_host(tensor)

    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> np.ndarray[Any, Any]:
        self.device(device)
        return np.array(array, order="C", copy=True)

    def cast(self, tensor: Any, dtype: DType) -> np.ndarray[Any, Any]:
        if tensor.dtype == dtype.numpy:
            return tensor  # type: ignore[no-any-return]
        return tensor.astype(dtype.numpy)  # type: ignore[no-any-return]

    def clone(self, tensor: Any) -> np.ndarray[Any, Any]:
        return np.array(tensor, copy=True)

    def add(self, pending: Any, grad: Any) -> np.ndarray[Any, Any]:
        np.add(pending, grad, out=pending)
        return pending  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NumpyBackend)

    def __hash__(self) -> int:
        return hash(self.name)


class NumpyAdapter:
    """Claims numpy arrays (and the ndarray type) for `NumpyBackend`; the reference
    module, optimizers and schedulers implement the protocols themselves."""

    name = "numpy"

    def adapt(self, obj: Any) -> Any:
        if obj is np.ndarray or isinstance(obj, np.ndarray):
            return NumpyBackend()
        return None


ADAPTER = NumpyAdapter()
