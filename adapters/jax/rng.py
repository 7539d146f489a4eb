"""`JaxRngRecord`: JAX PRNG keys (typed and raw) and flax nnx `Rngs`, with Python's and
numpy's RNG states; `key_item` / `key_from_item`, the item of one key array.

A key array is recorded as `{"impl": NAME, "data": uint32 tensor}`: a typed key
(`jax.random.key(0, impl="rbg")`) by its implementation's name (`threefry2x32`, `rbg`,
`unsafe_rbg`) and its `jax.random.key_data`, a raw key (`jax.random.PRNGKey(0)`, a uint32
array) with `impl` None. Unsigned ints are bit patterns that no precision setting
converts, so every recorder gives the same bits back, as uint32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrec import CorruptRecordError, RecordMismatchError, RngRecord, TensorData
from trainrec.adapter_kit import Item, PrecisionSettings

from .paths import flatten
from .placement import host_copy, is_abstract, key_data_like, key_impl_name, place

__all__ = ["JaxRngRecord", "is_typed_key", "key_item", "key_from_item", "key_problems"]


def is_typed_key(value: Any) -> bool:
    """Whether `value` is a typed JAX key array (`jax.random.key`), whose dtype numpy
    cannot hold, or an abstract one (a `jax.ShapeDtypeStruct` of a key dtype)."""
    return (isinstance(value, (jax.Array, jax.ShapeDtypeStruct))
            and bool(jnp.issubdtype(value.dtype, jax.dtypes.prng_key)))


def _is_raw_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and not is_typed_key(value) and value.dtype == jnp.uint32


def key_item(key: Any, where: str = "key") -> Item:
    """The item of a key array: a typed key (single or an array of keys) or a raw uint32
    key. `TypeError` for anything else (an abstract key too), naming `where`."""
    if is_abstract(key):
        raise TypeError(f"{where} is an abstract key (a jax.ShapeDtypeStruct): it holds no key to record")
    if is_typed_key(key):
        impl = str(jax.random.key_impl(key))
        data = host_copy(jax.random.key_data(key))
        try:  # a key implementation registered in this process only would not load back
            jax.random.wrap_key_data(jnp.asarray(data), impl=impl)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: a key of implementation {impl!r} cannot be rebuilt from its name ({e})") from None
        return {"impl": impl, "data": TensorData.from_array(data, copy=False)}
    if _is_raw_key(key) or isinstance(key, np.ndarray) and key.dtype == np.uint32:
        return {"impl": None, "data": TensorData.from_array(host_copy(key), copy=False)}
    what = f"a {key.dtype} array" if hasattr(key, "dtype") else f"a {type(key).__name__}"
    raise TypeError(f"{where} is {what}, not a JAX key: a typed key (jax.random.key) or a raw "
                    "uint32 key (jax.random.PRNGKey)")


def _checked_item(item: Item, where: str) -> tuple[str | None, TensorData]:
    if not isinstance(item, dict) or set(item) != {"impl", "data"}:
        raise CorruptRecordError("a JAX key must be {impl, data}", key=where)
    impl, data = item["impl"], item["data"]
    if impl is not None and not isinstance(impl, str) or not isinstance(data, TensorData):
        raise CorruptRecordError("a JAX key is an impl name (or None) and a uint32 tensor", key=where)
    if data.dtype.numpy != np.uint32:
        raise CorruptRecordError(f"JAX key data must be uint32, the record holds {data.dtype.value}", key=where)
    return impl, data


def _describe(impl: str | None, shape: tuple[int, ...]) -> str:
    return f"a raw uint32 key array of shape {shape}" if impl is None else f"a {impl} key array (key data of shape {shape})"


def _live(key: Any) -> tuple[str | None, tuple[int, ...]]:
    if is_typed_key(key):
        return key_impl_name(key), tuple(key_data_like(key).shape)
    return None, tuple(np.shape(key))


def key_problems(item: Item, live: Any, where: str) -> list[str]:
    """Why `item` does not restore into the live key `live` (another implementation,
    typed where raw, another shape): a list of problems naming `where`; empty when it fits."""
    try:
        impl, data = _checked_item(item, where)
    except CorruptRecordError as e:
        return [str(e)]
    want = _live(live)
    if (impl, data.shape) != want:
        return [f"{where}: {_describe(impl, data.shape)} in the record, {_describe(*want)} live"]
    return []


def key_from_item(item: Item, like: Any = None, where: str = "key") -> jax.Array:
    """The key array `item` records, exactly (same implementation, bits and dtype), placed
    like the live key `like` (its sharding; an abstract key's, when it has one) when
    given, else on JAX's default device."""
    impl, data = _checked_item(item, where)
    if like is not None:
        problems = key_problems(item, like, where)
        if problems:
            raise RecordMismatchError("; ".join(problems), key=where)
    arr = np.array(data.read(), copy=True)
    raw = place(arr, like, None, where)  # a key's sharding places its key data (one more, unsharded axis)
    if impl is None:
        return raw
    try:
        key: jax.Array = jax.random.wrap_key_data(raw, impl=impl)
        return key
    except (TypeError, ValueError) as e:
        raise CorruptRecordError(f"cannot rebuild a {impl} key of data shape {data.shape}: {e}", key=where) from None


def _rngs_type() -> Any:
    """flax nnx's `Rngs`, when the program imported flax nnx (a caller holding an `Rngs`
    did); None otherwise, without importing flax: the `jax` extra alone has none."""
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else nnx.Rngs


def _rngs_leaves(rngs: Any) -> tuple[dict[str, Any], Any, Any]:
    from flax import nnx

    state = nnx.state(rngs)
    leaves, treedef = flatten(state)
    return leaves, treedef, state


def _rngs_item(rngs: Any, where: str) -> Item:
    leaves, _, _ = _rngs_leaves(rngs)
    return {name: key_item(v, f"{where}.{name}") if is_typed_key(v)
            else TensorData.from_array(host_copy(v), copy=False) for name, v in leaves.items()}


def _rngs_new_state(item: Item, rngs: Any, where: str) -> Any:
    """The nnx state to put into `rngs`, or `RecordMismatchError` naming every difference."""
    leaves, treedef, _ = _rngs_leaves(rngs)
    if not isinstance(item, dict):
        raise CorruptRecordError("nnx Rngs must be a map of stream keys and counts", key=where)
    if set(item) != set(leaves):
        raise RecordMismatchError(
            f"nnx Rngs streams differ: {sorted(item)} in the record, {sorted(leaves)} live", key=where)
    problems: list[str] = []
    for name, live in leaves.items():
        value, at = item[name], f"{where}.{name}"
        if is_typed_key(live):
            problems += key_problems(value, live, at)
        elif not isinstance(value, TensorData) or value.dtype.numpy != np.asarray(live).dtype or value.shape != live.shape:
            problems.append(f"{at}: expected a {np.asarray(live).dtype} count of shape {live.shape}")
    if problems:
        raise RecordMismatchError("; ".join(problems), key=where)
    new = [key_from_item(item[n], live, f"{where}.{n}") if is_typed_key(live)
           else place(np.array(item[n].read(), copy=True), live, None, f"{where}.{n}")  # type: ignore[union-attr]
           for n, live in leaves.items()]
    return jax.tree_util.tree_unflatten(treedef, new)


@dataclass(frozen=True)
class JaxRngRecord:
    """`RngRecord` (Python, numpy's global state, numpy `Generator`s) plus JAX key arrays
    and flax nnx `Rngs` (each stream's key and count), given to `capture` in any mix.

    A field of your `@trainrec.record` state (`rng: JaxRngRecord | None = None`):
    `capture(data, key, rngs)` at checkpoint time, `key, = rng.apply(data, key, rngs)` on
    resume. JAX keys are values, so `apply` returns the recorded keys (in order) for you
    to assign; numpy Generators and nnx `Rngs` are set in place."""

    base: RngRecord
    keys: tuple[Item, ...] = ()
    rngs: tuple[Item, ...] = ()

    RECORD_NAME = "JaxRngRecord"

    @classmethod
    def capture(cls, *generators: Any) -> JaxRngRecord:
        """The current states (copies): numpy `Generator`s, JAX key arrays (typed: any
        implementation, single or arrays of keys; raw: uint32) and nnx `Rngs`."""
        np_gens, keys, rngs = _split(generators)
        return cls(RngRecord.capture(*np_gens),
                   tuple(key_item(k, f"keys.{i}") for i, k in enumerate(keys)),
                   tuple(_rngs_item(r, f"rngs.{i}") for i, r in enumerate(rngs)))

    def apply(self, *generators: Any) -> tuple[jax.Array, ...]:
        """Put the recorded states back: the same generators, keys and `Rngs`, in the same
        order, as were captured. Returns the recorded keys, each of its live key's
        implementation, shape and device (the live key values are not read). Checks
        everything first: a refused apply changes nothing."""
        np_gens, keys, rngs = _split(generators)
        for what, have, recorded in (("numpy generators", np_gens, self.base.generators),
                                     ("JAX keys", keys, self.keys), ("nnx Rngs", rngs, self.rngs)):
            if len(have) != len(recorded):
                raise ValueError(f"record holds {len(recorded)} {what}, {len(have)} given")
        new_keys = tuple(key_from_item(item, live, f"keys.{i}") for i, (item, live) in enumerate(zip(self.keys, keys)))
        states = [_rngs_new_state(item, r, f"rngs.{i}") for i, (item, r) in enumerate(zip(self.rngs, rngs))]
        self.base.apply(*np_gens)
        if rngs:  # given an nnx Rngs, flax nnx is imported
            from flax import nnx

            for r, state in zip(rngs, states):
                nnx.update(r, state)
        return new_keys

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"base": self.base.into_item(settings), "keys": list(self.keys), "rngs": list(self.rngs)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None) -> JaxRngRecord:
        if not isinstance(item, dict) or set(item) != {"base", "keys", "rngs"}:
            raise CorruptRecordError("JaxRngRecord must be {base, keys, rngs}")
        keys, rngs = item["keys"], item["rngs"]
        if not isinstance(keys, list) or not isinstance(rngs, list):
            raise CorruptRecordError("JaxRngRecord keys and rngs must be lists")
        for i, k in enumerate(keys):
            _checked_item(k, f"keys.{i}")
        for i, r in enumerate(rngs):
            if not isinstance(r, dict):
                raise CorruptRecordError("nnx Rngs must be a map of stream keys and counts", key=f"rngs.{i}")
        return cls(RngRecord.from_item(item["base"]), tuple(keys), tuple(rngs))


def _split(generators: tuple[Any, ...]) -> tuple[list[Any], list[Any], list[Any]]:
    rngs_type = _rngs_type()
    np_gens, keys, rngs = [], [], []
    for i, g in enumerate(generators):
        if isinstance(g, jax.core.Tracer):
            raise TypeError(f"argument {i} is a traced value ({type(g).__name__}): JaxRngRecord "
                            "runs outside jax.jit; return the key from the jitted step and "
                            "capture or apply it outside")
        if isinstance(g, np.random.Generator):
            np_gens.append(g)
        elif rngs_type is not None and isinstance(g, rngs_type):
            rngs.append(g)
        elif is_typed_key(g) or _is_raw_key(g):
            keys.append(g)
        else:
            what = f"a {g.dtype} array" if isinstance(g, jax.Array) else type(g).__name__
            raise TypeError(f"argument {i} is {what}: JaxRngRecord takes numpy.random.Generator, JAX keys "
                            "(jax.random.key, or uint32 jax.random.PRNGKey) and flax.nnx.Rngs")
    return np_gens, keys, rngs
