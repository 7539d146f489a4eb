"""`GradientsAccumulator`: sums gradients across micro-steps and checkpoints the sum."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from ..errors import RecorderError, RecordMismatchError
from ..items.dtypes import DType, FloatDType
from ..items.tensor import TensorData
from .gradients import GradientsParams, GradientsParamsRecord
from .protocols import AutodiffBackend, AutodiffModule, ParamId
from .registry import adapt_module, backend_for

__all__ = ["GradientsAccumulator"]

M = TypeVar("M")


class GradientsAccumulator(Generic[M]):
    """Accumulate gradients into a single `GradientsParams`.

    The accumulator owns its pending tensors: it never aliases or writes into the
    tensors it is given. It keeps no count: the caller's state carries it.
    """

    def __init__(self, backend: AutodiffBackend | None = None) -> None:
        """Create a new gradients accumulator (optionally bound to a backend, which
        `load_record` needs when the device is given as a string)."""
        self._pending: dict[ParamId, Any] = {}
        self._backend = backend
        # the last module that was its own protocol object, weakly: the accumulator must not
        # keep a model (and its parameters) alive after the caller dropped it
        self._module: weakref.ref[AutodiffModule] | None = None
        # shapes of pending tensors, as checked against the parameters of `_module`
        self._shapes: dict[ParamId, tuple[int, ...]] = {}

    @classmethod
    def new(cls) -> GradientsAccumulator[M]:
        """Create a new gradients accumulator."""
        return cls()

    @property
    def backend(self) -> AutodiffBackend | None:
        return self._backend

    def accumulate(self, module: M, grads: GradientsParams) -> None:
        """Accumulate the given gradients for each parameter in the given module.

        Gradients of ParamIds the module does not have are ignored, but non-empty
        `grads` of which none is the module's raise `ValueError` (naming some of each): a
        tree named another way would otherwise be dropped whole. An incoming gradient is
        cast to the pending dtype."""
        self._accumulate(module, grads, None)

    def accumulate_with_dtype(self, module: M, grads: GradientsParams, dtype: FloatDType | Any) -> None:
        """Accumulate after converting incoming and pending gradients to `dtype`.

        FP32 accumulation can retain small additions to half-precision gradients.
        Parameter storage, loss normalization and accumulation counts are unchanged.
        Checkpoints preserve the pending gradient dtype; select the same dtype on
        subsequent calls after restoring. No accumulator reset is performed.
        `dtype` is a `FloatDType` or what `FloatDType.of` takes (`jnp.float32`,
        `np.float32`, `torch.float32`, `"float32"`); anything else is a `TypeError`."""
        self._accumulate(module, grads, FloatDType.of(dtype).dtype)

    def _accumulate(self, module: M, grads: GradientsParams, dtype: DType | None) -> None:
        if not isinstance(grads, GradientsParams):
            raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
        bound, same = self._adapt(module)
        if same and grads.keys() <= self._shapes.keys():
            # the same module object as the last call, every gradient for a pending tensor
            # whose shape was checked against its parameter: no need to walk the module
            shapes: Mapping[ParamId, Any] = self._shapes
        else:
            if not same:
                self._shapes = {}  # checked against another module
            shapes = bound.param_shapes()
        backend = self._check_backend(bound.backend)
        # every check before any pending value changes: a rejected call changes nothing
        ids: list[ParamId] = []
        pending: list[Any] = []
        incoming: list[Any] = []
        got_shapes: list[tuple[int, ...]] = []
        held_by_id, held_shapes, shape_of = self._pending, self._shapes, backend.shape_of
        problem_of = getattr(backend, "gradient_problem", None)
        for pid, grad in grads.items():
            shape = shapes.get(pid)
            if shape is None:
                continue
            if problem_of is not None:
                problem = problem_of(grad)
                if problem is not None:
                    raise TypeError(f"gradient of {pid!r} {problem}; nothing was accumulated")
            held = held_by_id.get(pid)
            got = shape_of(grad)
            if (got != shape and got != tuple(shape)) or (
                held is not None and held_shapes.get(pid) != got and shape_of(held) != got
            ):
                param = bound.param_shapes().get(pid)  # the module's own, for the message
                raise ValueError(
                    f"gradient of {pid!r} has shape {got}, parameter "
                    f"{None if param is None else tuple(param)}"
                    + ("" if held is None else f", pending {shape_of(held)}")
                    + "; nothing was accumulated"
                )
            ids.append(pid)
            pending.append(held)
            incoming.append(grad)
            got_shapes.append(got)
        if len(grads) and not ids:
            raise ValueError(
                f"none of the {len(grads)} gradients is for a parameter of the module: gradients "
                f"for {_some(grads)}, module parameters {_some(shapes)}; name "
                "gradients by the module's ParamIds (the adapter's grads_from does)"
            )
        add_many = getattr(backend, "add_many", None)
        if add_many is not None:  # one dispatch for the whole call (JAX: one jitted function)
            summed = add_many(pending, incoming, dtype)
        else:
            summed = [_add(backend, p, g, dtype) for p, g in zip(pending, incoming)]
        self._backend = backend
        self._pending.update(zip(ids, summed))
        held_shapes.update(zip(ids, got_shapes))

    def _adapt(self, module: M) -> tuple[AutodiffModule, bool]:
        """`adapt_module`, and whether `module` is the protocol object of the last call:
        the protocol checks are then skipped (they cost more than a jitted accumulation
        of a small tree)."""
        last = None if self._module is None else self._module()
        if last is not None and id(last) == id(module):  # alive: `last` holds it during the call
            return last, True
        bound = adapt_module(module)
        self._module = None
        if bound is module:
            try:
                self._module = weakref.ref(bound)
            except TypeError:  # an object that takes no weak references: checked every call
                pass
        return bound, False

    def adopt(self, module: M, grads: GradientsParams) -> None:
        """Make `grads` the pending gradients, as they are (dtype kept), replacing any.

        For a loop that sums gradients itself (inside a jitted step, e.g. with
        `trainrec.adapters.jax.accumulate_tree`): adopt its running sum before capture so
        the checkpoint holds the window's pending gradients. Every gradient must be a float
        tensor of the module's backend named by one of its ParamIds, shaped like that
        parameter; otherwise `ValueError` / `TypeError` and the accumulator is unchanged.
        The accumulator keeps its own copy where the framework's tensors are mutable."""
        if not isinstance(grads, GradientsParams):
            raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
        bound, same = self._adapt(module)
        if not same:
            self._shapes = {}  # checked against another module
        shapes = bound.param_shapes()
        backend = self._check_backend(bound.backend)
        unknown = [pid for pid in grads if pid not in shapes]
        if unknown:
            raise ValueError(
                f"cannot adopt gradients for {_some(unknown)}: not parameters of the module "
                f"(module parameters {_some(shapes)})"
            )
        problem_of = getattr(backend, "gradient_problem", None)
        for pid, grad in grads.items():
            if not backend.is_tensor(grad):
                raise TypeError(f"gradient of {pid!r} is a {type(grad).__name__}, not a "
                                f"{backend.name} tensor")
            got = backend.shape_of(grad)
            if got != tuple(shapes[pid]):
                raise ValueError(f"gradient of {pid!r} has shape {got}, parameter "
                                 f"{tuple(shapes[pid])}; nothing was adopted")
            if not backend.dtype_of(grad).is_float:
                raise ValueError(f"gradient of {pid!r} has non-float dtype "
                                 f"{backend.dtype_of(grad).value}; nothing was adopted")
            problem = None if problem_of is None else problem_of(grad)
            if problem is not None:  # e.g. a traced value (a call inside jax.jit)
                raise TypeError(f"gradient of {pid!r} {problem}; nothing was adopted")
        self._pending = {pid: backend.clone(grad) for pid, grad in grads.items()}
        self._shapes = {pid: backend.shape_of(grad) for pid, grad in grads.items()}
        self._backend = backend

    def _check_backend(self, backend: AutodiffBackend) -> AutodiffBackend:
        """The accumulator's backend (else `backend`, which it adopts only once a call
        succeeds); `TypeError` for a module of another framework."""
        if self._backend is None:
            return backend
        if self._backend.name != backend.name:
            raise TypeError(
                f"accumulator holds {self._backend.name} gradients; got a {backend.name} module"
            )
        return self._backend

    def try_to_record(self) -> GradientsParamsRecord:
        """Snapshot pending gradients without resetting the accumulation window."""
        if not self._pending:
            return GradientsParamsRecord({})
        backend = self._require_backend()
        try:
            return GradientsParamsRecord(
                {pid: _host(_to_tensor(backend, t)) for pid, t in self._pending.items()}
            )
        except RecorderError:
            raise
        except Exception as e:
            raise RecorderError(f"cannot read pending gradients back: {e}") from e

    async def to_record_async(self) -> GradientsParamsRecord:
        """Asynchronously snapshot pending gradients without resetting the accumulator."""
        if not self._pending:
            return GradientsParamsRecord({})
        backend = self._require_backend()
        items = list(self._pending.items())
        try:
            arrays = await asyncio.gather(*(backend.to_host_async(t) for _, t in items))
        except Exception as e:
            raise RecorderError(f"cannot read pending gradients back: {e}") from e
        return GradientsParamsRecord({pid: _host(a) for (pid, _), a in zip(items, arrays)})

    def load_record(
        self, record: GradientsParamsRecord, device: Any, *,
        placements: Mapping[ParamId, Any] | None = None,
    ) -> None:
        """Replace pending gradients with checkpoint state on the given device.

        The model IDs and the caller's accumulation count must be restored from the
        same checkpoint. A rejected record leaves the accumulator unchanged.
        `placements` (beyond the seed) gives a ParamId's gradient its own placement,
        anything the backend's `device` accepts (a JAX sharding: its parameter's, as
        `TrainingRecord.restore` passes from the module's `param_placements()`); the
        others go to `device`."""
        if not isinstance(record, GradientsParamsRecord):
            raise RecordMismatchError(
                f"expected a GradientsParamsRecord, got {type(record).__name__}"
            )
        backend = self._backend or _backend_of_device(device)
        staged: dict[ParamId, Any] = {}
        try:
            dev = backend.device(device)
        except (TypeError, ValueError) as e:
            raise RecordMismatchError(f"cannot restore onto device {device!r} ({backend.name}): {e}") from e
        for pid, t in record.grads.items():
            if not isinstance(pid, str):
                raise RecordMismatchError(f"ParamId must be str, got {type(pid).__name__}")
            if not isinstance(t, TensorData):
                raise RecordMismatchError("pending gradient is not a tensor", key=pid)
            if not t.dtype.is_float:
                raise RecordMismatchError(
                    f"pending gradient has non-float dtype {t.dtype.value}", key=pid
                )
            try:
                where = dev if placements is None or pid not in placements else placements[pid]
                from_tensor = getattr(backend, "from_tensor", None)  # JAX: places shards
                staged[pid] = (from_tensor(t, where) if callable(from_tensor)
                               else backend.from_host(t.array, where))
            except RecorderError:
                raise
            except Exception as e:
                raise RecorderError(f"cannot place gradient on {where!r}: {e}", key=pid) from e
        self._pending = staged
        self._shapes = {}
        self._backend = backend

    def grads(self) -> GradientsParams:
        """Return the accumulated gradients and reset the accumulator state."""
        out = GradientsParams(self._pending)
        self._pending = {}
        self._shapes = {}
        return out

    def pending_ids(self) -> list[ParamId]:
        """The ParamIds that have pending gradients (does not read tensors)."""
        return list(self._pending)

    def _require_backend(self) -> AutodiffBackend:
        assert self._backend is not None, "pending gradients without a backend"
        return self._backend

    def __repr__(self) -> str:
        return f"GradientsAccumulator({len(self._pending)} pending)"


