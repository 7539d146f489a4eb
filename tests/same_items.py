"""`same(a, b)`: items equal as a load must give them back (shared by the test modules)."""

from __future__ import annotations

import numpy as np

from trainrec import TensorData


def same(a: object, b: object) -> bool:
    """Equal items: same types, same key order, tensors bitwise and of the same dtype,
    floats by their bits."""
    if isinstance(a, TensorData) or isinstance(b, TensorData):
        return isinstance(a, TensorData) and isinstance(b, TensorData) and a.bitwise_equal(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return a == b
