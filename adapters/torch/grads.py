"""Moving gradients between `.grad` and `GradientsParams`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trainrec import GradientsParams

from .wrappers import named_parameters, refuse_dtensors

__all__ = ["grads_from", "set_grads"]


def grads_from(model: nn.Module) -> GradientsParams:
    """Take each parameter's `.grad` into a `GradientsParams` (by ParamId: the names of the
    model inside any `torch.compile` / DDP / DataParallel wrappers) and set `.grad` to None,
    so the next backward starts from zero. `RecorderError` for sharded (DTensor)
    gradients, before any `.grad` is taken."""
    grads = GradientsParams()
    params = named_parameters(model)
    refuse_dtensors([(n, p.grad) for n, p in params], "the gradient of")
    for name, p in params:
        if p.grad is not None:
            grads.register(name, p.grad)
            p.grad = None
    return grads


def set_grads(model: nn.Module, grads: GradientsParams, *, allow_empty: bool = False) -> None:
    """Write `.grad` of every parameter from `grads`, cast to the parameter's dtype and
    device; parameters absent from `grads` get None. Empty `grads` (an accumulator's
    `grads()` taken twice, or before any `accumulate`) would make the next
    `optimizer.step()` do nothing: they raise `ValueError` unless `allow_empty=True`. So do
    non-empty `grads` of which none is for a parameter of the model (gradients of another
    model's ParamIds, e.g. taken from a wrapper: `"0.weight"` for `"weight"`), naming a
    few of each. Gradients of ParamIds the model lacks are otherwise ignored. Nothing is
    written unless every gradient fits its parameter. ParamIds are those of the model
    inside any wrappers, as `grads_from` gives them; sharded (DTensor) parameters are a
    `RecorderError`."""
    if not isinstance(grads, GradientsParams):
        raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
    if grads.is_empty() and not allow_empty:
        raise ValueError(
            "grads is empty: every .grad would be None and optimizer.step() would do nothing "
            "(was acc.grads() already taken this window?); pass allow_empty=True to clear .grad"
        )
    params = named_parameters(model)
    refuse_dtensors(params, "parameter")
    if not grads.is_empty() and not any(name in grads for name, _ in params):
        raise ValueError(
            f"none of the {len(grads)} gradients is for a parameter of the model: gradients for "
            f"{_some(grads)}, model parameters {_some(name for name, _ in params)}; every .grad "
            "would be None and optimizer.step() would do nothing (were the gradients taken from "
            "another module, or named by hand with a prefix?)"
        )
    for name, p in params:
        g = grads.get(name)
        if g is not None and (not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(p.shape)):
            raise ValueError(f"gradient for {name!r} must be a tensor of shape {tuple(p.shape)}")
    for name, p in params:
        g = grads.get(name)
        p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype)


def _some(ids: Iterable[str], n: int = 3) -> str:
    names = list(ids)
    shown = ", ".join(repr(k) for k in names[:n])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > n else ''}]"