def _some(ids: Any, n: int = 3) -> str:
    names = list(ids)
    shown = ", ".join(repr(k) for k in names[:n])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > n else ''}]"


def _add(backend: AutodiffBackend, pending: Any, grad: Any, dtype: DType | None) -> Any:
    """`pending + grad` in `dtype` (else pending's dtype); a new copy of `grad` (cast to
    `dtype`, else its own) when nothing is pending. What `add_many` does per pair."""
    if pending is None:
        fresh = backend.cast(grad, dtype or backend.dtype_of(grad))
        return backend.clone(grad) if fresh is grad else fresh
    target = dtype or backend.dtype_of(pending)
    if backend.dtype_of(pending) is not target:
        pending = backend.cast(pending, target)
    incoming = grad if backend.dtype_of(grad) is target else backend.cast(grad, target)
    return backend.add(pending, incoming)


def _to_tensor(backend: AutodiffBackend, tensor: Any) -> Any:
    """The backend's record of `tensor` (`to_tensor` where it has one: JAX, whose array
    may span other processes), else its host copy."""
    to_tensor = getattr(backend, "to_tensor", None)
    return to_tensor(tensor) if callable(to_tensor) else backend.to_host(tensor)


def _host(array: Any) -> TensorData:
    """A backend's host copy as a tensor (a `ShardedTensor` it gave for a gradient that
    spans other processes as it is)."""
    if isinstance(array, TensorData):
        return array
    return TensorData.from_array(array, copy=False)


def _backend_of_device(device: Any) -> AutodiffBackend:
    backend = backend_for(device)
    if backend is None or not isinstance(backend, AutodiffBackend):
        raise TypeError(
            f"cannot tell which framework device {device!r} belongs to: pass a native device "
            "object or create the accumulator with GradientsAccumulator(backend=...)"
        )
    return backend
