"""`JaxBackend`, the `AutodiffBackend` over JAX arrays, and the gradient sums it and
`accumulate_tree` (the pure, jit-able form of `GradientsAccumulator.accumulate`) compute.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrec import DType, FloatDType, TensorData

from .paths import key_path
from .placement import capture_tensor, host_copy, place_tensor, start_host_copy
from .rng import is_typed_key


class JaxBackend:
    """`AutodiffBackend` over JAX arrays. Devices: `jax.Device` or strings `"cpu"`,
    `"cpu:N"`, `"gpu"`, `"gpu:N"` (also `"cuda:N"`). Arrays are immutable: `add` returns a
    new array and `clone` may return its argument."""

    name = "jax"

    def device(self, spec: Any) -> Any:
        """A `jax.Device`; a `jax.sharding.Sharding` passes through as it is (where a
        parameter's pending gradient goes: its parameter's sharding)."""
        if spec is None:
            return jax.devices()[0]
        if isinstance(spec, (jax.Device, jax.sharding.Sharding)):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"{spec!r} is not a JAX device")
        kind, _, index = spec.partition(":")
        kind = {"cuda": "gpu"}.get(kind, kind)
        try:
            devices = jax.devices(kind)
        except RuntimeError:
            what = "no CUDA device is visible to JAX" if kind == "gpu" else f"JAX has no {kind} devices"
            raise ValueError(f"{spec!r}: {what}; restore to 'cpu'") from None
        i = int(index) if index.isdigit() else 0 if not index else -1
        if not 0 <= i < len(devices):
            raise ValueError(f"{spec!r}: JAX has {len(devices)} {kind} devices")
        return devices[i]

    def device_of(self, tensor: Any) -> jax.Device:
        return next(iter(tensor.devices()))

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, jax.Array)

    def dtype_of(self, tensor: Any) -> DType:
        return DType.from_numpy(tensor.dtype)

    def shape_of(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def to_host(self, tensor: Any) -> np.ndarray[Any, Any]:
        if is_typed_key(tensor):
            raise TypeError(f"a typed JAX key ({tensor.dtype}) is not a tensor: record it with "
                            "trainrec.adapters.jax.JaxRngRecord.capture(key) (a state field "
                            "`rng: JaxRngRecord | None`)")
        return host_copy(tensor)  # a sharded array shard by shard, never gathered

    def to_tensor(self, tensor: Any) -> TensorData:
        """A record of `tensor`: a `ShardedTensor` (this process's shards) for an array
        that spans other processes, else its host copy."""
        if is_typed_key(tensor):
            self.to_host(tensor)  # raises, naming JaxRngRecord
        return capture_tensor(tensor)

    def from_tensor(self, tensor: TensorData, device: Any) -> jax.Array:
        """A new array of `tensor` laid out by `device` (a device or a sharding); a
        `ShardedTensor` built from its shards."""
        return place_tensor(tensor, None, self.device(device), tensor.dtype.numpy)

    async def to_host_async(self, tensor: Any) -> np.ndarray[Any, Any]:
        if isinstance(tensor, jax.Array) and not tensor.is_fully_addressable:
            return self.to_tensor(tensor)  # type: ignore[return-value]  # the accumulator keeps it
        if isinstance(tensor, jax.Array) and not is_typed_key(tensor):
            start_host_copy(tensor)  # each distinct shard, not the replicas
            while not tensor.is_ready():  # type: ignore[attr-defined]  # missing from jax.Array's stub
                await asyncio.sleep(0.0005)
        return self.to_host(tensor)

    def from_host(self, array: np.ndarray[Any, Any], device: Any) -> jax.Array:
        """A new array of `array` on `device` (a device, or a sharding to lay it out by)."""
        out: jax.Array = jax.device_put(np.array(array, copy=True), self.device(device))
        return out

    def cast(self, tensor: Any, dtype: DType) -> jax.Array:
        if tensor.dtype == dtype.numpy:
            return tensor  # type: ignore[no-any-return]
        return tensor.astype(dtype.numpy)  # type: ignore[no-any-return]

    def clone(self, tensor: Any) -> jax.Array:
        return tensor  # type: ignore[no-any-return]  # immutable: sharing is safe

    def gradient_problem(self, grad: Any) -> str | None:
        """What makes `grad` no gradient the accumulator can hold (None: it can): not an
        array, a tracer (a call inside `jax.jit`/`jax.grad`), or not a recordable float
        dtype. Called for every gradient of every `accumulate`: the usual case is two
        lookups."""
        kind = type(grad)
        if kind not in _ARRAY_TYPES:
            if isinstance(grad, jax.core.Tracer):
                return (f"is a traced value ({kind.__name__}): accumulate and adopt run outside "
                        "jax.jit; inside a jitted step sum with trainrec.adapters.jax."
                        "accumulate_tree and adopt the sum outside it")
            if not isinstance(grad, (jax.Array, np.ndarray)):
                return f"is a {kind.__name__}, not a JAX array"
            _ARRAY_TYPES.add(kind)
        if kind is not np.ndarray and isinstance(grad, jax.Array) and grad.is_deleted():
            return ("was deleted (donated to a jitted step through donate_argnums, or .delete()): "
                    "accumulate the gradients the step returned")
        if grad.dtype not in _GRAD_DTYPES:
            return (f"has dtype {grad.dtype}, not a float dtype a record holds "
                    "(float64, float32, float16, bfloat16)")
        return None

    def add(self, pending: Any, grad: Any) -> jax.Array:
        return pending + grad  # type: ignore[no-any-return]

    def add_many(self, pending: list[Any], grads: list[Any], dtype: DType | None) -> list[Any]:
        """`add` for many pairs in one dispatch: one jitted function of the two lists,
        compiled once per tree structure, shapes and dtypes (`pending[i]` None: the
        gradient cast to `dtype`); leaves of 2**18 elements or more get a dispatch each.
        Bitwise what the pair-by-pair casts and adds give.
        No buffer is donated: a pending array may be the caller's own gradient (the first
        `accumulate` keeps it, JAX arrays being immutable) or an adopted tree."""
        name = None if dtype is None else dtype.numpy.name
        big = [i for i, g in enumerate(grads) if g.size >= _OWN_DISPATCH]
        if not big:
            return _add_many(pending, grads, name)  # type: ignore[no-any-return]
        # a large leaf gets its own dispatch: on CPU one program runs its adds one after
        # another, while separate dispatches run on the device's threads side by side
        small = [i for i, g in enumerate(grads) if g.size < _OWN_DISPATCH]
        out: list[Any] = [None] * len(grads)
        for i, v in zip(small, _add_many([pending[i] for i in small], [grads[i] for i in small], name)):
            out[i] = v
        for i in big:
            out[i] = _add_many([pending[i]], [grads[i]], name)[0]
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JaxBackend)

    def __hash__(self) -> int:
        return hash(self.name)


_BACKEND = JaxBackend()
_ARRAY_TYPES: set[type] = set()  # concrete array types seen (tracers never enter)
_GRAD_DTYPES = frozenset(np.dtype(d) for d in ("float64", "float32", "float16", jnp.bfloat16))
TRACES = [0]  # how many times `_add_many` was traced (compiled): tests count them
_OWN_DISPATCH = 1 << 18  # elements from which a leaf is added in a dispatch of its own


def _sum(pending: Any, grad: Any, dtype: str | None) -> Any:
    if pending is None:
        return grad.astype(dtype or grad.dtype)
    target = dtype or pending.dtype
    return pending.astype(target) + grad.astype(target)


@functools.partial(jax.jit, static_argnums=2)
def _add_many(pending: list[Any], grads: list[Any], dtype: str | None) -> list[Any]:
    TRACES[0] += 1
    return [_sum(p, g, dtype) for p, g in zip(pending, grads)]


def accumulate_tree(pending: Any, grads: Any, dtype: Any = None) -> Any:
    """The pure, jit-able form of `GradientsAccumulator.accumulate` for a loop that sums
    gradients inside its own jitted step: `pending + grads` leaf by leaf, each gradient
    cast to its pending leaf's dtype, or both cast to `dtype` when given (as
    `accumulate_with_dtype`); `pending=None` starts a window (the gradients, cast to
    `dtype` when given). Bitwise what the accumulator computes. Before a checkpoint hand
    the sum to the accumulator: `acc.adopt(module, grads_from(pending, module))`."""
    name = None if dtype is None else _float_dtype_name(dtype)
    if pending is None:
        return jax.tree_util.tree_map_with_path(lambda k, g: _sum(None, _checked(k, g), name), grads)
    return jax.tree_util.tree_map_with_path(lambda k, p, g: _sum(_checked(k, p, g), _checked(k, g), name),
                                            pending, grads)


def _float_dtype_name(dtype: Any) -> str:
    """The numpy name of `dtype` (what `FloatDType.of` takes), which must be a float dtype
    a record holds; else `TypeError` saying where `FloatDType` lives."""
    return str(FloatDType.of(dtype).dtype.numpy.name)


def _checked(path: Any, leaf: Any, grad: Any = None) -> Any:
    """`leaf` (a gradient, or the pending sum beside `grad`) when it is a float array of
    the same shape as `grad`: shapes are static, so under `jit` this costs nothing."""
    where = key_path(path)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(f"gradient {where!r} is a {type(leaf).__name__}, not an array")
    if np.dtype(leaf.dtype) not in _GRAD_DTYPES:
        raise TypeError(f"gradient {where!r} has dtype {leaf.dtype}, not a float dtype a record holds "
                        "(float64, float32, float16, bfloat16)")
    if grad is not None and tuple(leaf.shape) != tuple(getattr(grad, "shape", ())):
        raise ValueError(f"gradient {where!r} has shape {tuple(getattr(grad, 'shape', ()))}, pending "
                         f"{tuple(leaf.shape)}: the sum would broadcast (the gradient is of another model)")
    return leaf
