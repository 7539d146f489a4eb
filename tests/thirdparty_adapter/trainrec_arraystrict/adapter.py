"""The backend: array-api-strict arrays on its CPU device."""

from __future__ import annotations

from typing import Any

import array_api_strict as xp
import numpy as np

from trainrec import DType

_TO_XP = {DType.F64: xp.float64, DType.F32: xp.float32, DType.I64: xp.int64, DType.I32: xp.int32,
          DType.I16: xp.int16, DType.I8: xp.int8, DType.U8: xp.uint8, DType.U16: xp.uint16,
          DType.U32: xp.uint32, DType.U64: xp.uint64, DType.BOOL: xp.bool}
SUPPORTED = tuple(_TO_XP)  # the array API standard has no f16 or bf16
ArrayType = type(xp.asarray(0))  # array-api-strict does not export its array class


class StrictBackend:
    name = "array_api_strict"

    def device(self, spec: Any) -> Any:
        cpu = xp.Device("CPU_DEVICE")
        if spec in (None, "cpu") or spec == cpu:
            return cpu
        raise ValueError(f"array-api-strict has only its CPU device, not {spec!r}")

    def device_of(self, tensor: Any) -> Any:
        return tensor.device

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, ArrayType)

    def dtype_of(self, tensor: Any) -> DType:
        for d, x in _TO_XP.items():
            if tensor.dtype == x:
                return d
        raise TypeError(f"unsupported dtype {tensor.dtype}")

    def shape_of(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def to_host(self, tensor: Any) -> np.ndarray:
        return np.array(np.asarray(tensor), order="C", copy=True)

    async def to_host_async(self, tensor: Any) -> np.ndarray:
        return self.to_host(tensor)

    def from_host(self, array: np.ndarray, device: Any) -> Any:
        self.device(device)
        d = DType.from_numpy(array.dtype)
        if d not in _TO_XP:
            raise TypeError(f"array-api-strict has no {d.value}")
        return xp.asarray(np.array(array, copy=True), dtype=_TO_XP[d])

    def cast(self, tensor: Any, dtype: DType) -> Any:
        return xp.astype(tensor, _TO_XP[dtype])

    def clone(self, tensor: Any) -> Any:
        return xp.asarray(tensor, copy=True)

    def add(self, pending: Any, grad: Any) -> Any:
        return pending + grad


class ArrayStrictAdapter:
    """Claims array-api-strict arrays, their type and devices."""

    name = "array_api_strict"

    def adapt(self, obj: Any) -> Any:
        if isinstance(obj, (ArrayType, xp.Device)) or obj is ArrayType:
            return StrictBackend()
        return None


ADAPTER = ArrayStrictAdapter()
