"""`TorchBackend`: torch tensors on `cpu`, `cuda`, `cuda:N`."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from trainrec import DType

__all__ = ["TorchBackend", "to_torch_dtype", "from_torch_dtype", "tensor_to_numpy", "numpy_to_tensor"]

_TO_TORCH = {
    DType.F64: torch.float64,
    DType.F32: torch.float32,
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.I64: torch.int64,
    DType.I32: torch.int32,
    DType.I16: torch.int16,
    DType.I8: torch.int8,
    DType.U8: torch.uint8,
    DType.BOOL: torch.bool,
}
for _dt, _name in ((DType.U16, "uint16"), (DType.U32, "uint32"), (DType.U64, "uint64")):
    if hasattr(torch, _name):  # torch >= 2.3 has these, with limited operator support
        _TO_TORCH[_dt] = getattr(torch, _name)
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


def to_torch_dtype(dtype: DType) -> torch.dtype:
    return _TO_TORCH[dtype]


def from_torch_dtype(dtype: torch.dtype) -> DType:
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} cannot be recorded by trainrec") from None


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU tensor (bf16 through ml_dtypes); the caller owns `t`."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.BF16.numpy)
    return t.numpy()


def numpy_to_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A new CPU tensor holding a copy of `array`."""
    arr = np.array(array, order="C", copy=True)
    if arr.dtype.name == "bfloat16" and DType.from_numpy(arr.dtype) is DType.BF16:  # ml_dtypes'
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class TorchBackend:
    """`AutodiffBackend` over torch tensors. Host readback of CUDA tensors goes through
    pinned buffers with `non_blocking=True`; `to_host_async` awaits a CUDA event without
    blocking the event loop."""

    name = "torch"

    def device(self, spec: Any) -> torch.device:
        if spec is None:
            return torch.device("cpu")
        try:
            dev = spec if isinstance(spec, torch.device) else torch.device(spec)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{spec!r} is not a torch device: {e}") from None
        if isinstance(spec, str) and ":" in spec and spec.rpartition(":")[2] != str(dev.index):
            # torch keeps a device index in 8 bits: "cuda:4096" parses as cuda:0
            raise ValueError(f"{spec!r}: no such torch device (torch reads it as {str(dev)!r})")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"{spec!r}: no CUDA device is visible to torch (no GPU or driver, a CPU-only "
                    "torch build, or CUDA_VISIBLE_DEVICES hides them); restore to 'cpu'")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise ValueError(f"{spec!r}: only {torch.cuda.device_count()} CUDA devices")
            return torch.device("cuda", index)
        if dev.type != "cpu":
            raise ValueError(f"trainrec's torch adapter supports cpu and cuda, not {dev.type}")
        if dev.index not in (None, 0):  # torch parses "cpu:7", but has one CPU device
            raise ValueError(f"{spec!r}: torch has one CPU device ('cpu')")
        return dev

    def device_of(self, tensor: Any) -> torch.device:
        return tensor.device  # type: ignore[no-any-return]

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def dtype_of(self, tensor: Any) -> DType:
        return from_torch_dtype(tensor.dtype)

    def shape_of(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def _pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buf.copy_(tensor.detach(), non_blocking=True)
        return buf

    def to_host(self, tensor: Any) -> np.ndarray[Any, Any]:
        t = tensor.detach()
        if t.is_cuda:
            buf = self._pinned_copy(t)
            torch.cuda.current_stream(t.device).synchronize()
            return np.array(tensor_to_numpy(buf), copy=True)
        # torch's copy runs on the intra-op threads; numpy's is one memcpy on one core
        return tensor_to_numpy(t.clone(memory_format=torch.contiguous_format))

    async def to_host_async(self, tensor: Any) -> np.ndarray[Any, Any]:
        t = tensor.detach()
        if not t.is_cuda:
            return self.to_host(t)
        buf = self._pinned_copy(t)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves __new__ unannotated
        event.record(torch.cuda.current_stream(t.device))
        while not event.query():  # type: ignore[no-untyped-call]  # unannotated in torch
            await asyncio.sleep(0.0005)
        return np.array(tensor_to_numpy(buf), copy=True)

    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> torch.Tensor:
        t = numpy_to_tensor(array)
        dev = self.device(device)
        return t if dev.type == "cpu" else t.to(dev)

    def cast(self, tensor: Any, dtype: DType) -> torch.Tensor:
        return tensor.to(to_torch_dtype(dtype))  # type: ignore[no-any-return]

    def clone(self, tensor: Any) -> torch.Tensor:
        return tensor.detach().clone()  # type: ignore[no-any-return]

    def add(self, pending: Any, grad: Any) -> torch.Tensor:
        return pending.add_(grad)  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchBackend)

    def __hash__(self) -> int:
        return hash(self.name)
