"""Where JAX arrays live: host copies of sharded arrays, abstract targets, placement.

A capture copies a `jax.Array` to the host shard by shard (`host_copy`): each distinct
shard (`replica_id == 0` of `addressable_shards`) is copied from its own device once,
into its region of one host array, so no device ever holds the whole array and no
program runs on the devices. An array this process cannot address whole (it spans
other JAX processes) has no host copy (`host_copy` refuses it, naming `OrbaxRecorder`);
`capture_tensor` records it as a `ShardedTensor`: the distinct shards this process
holds, with the global shape, dtype and sharding. Only `OrbaxRecorder` writes one (each
process its shards), and a restore builds the global array from them (`place_tensor`).

A restore places each value as its target says (`place`): a live `jax.Array` by its
sharding, an abstract target (`jax.ShapeDtypeStruct`, from `jax.eval_shape`) by its
`.sharding`, or on `device` when it has none; a live array that is not committed to a
device (optax's step `count`, made by `jnp.zeros` outside any `device_put`) gets an
uncommitted value, so a jitted step may still combine it with arrays on other devices.
Abstract leaves hold no values: capturing one is a `TypeError`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrec import DType, RecorderError, RecordMismatchError, ShardedTensor, TensorData
from trainrec.adapter_kit import ShardIndex, cast_problem

__all__ = ["DeletedArrayError", "is_abstract", "is_array_like", "host_copy", "start_host_copy", "place",
           "abstract_error", "key_data_like", "key_impl_name", "sharding_of", "capture_tensor",
           "place_tensor", "global_array", "shard_index", "shards_of", "restored_dtype"]


class DeletedArrayError(ValueError):
    """A `jax.Array` whose buffers are gone (donated or deleted): no values to record."""


def is_abstract(leaf: Any) -> bool:
    """Whether `leaf` is an abstract array (`jax.ShapeDtypeStruct`): shape, dtype and
    perhaps a sharding, but no values."""
    return isinstance(leaf, jax.ShapeDtypeStruct)


def is_array_like(leaf: Any) -> bool:
    """A `jax.Array` or an abstract one."""
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))


def abstract_error(name: str) -> TypeError:
    """The error for capturing an abstract leaf."""
    return TypeError(f"leaf {name!r} is abstract (a jax.ShapeDtypeStruct): it holds no values to "
                     "record; restore a record into it first (TrainingRecord.restore or "
                     "trainrec.adapters.jax.restore_tree), which gives concrete arrays")


def sharding_of(leaf: Any) -> Any:
    """The sharding a value for `leaf` goes to: a live array's, an abstract target's
    (None when it gives none)."""
    return getattr(leaf, "sharding", None)


def start_host_copy(x: jax.Array) -> list[Any]:
    """Start the transfer to the host of each distinct shard of `x` (not its replicas);
    returns those shards. Raises `RecorderError` for an array that spans devices of
    other processes."""
    if x.is_deleted():
        raise DeletedArrayError(
            f"a jax.Array of shape {tuple(x.shape)} was deleted (donated to a jitted step through "
            "donate_argnums, or .delete()): capture the arrays the step returned")
    if not x.is_fully_addressable:
        raise RecorderError(
            f"a jax.Array of shape {tuple(x.shape)} spans devices of other JAX processes "
            f"({x.sharding}); this process holds only its own shards: save with "
            "trainrec.adapters.jax.OrbaxRecorder, where each process writes its shards")
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    for s in shards:
        s.data.copy_to_host_async()
    return shards


def host_copy(x: Any) -> np.ndarray[Any, Any]:
    """A new C-contiguous host array of `x`'s values. A `jax.Array` is copied shard by
    shard: each distinct shard once, from its own device, into its region (no gather of
    the whole array onto one device). Raises `RecorderError` for an array that spans
    devices of other processes."""
    if not isinstance(x, jax.Array):
        return np.array(x, order="C", copy=True)
    shards = start_host_copy(x)
    if len(shards) == 1:  # one device, or replicated: that copy is the whole array
        return np.array(shards[0].data, order="C", copy=True)
    out = np.empty(x.shape, dtype=x.dtype)
    covered = 0
    for s in shards:
        data = np.asarray(s.data)
        out[s.index] = data
        covered += data.size
    if covered != out.size:  # the distinct shards tile the array; anything else is a bug
        raise RecorderError(f"the shards of a jax.Array of shape {tuple(x.shape)} cover "
                            f"{covered} of its {out.size} elements ({x.sharding})")
    return out


def shard_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> ShardIndex:
    """A shard's `index` (slices, as JAX gives them) as (start, stop) per axis."""
    out = []
    for s, n in zip(index, shape):
        start, stop, _ = s.indices(n)
        out.append((start, stop))
    return tuple(out)


def shards_of(x: jax.Array) -> dict[ShardIndex, TensorData]:
    """Host copies of the distinct shards of `x` this process holds, by index."""
    for s in x.addressable_shards:
        s.data.copy_to_host_async()
    out: dict[ShardIndex, TensorData] = {}
    for s in x.addressable_shards:
        index = shard_index(s.index, tuple(x.shape))
        if index not in out:
            out[index] = TensorData.from_array(np.asarray(s.data), copy=True)
    return out


