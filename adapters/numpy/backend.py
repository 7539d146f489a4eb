"""`NumpyBackend`: host numpy arrays on the device "cpu"."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from trainrec import ArrayApiAdapter, ArrayApiBackend, DType

__all__ = ["NumpyBackend", "NumpyAdapter", "ADAPTER"]


class NumpyBackend(ArrayApiBackend):
    """The reference `AutodiffBackend`: trainrec's generic array-API backend bound to
    numpy, with bf16 from `ml_dtypes`. The only device is "cpu" (also "cpu:0")."""

    def __init__(self) -> None:
        super().__init__(np, name="numpy", dtypes={DType.BF16: np.dtype(ml_dtypes.bfloat16)})


class NumpyAdapter(ArrayApiAdapter):
    """Claims numpy arrays (and the ndarray type) for `NumpyBackend`; the reference
    module, optimizers and schedulers implement the protocols themselves."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())


ADAPTER = NumpyAdapter()
