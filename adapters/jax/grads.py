"""Gradients between pytrees and `GradientsParams`: `grads_from(grad_tree, module)` and
`to_tree(grads, module)`, for any module `trainrec.adapt` binds (a `JaxModule`, an nnx
module, an equinox module), so this sits above the adapter that finds those.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from trainrec import GradientsParams

from .adapter import ADAPTER
from .bindings import JaxModule
from .paths import flatten


def _as_module(module: Any) -> JaxModule:
    """`module`, or the `JaxModule` this adapter binds it to (an `nnx.Module`, an `eqx.Module`)."""
    bound = module if isinstance(module, JaxModule) else ADAPTER.adapt(module)
    if not isinstance(bound, JaxModule):
        raise TypeError(f"module must be a JaxModule, an nnx.Module or an eqx.Module, got {type(module).__name__}")
    return bound


def grads_from(grad_tree: Any, module: Any) -> GradientsParams:
    """Gradients by ParamId from a gradient pytree shaped like the module's trainable
    tree (`jax.grad` of a loss of `variables["params"]`) or like the whole module, in
    any container: dict, flax `FrozenDict`, nnx `State` or `nnx.to_pure_dict`'s dicts.
    `module` may be the `nnx.Module` or `eqx.Module` itself (`nnx.grad`'s `State`,
    `eqx.filter_grad`'s module-shaped tree). Raises `ValueError` when `grad_tree` has
    leaves of which none is for a parameter of `module`.

    A training loop calls this every micro-step, so the ParamIds are worked out once per
    gradient tree structure (a treedef fixes every key path, as `_param_ids` caches the
    module's) and checked against the module then; a later tree of that structure is
    named without walking the module again (`accumulate`, `adopt` and `to_tree` refuse
    gradients none of which is for their module all the same)."""
    module = _as_module(module)
    leaves, treedef = jax.tree_util.tree_flatten(grad_tree)
    prefix = module._trainable_prefix()
    key = (treedef, prefix)
    names = _GRAD_IDS.get(key)
    if names is None:
        names = _grad_names(grad_tree, set(module.param_ids()), prefix)
        if len(_GRAD_IDS) >= 256:
            _GRAD_IDS.clear()
        _GRAD_IDS[key] = names
    return GradientsParams(dict(zip(names, leaves)))


_GRAD_IDS: dict[tuple[Any, str], tuple[str, ...]] = {}


def _grad_names(grad_tree: Any, ids: set[str], prefix: str) -> tuple[str, ...]:
    """The ParamIds of `grad_tree`'s leaves in pytree order: their key paths, under the
    module's trainable `prefix` when that names more of the module's parameters."""
    names = list(flatten(grad_tree)[0])
    if prefix:
        qualified = [f"{prefix}.{k}" for k in names]
        if sum(k in ids for k in qualified) > sum(k in ids for k in names):
            names = qualified
    if names and not ids.intersection(names):
        raise ValueError(
            f"none of the gradient tree's {len(names)} leaves is a parameter of the module: "
            f"leaves {sorted(names)[:3]}, module parameters {sorted(ids)[:3]}"
        )
    return tuple(names)


def to_tree(grads: GradientsParams, module: Any, *, allow_empty: bool = False) -> Any:
    """A pytree shaped like the module's trainable tree, holding `grads` (zeros for
    parameters without a gradient), as optax's `update` expects.

    A tree of zeros would train on nothing: empty `grads` (an accumulator's `grads()` taken
    twice, or before any `accumulate`) raise `ValueError` unless `allow_empty=True`, and
    non-empty `grads` of which none is for a parameter of the module always raise, naming
    a few of each. Gradients of ParamIds the module lacks are otherwise ignored."""
    if not isinstance(grads, GradientsParams):
        raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
    module = _as_module(module)
    if grads.is_empty() and not allow_empty:
        raise ValueError(
            "grads is empty: the tree would be all zeros and the update would train on nothing "
            "(was acc.grads() already taken this window?); pass allow_empty=True for zeros"
        )
    leaves, treedef = flatten(module.trainable())
    prefix = module._trainable_prefix()
    ids = [f"{prefix}.{k}" if prefix else k for k in leaves]
    if not grads.is_empty() and not any(pid in grads for pid in ids):
        raise ValueError(
            f"none of the {len(grads)} gradients is for a parameter of the module: gradients "
            f"for {_some(grads)}, module parameters {_some(ids)}; the tree would be all zeros "
            "(name gradients by the module's ParamIds: grads_from(tree, module) does)"
        )
    out = []
    for pid, v in zip(ids, leaves.values()):
        g = grads.get(pid)
        if g is not None and tuple(getattr(g, "shape", ())) != tuple(v.shape):
            raise ValueError(f"gradient of {pid!r} has shape {tuple(getattr(g, 'shape', ()))}, parameter "
                             f"{tuple(v.shape)} (gradients of another model?)")
        out.append(jnp.zeros_like(v) if g is None else g)
    return jax.tree_util.tree_unflatten(treedef, out)


def _some(ids: Iterable[str], n: int = 3) -> str:
    names = list(ids)
    shown = ", ".join(repr(k) for k in names[:n])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > n else ''}]"