def capture_tensor(x: Any) -> TensorData:
    """A record of `x`'s values: a `TensorData` of its host copy (of one replica for an
    array replicated over other processes' devices too), or for a `jax.Array` sharded
    over devices of other processes a `ShardedTensor` of the shards this process holds."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:  # every process holds all of it: a whole tensor
            return TensorData.from_array(np.asarray(x.addressable_shards[0].data), copy=True)
        return ShardedTensor(DType.from_numpy(x.dtype), tuple(int(d) for d in x.shape),
                             shards_of(x), x.sharding)
    return TensorData.from_array(host_copy(x), copy=False)


def restored_dtype(value: TensorData, name: str) -> np.dtype[Any]:
    """The dtype of the array a restore gives for the recorded `value`: the recorded one,
    never the live leaf's (a JAX target is a template: a fresh `tx.init` of bf16 params
    has bf16 moments where the run that saved them held f32), as JAX holds it: without
    `jax_enable_x64` a 64-bit dtype is its 32-bit one, when no value changes; else
    `RecordMismatchError` naming the leaf and the first value that would change."""
    dtype: np.dtype[Any] = value.dtype.numpy
    held = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if held == dtype:
        return dtype
    parts = value.shards.values() if isinstance(value, ShardedTensor) else [value]
    why = "what JAX holds without jax_enable_x64"
    for part in parts:
        problem = cast_problem(name, part, DType.from_numpy(held), why)
        if problem is not None:
            raise RecordMismatchError(f"{problem}; or enable 64-bit JAX first: "
                                      "jax.config.update('jax_enable_x64', True)", key=name)
    return held


def global_array(t: ShardedTensor, dtype: Any = None) -> jax.Array:
    """The global `jax.Array` of `t` laid out by its own sharding, each of this process's
    devices given its shard (converted to `dtype`, None: its own) from `t.shards`."""
    shape = t.shape
    arrays = []
    for device, index in t.layout.addressable_devices_indices_map(shape).items():
        part = t.shards.get(shard_index(index, shape))
        if part is None:
            raise RecorderError(f"the record holds no shard at {shard_index(index, shape)} of a tensor "
                                f"of shape {shape}, which device {device} holds in {t.layout}")
        host = np.asarray(part.array)
        arrays.append(jax.device_put(host if dtype is None else host.astype(dtype), device))
    out: jax.Array = jax.make_array_from_single_device_arrays(shape, t.layout, arrays)
    return out


def place_tensor(t: TensorData, like: Any, device: Any, dtype: Any, name: str = "") -> jax.Array:
    """`t`'s values as a `jax.Array` of `dtype` placed as `place` places them; a
    `ShardedTensor` is built from its shards on its own sharding, then moved to `like`'s
    sharding where that differs (a collective over the processes)."""
    if not isinstance(t, ShardedTensor):
        return place(np.asarray(t.array).astype(dtype), like, device, name)
    whole = next(iter(t.shards.values())) if len(t.shards) == 1 else None
    if whole is not None and whole.shape == t.shape and (
            isinstance(like, jax.Array) and not like.committed):
        return place(np.asarray(whole.array).astype(dtype), like, device, name)  # a replicated value
    out = global_array(t, dtype)
    target = sharding_of(like)
    if target is None and device is None:
        return out
    target = target if target is not None else device
    if isinstance(target, jax.sharding.Sharding) and target.is_equivalent_to(t.layout, len(t.shape)):
        return out
    try:
        moved: jax.Array = jax.device_put(out, target)
    except (ValueError, TypeError) as e:
        raise RecordMismatchError(
            f"the target's sharding cannot hold an array of shape {tuple(t.shape)}: {e}", key=name) from e
    return moved


def place(value: np.ndarray[Any, Any], like: Any, device: Any, name: str = "") -> jax.Array:
    """`value` as a `jax.Array` placed as `like` says (a live array's or an abstract
    target's sharding; uncommitted, as a live array that is not committed to a device),
    else on `device` (a `jax.Device`, None: the default device). A sharding that cannot
    lay out `value` (a mesh axis that does not divide a dimension, a spec of more
    dimensions than the array) is a `RecordMismatchError` naming `name`."""
    if isinstance(like, jax.Array) and not like.committed:
        loose: jax.Array = jax.device_put(value)  # not committed: jit may move it
        return loose
    sharding = sharding_of(like)
    try:
        out: jax.Array = jax.device_put(value, sharding if sharding is not None else device)
    except (ValueError, TypeError) as e:
        raise RecordMismatchError(
            f"the target's sharding cannot hold an array of shape {tuple(value.shape)}: {e}; "
            "give the target (or the abstract leaf's .sharding) a layout that divides the "
            "array's dimensions", key=name) from e
    return out


def key_data_like(leaf: Any) -> Any:
    """The key data of a typed key array, or its shape and dtype for an abstract key."""
    if is_abstract(leaf):
        return jax.eval_shape(jax.random.key_data, leaf)
    return jax.random.key_data(leaf)


def key_impl_name(leaf: Any) -> str:
    """The implementation name of a typed key array or of an abstract one
    (`threefry2x32`), as `jax.random.key_impl` gives it."""
    if is_abstract(leaf):
        one_key = key_data_like(leaf).shape[len(leaf.shape):]  # the data of one key
        leaf = jax.random.wrap_key_data(jnp.zeros(one_key, jnp.uint32), dtype=leaf.dtype)
    return str(jax.random.key_impl(leaf))
