"""`RngRecord`: Python's, numpy's and given generators' RNG states as a record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptRecordError, RecordMismatchError
from ..items.tree import Item, map_tree
from ..precision import PrecisionSettings

# -- RNG state ----------------------------------------------------------------------------

_ARRAY_DTYPES = {"uint32": np.uint32, "uint64": np.uint64, "int64": np.int64}


def _encode_state(value: Any) -> Item:
    """numpy bit-generator state (which holds 128-bit ints and uint arrays) as an item."""
    if isinstance(value, dict):
        return {str(k): _encode_state(v) for k, v in value.items()}
    if isinstance(value, (bool, str, float)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return v if -(2**63) <= v < 2**64 else {"bigint": hex(v)}
    if isinstance(value, np.ndarray) and value.dtype.name in _ARRAY_DTYPES:
        return {"array": value.dtype.name, "shape": list(value.shape),
                "bytes": np.ascontiguousarray(value, value.dtype.newbyteorder("<")).tobytes()}
    raise TypeError(f"cannot record RNG state value of type {type(value).__name__}")


def _decode_state(item: Item, key: str) -> Any:
    """The inverse of `_encode_state`."""

    def decode(path: str, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if set(node) == {"bigint"} and isinstance(node["bigint"], str):
            try:
                return int(node["bigint"], 16)
            except ValueError:
                raise CorruptRecordError("malformed bigint", key=path) from None
        if set(node) == {"array", "shape", "bytes"}:
            name, shape, data = node["array"], node["shape"], node["bytes"]
            if name not in _ARRAY_DTYPES or not isinstance(data, bytes) or not isinstance(shape, list):
                raise CorruptRecordError("malformed RNG state array", key=path)
            dt = np.dtype(_ARRAY_DTYPES[str(name)]).newbyteorder("<")
            if len(data) % dt.itemsize:
                raise CorruptRecordError("malformed RNG state array", key=path)
            arr = np.frombuffer(data, dt).astype(dt.newbyteorder("="))
            try:
                return arr.reshape([int(d) for d in shape if isinstance(d, int)])
            except (ValueError, TypeError):
                raise CorruptRecordError("malformed RNG state array shape", key=path) from None
        return node

    return map_tree(item, decode, key)


@dataclass(frozen=True)
class RngRecord:
    """Python `random`'s state, numpy's legacy global state and the states of any
    `numpy.random.Generator`s given to `capture` (in order)."""

    python: Any
    numpy_global: Any
    generators: tuple[Any, ...] = ()

    RECORD_NAME = "RngRecord"

    @classmethod
    def capture(cls, *generators: np.random.Generator) -> RngRecord:
        """The current states (copies: later draws do not change the record)."""
        for g in generators:
            if not isinstance(g, np.random.Generator):
                raise TypeError(f"expected numpy.random.Generator, got {type(g).__name__} (JAX keys and "
                                "flax nnx Rngs: the JAX adapter's JaxRngRecord; torch generators: the "
                                "torch adapter's TorchRngRecord)")
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return cls(
            python={"version": version, "state": list(internal), "gauss_next": gauss},
            numpy_global=_encode_state(
                {"bit_generator": name, "keys": np.array(keys), "pos": pos,
                 "has_gauss": has_gauss, "cached_gaussian": cached}
            ),
            generators=tuple(_encode_state(g.bit_generator.state) for g in generators),
        )

    def apply(self, *generators: np.random.Generator) -> None:
        """Put the recorded states back into `random`, numpy's global RNG and `generators`
        (as many, in the same order, of the same bit generators, as were captured)."""
        if len(generators) != len(self.generators):
            raise ValueError(
                f"record holds {len(self.generators)} generator states, {len(generators)} given"
            )
        states = [_decode_state(s, f"generators.{i}") for i, s in enumerate(self.generators)]
        for i, (g, s) in enumerate(zip(generators, states)):
            have = type(g.bit_generator).__name__
            if not isinstance(s, dict) or s.get("bit_generator") != have:
                raise RecordMismatchError(
                    f"generator {i} is {have}, the record holds {s.get('bit_generator') if isinstance(s, dict) else s!r}"
                )
        py = self.python
        np_state = _decode_state(self.numpy_global, "numpy_global")
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        np.random.set_state(
            (np_state["bit_generator"], np_state["keys"], np_state["pos"],
             np_state["has_gauss"], np_state["cached_gaussian"])
        )
        for g, s in zip(generators, states):
            g.bit_generator.state = s

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"python": self.python, "numpy_global": self.numpy_global,
                "generators": list(self.generators)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None) -> RngRecord:
        if not isinstance(item, dict) or set(item) != {"python", "numpy_global", "generators"}:
            raise CorruptRecordError("RngRecord must be {python, numpy_global, generators}")
        py = item["python"]
        if (
            not isinstance(py, dict)
            or not isinstance(py.get("state"), list)
            or not all(isinstance(x, int) for x in py["state"])  # type: ignore[union-attr]
            or not isinstance(py.get("version"), int)
        ):
            raise CorruptRecordError("malformed Python random state", key="python")
        gens = item["generators"]
        if not isinstance(gens, list):
            raise CorruptRecordError("generators must be a list", key="generators")
        np_state = _decode_state(item["numpy_global"], "numpy_global")
        if not isinstance(np_state, dict) or not {"bit_generator", "keys", "pos"} <= set(np_state):
            raise CorruptRecordError("malformed numpy global state", key="numpy_global")
        return cls(python=py, numpy_global=item["numpy_global"], generators=tuple(gens))
