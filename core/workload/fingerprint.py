"""Fingerprints: small item trees that tell two values apart without keeping them.

`trainrec check` fingerprints the batch each micro-step reports (`Parts.report_batch`) and
the helper objects a workload keeps in `Parts.extras`, so that it can say "the resumed run
consumed other samples" or "`extras['scaler']` was not restored", where the training record
alone shows only that the gradients differ. Sample ids are kept as they are (a report can
show them); any other array is kept as its dtype, shape and SHA-256.

No framework is imported: tensors go to the host through their adapter's backend
(`backend_for`), and objects are read through the methods their frameworks give them
(`state_dict()`, `get_state()`, a numpy `Generator`'s `bit_generator.state`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from ..items.tree import Item
from ..training.registry import backend_for

__all__ = ["MAX_IDS", "fingerprint"]

MAX_IDS = 4096
"""An integer batch of at most this many elements is kept as its values (sample ids)."""

_MAX_DEPTH = 32


def fingerprint(value: Any, *, ids: bool = True) -> Item:
    """An item tree that is equal for equal values and (up to SHA-256) differs otherwise.

    `None`, bools, ints, floats and short strings are kept; a list, tuple or dict is
    fingerprinted element by element; an array or tensor (numpy, torch, JAX: anything an
    adapter's backend reads to the host, or `np.asarray` takes) becomes
    `{"dtype", "shape", "sha256"}`, except an integer one of at most `MAX_IDS` elements
    with `ids=True`, which is kept as a list of its values. A numpy `Generator` is its
    bit generator's state, an object with `state_dict()` (a GradScaler, an EMA, a
    stateful data loader) or `get_state()` (a `torch.Generator`) that state. Anything
    else (a function, a jitted step) is `None`: it holds nothing to compare."""
    return _fp(value, ids, 0)


def _fp(value: Any, ids: bool, depth: int) -> Item:
    if depth > _MAX_DEPTH:
        return {"repr": "<nested too deeply>"}
    if value is None or isinstance(value, (bool, str)):
        return value if not isinstance(value, str) or len(value) <= 256 else _digest(value.encode())
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return _digest(value)
    if isinstance(value, dict):
        return {str(k): _fp(v, ids, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fp(v, ids, depth + 1) for v in value]
    if isinstance(value, np.random.Generator):
        return _fp(value.bit_generator.state, ids, depth + 1)
    array = _host(value)
    if array is not None:
        if ids and array.dtype.kind in "iub" and array.size <= MAX_IDS:
            return [int(x) for x in array.reshape(-1)]
        return {"dtype": str(array.dtype), "shape": list(array.shape),
                **_digest(np.ascontiguousarray(array).tobytes())}
    for method in ("state_dict", "get_state"):
        call = getattr(value, method, None)
        if callable(call) and not isinstance(value, type):
            try:
                return _fp(call(), ids, depth + 1)
            except Exception:  # a helper whose state cannot be read now: nothing to compare
                return None
    return None


def _digest(data: bytes) -> dict[str, Item]:
    return {"sha256": hashlib.sha256(data).hexdigest()}


def _host(value: Any) -> np.ndarray[Any, Any] | None:
    """`value` as a host array, or None when it is not an array."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None
    key_data = _jax_key_data(value)
    if key_data is not None:
        return key_data
    backend = backend_for(value)
    if backend is not None:
        try:
            return backend.to_host(value)
        except (TypeError, ValueError):
            pass
    try:
        return np.asarray(value)
    except Exception:  # not an array after all
        return None


def _jax_key_data(value: Any) -> np.ndarray[Any, Any] | None:
    """The bits of a typed JAX key (which no backend reads as a tensor), else None."""
    import sys

    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(value))
    except (TypeError, AttributeError):
        return None
    return None
