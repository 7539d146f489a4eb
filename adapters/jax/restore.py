"""`restore_tree`: one component of a record as a pytree shaped, typed and placed as a
target says, the target perhaps abstract (`jax.eval_shape`, Orbax's pattern).

The same checks and placement as `TrainingRecord.restore` into `JaxModule(target)` /
`JaxOptimizer(tx, target)`, for a loop that keeps its state in plain pytrees.
"""

from __future__ import annotations

from typing import Any

from trainrec import GradientsAccumulator, GradientsParamsRecord, RecordMismatchError, StateRecord

from .bindings import JaxModule, JaxOptimizer
from .grads import _as_module, to_tree

__all__ = ["restore_tree"]


def restore_tree(record: Any, target: Any, *, tx: Any = None, module: Any = None, device: Any = None) -> Any:
    """The pytree `record` holds, with `target`'s structure, each array of its recorded
    dtype (the target is a template: a fresh `tx.init` of bf16 params has bf16 moments
    where the run that saved them may have held f32) placed by its target leaf's
    sharding (a `jax.Array`'s, or a `jax.ShapeDtypeStruct`'s; one without a sharding goes
    to `device`, None: JAX's default device).

    Args:
        record: a component of a `TrainingRecord`: `.model` (of a `JaxModule`),
            `.optimizer` (of a `JaxOptimizer`: give `tx`, whose identity the record is
            checked against) or `.grads` (the pending gradients: give `module`, the model
            they are for, perhaps abstract or already restored).
        target: the tree to restore into: the params, or the optimizer state
            (`jax.eval_shape(tx.init, params)`); for the record of an nnx or equinox
            model, that model (perhaps from `nnx.eval_shape` / `eqx.filter_eval_shape`;
            an nnx module is restored in place and returned); for `.grads`, ignored
            (pass None).
        tx: the optax transformation, for `.optimizer`.
        module: for `.grads`, the model (a `JaxModule`, or a native one).
        device: where leaves without a sharding go.

    Returns:
        A new pytree of concrete arrays; for `.grads`, a tree shaped like the module's
        trainable tree (as `to_tree`), zeros where no gradient is pending, or None when
        none is pending (as `accumulate_tree` takes to start a window).

    Raises:
        RecordMismatchError: the record does not fit `target` (names, shapes, dtype kinds,
            optimizer identity), or holds 64-bit values JAX would change without
            `jax_enable_x64`; nothing is changed.
        TypeError: `record` is no component record, or `tx` / `module` is missing.

    Example:
        >>> abstract = jax.eval_shape(init, jax.random.key(0))
        >>> params = trj.restore_tree(rec.model, abstract)
        >>> opt_state = trj.restore_tree(rec.optimizer, jax.eval_shape(tx.init, abstract), tx=tx)
    """
    if isinstance(record, GradientsParamsRecord):
        if module is None:
            raise TypeError("restore_tree(record.grads, ...) needs module=, the model the gradients are for")
        bound = _as_module(module)
        shapes = bound.param_shapes()
        for pid, t in record.grads.items():
            if pid not in shapes:
                raise RecordMismatchError("pending gradient for a parameter the model lacks", key=f"grads.{pid}")
            if tuple(shapes[pid]) != t.shape:
                raise RecordMismatchError(f"pending gradient has shape {t.shape}, parameter has "
                                          f"{tuple(shapes[pid])}", key=f"grads.{pid}")
        if not record.grads:
            return None
        acc: GradientsAccumulator[Any] = GradientsAccumulator(backend=bound.backend)
        acc.load_record(record, device, placements=bound.param_placements())
        return to_tree(acc.grads(), bound)
    if not isinstance(record, StateRecord):
        raise TypeError(f"record must be a component of a TrainingRecord (.model, .optimizer or "
                        f".grads), got {type(record).__name__}")
    if record.kind == JaxOptimizer.kind:
        if tx is None:
            raise TypeError("restore_tree(record.optimizer, ...) needs tx=, the optax transformation "
                            "(the record is checked against its identity)")
        optimizer = JaxOptimizer(tx, target)
        optimizer.load_record(record, None, device)
        return optimizer.opt_state
    if record.kind == JaxModule.kind:
        holder = JaxModule(target)
        holder.load_record(record, device)
        return holder.params
    native = _as_module(target)  # an nnx / equinox module (perhaps abstract): its binding
    native.load_record(record, device)
    return getattr(native, "native", native.params)
