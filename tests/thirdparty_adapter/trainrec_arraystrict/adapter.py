"""The backend: trainrec's generic array-API backend, bound to array-api-strict.

Everything a backend does (devices, dtypes, host transfer, the accumulator's arithmetic,
refusing other libraries' arrays) comes from `trainrec.ArrayApiBackend`; this adapter
writes only its model, optimizer and schedule (model.py).
"""

from __future__ import annotations

import array_api_strict as xp

from trainrec import ArrayApiAdapter, ArrayApiBackend


class StrictBackend(ArrayApiBackend):
    """array-api-strict arrays on any of its devices ("cpu" is its CPU_DEVICE); no f16 or
    bf16, which the standard does not have."""

    def __init__(self) -> None:
        super().__init__(xp)


BACKEND = StrictBackend()
SUPPORTED = BACKEND.dtypes("cpu")
ArrayType = type(xp.asarray(0))  # array-api-strict does not export its array class


class ArrayStrictAdapter(ArrayApiAdapter):
    """Claims array-api-strict arrays, their type and devices."""

    def __init__(self) -> None:
        super().__init__(BACKEND)


ADAPTER = ArrayStrictAdapter()
