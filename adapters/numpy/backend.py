"""`NumpyBackend`: host numpy arrays on the device "cpu"."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from trainrec import ArrayApiAdapter, ArrayApiBackend, DType

__all__ = ["NumpyBackend", "NumpyAdapter", "ADAPTER"]


class _Bfloat16(Mapping[DType, Any]):
    """`{DType.BF16: ml_dtypes.bfloat16}`, importing ml_dtypes when the value is first read
    (its import costs about a second of CPU, in every process that imports this adapter)."""

    def __getitem__(self, dtype: DType) -> Any:
        if dtype is not DType.BF16:
            raise KeyError(dtype)
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)

    def __iter__(self) -> Iterator[DType]:
        return iter((DType.BF16,))

    def __len__(self) -> int:
        return 1


class NumpyBackend(ArrayApiBackend):
    """The reference `AutodiffBackend`: trainrec's generic array-API backend bound to
    numpy, with bf16 from `ml_dtypes` (imported at the first bf16 array). The only device
    is "cpu" (also "cpu:0")."""

    def __init__(self) -> None:
        super().__init__(np, name="numpy", dtypes=_Bfloat16())


class NumpyAdapter(ArrayApiAdapter):
    """Claims numpy arrays (and the ndarray type) for `NumpyBackend`; the reference
    module, optimizers and schedulers implement the protocols themselves."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())


ADAPTER = NumpyAdapter()
