"""`TensorData`: a framework-free host tensor (dtype, shape, little-endian C-order bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from .dtypes import DType

__all__ = ["TensorData", "ShardedTensor", "ShardIndex"]

_Loader = Callable[[], "np.ndarray[Any, Any]"]


class TensorData:
    """An immutable host tensor.

    The values live in a read-only, C-contiguous, little-endian numpy array (`array`).
    A `TensorData` loaded lazily (`mmap=True`) reads and verifies its bytes the first
    time `array` is touched; `dtype`, `shape` and `nbytes` never touch the bytes.
    """

    __slots__ = ("_array", "_dtype", "_loader", "_private", "_shape")

    def __init__(
        self, dtype: DType, shape: tuple[int, ...], loader: _Loader, *, private: bool = False
    ) -> None:
        """`private`: the loader's array is memory no one else holds (a region of a read
        buffer a load allocated for itself), so `take` may hand it out without copying."""
        self._dtype = dtype
        self._shape = shape
        self._loader: _Loader | None = loader
        self._array: np.ndarray[Any, Any] | None = None
        self._private = private

    @classmethod
    def from_array(cls, array: Any, *, copy: bool = True) -> TensorData:
        """Record a numpy (or array-API) array. With `copy=True` later writes to `array`
        do not change the record; `copy=False` only views an array the caller will not
        touch again."""
        arr = np.asarray(array)
        dtype = DType.from_numpy(arr.dtype)
        target = dtype.numpy
        if copy or arr.dtype != target or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=target, order="C", copy=True)
        else:
            arr = arr.view()  # flag a view read-only, never the caller's array
        arr.flags.writeable = False
        return cls._ready(dtype, tuple(int(d) for d in arr.shape), arr)

    @classmethod
    def from_bytes(cls, dtype: DType, shape: tuple[int, ...], data: bytes) -> TensorData:
        """A tensor from its little-endian C-order bytes; raises `ValueError` on a size mismatch."""
        count = _count(shape)
        if len(data) != count * dtype.itemsize:
            raise ValueError(
                f"{len(data)} bytes do not hold a {dtype.value} tensor of shape {shape}"
            )
        arr = np.frombuffer(data, dtype=dtype.numpy, count=count).reshape(shape)
        return cls._ready(dtype, shape, arr)

    @classmethod
    def _ready(cls, dtype: DType, shape: tuple[int, ...], arr: np.ndarray[Any, Any]) -> TensorData:
        td = cls.__new__(cls)
        td._dtype, td._shape, td._loader, td._array = dtype, shape, None, arr
        td._private = False
        return td

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def numel(self) -> int:
        return _count(self._shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self._dtype.itemsize

    @property
    def is_loaded(self) -> bool:
        """False while a lazily loaded tensor has not read (and verified) its bytes yet."""
        return self._array is not None

    @property
    def array(self) -> np.ndarray[Any, Any]:
        """The values as a read-only numpy array (reads and verifies lazy data on first use;
        may raise `ChecksumError`)."""
        if self._array is None:
            assert self._loader is not None
            arr = self._loader()
            arr.flags.writeable = False
            self._array, self._loader = arr, None
        return self._array

    def read(self) -> np.ndarray[Any, Any]:
        """The values, like `array`, but a lazy tensor that has not been read keeps not
        holding them afterwards: streaming writers read each tensor once, then drop it."""
        if self._array is not None:
            return self._array
        assert self._loader is not None
        arr = self._loader()
        arr.flags.writeable = False
        return arr

    def take(self) -> np.ndarray[Any, Any]:
        """The values as a writable array that aliases nothing else: a copy, except while
        `handing_out()` is active (a `Recorder.load` rebuilding the item it has just read
        and will drop), where a tensor read into the load's own buffer hands out its
        loaded array itself, once, without copying (may raise `ChecksumError`)."""
        arr = self.array
        if self._private and _HANDING_OUT.get():
            self._private = False  # a second take (the same tensor twice in a tree) copies
            out = arr.view()
            out.flags.writeable = True  # the buffer under it is writable and this load's own
            return out
        return np.array(arr, order="C")

    def to_bytes(self) -> bytes:
        """The little-endian C-order bytes."""
        return self.array.tobytes()

    def cast(self, dtype: DType) -> TensorData:
        """This tensor converted to `dtype` (itself when it already has that dtype)."""
        if dtype is self._dtype:
            return self
        with np.errstate(all="ignore"):  # unchecked; recorders store with store_tensor
            converted = self.read().astype(dtype.numpy)
        return TensorData.from_array(converted, copy=False)

    def bitwise_equal(self, other: TensorData) -> bool:
        """Same dtype, same shape, same bytes (NaN payloads and signed zeros included)."""
        return (
            self._dtype is other._dtype
            and self._shape == other._shape
            and self.array.tobytes() == other.array.tobytes()
        )

    def __repr__(self) -> str:
        return f"TensorData({self._dtype.value}, shape={self._shape})"


_HANDING_OUT: ContextVar[bool] = ContextVar("trainrec_handing_out", default=False)


@contextmanager
def handing_out() -> Iterator[None]:
    """While active, `TensorData.take` hands out privately loaded arrays without copying:
    only for code that rebuilds an item no one else will read again."""
    token = _HANDING_OUT.set(True)
    try:
        yield
    finally:
        _HANDING_OUT.reset(token)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


ShardIndex = tuple[tuple[int, int], ...]
"""Where a shard sits in its global array: (start, stop) per axis."""


class ShardedTensor(TensorData):
    """A tensor this process holds only in part: its global dtype and shape, the distinct
    shards its devices hold (`shards`: index -> host values) and the framework's layout
    (`layout`, opaque here: a `jax.sharding.Sharding`).

    Captured from a JAX array that spans devices of other processes. Only a recorder that
    writes each process's shards (`trainrec.adapters.jax.OrbaxRecorder`) can save it, and
    only a restore that places shards (the JAX adapter) can use it: everything that needs
    the whole values (`array`, `read`, `take`, `to_bytes`, `cast`: every other recorder,
    checksum, comparison or conversion) raises `RecorderError` saying so."""

    __slots__ = ("layout", "shards")

    def __init__(self, dtype: DType, shape: tuple[int, ...], shards: dict[ShardIndex, TensorData],
                 layout: Any) -> None:
        super().__init__(dtype, shape, self._refuse)
        for index, part in shards.items():
            want = tuple(b - a for a, b in index)
            if len(index) != len(shape) or part.shape != want or part.dtype is not dtype:
                raise ValueError(f"a shard at {index} of {part.dtype.value} {part.shape} does not "
                                 f"fit a {dtype.value} tensor of shape {shape}")
        self.shards = dict(shards)
        self.layout = layout

    def _refuse(self) -> np.ndarray[Any, Any]:
        from ..errors import RecorderError

        raise RecorderError(
            f"a {self._dtype.value} tensor of shape {self._shape} sharded across processes (this "
            f"process holds {len(self.shards)} of its shards, not its whole values) can be saved "
            "only by OrbaxRecorder (of trainrec's JAX adapter), where each process writes its "
            "own shards, and restored only into JAX arrays; nothing else can use it")

    @property
    def array(self) -> np.ndarray[Any, Any]:
        return self._refuse()

    def read(self) -> np.ndarray[Any, Any]:
        return self._refuse()

    def take(self) -> np.ndarray[Any, Any]:
        return self._refuse()

    def to_bytes(self) -> bytes:
        self._refuse()
        return b""  # pragma: no cover - _refuse raises

    def cast(self, dtype: DType) -> TensorData:
        if dtype is self._dtype:
            return self
        return ShardedTensor(dtype, self._shape, {i: t.cast(dtype) for i, t in self.shards.items()},
                             self.layout)

    def bitwise_equal(self, other: TensorData) -> bool:
        """Same dtype, global shape, shard indices and shard bytes."""
        return (isinstance(other, ShardedTensor) and self._dtype is other._dtype
                and self._shape == other._shape and self.shards.keys() == other.shards.keys()
                and all(t.bitwise_equal(other.shards[i]) for i, t in self.shards.items()))

    def __repr__(self) -> str:
        return f"ShardedTensor({self._dtype.value}, shape={self._shape}, {len(self.shards)} shards here)"
