"""Moving gradients between `.grad` and `GradientsParams`."""

from __future__ import annotations

import torch
from torch import nn

from trainrec import GradientsParams

__all__ = ["grads_from", "set_grads"]


def grads_from(model: nn.Module) -> GradientsParams:
    """Take each parameter's `.grad` into a `GradientsParams` (by ParamId) and set `.grad`
    to None, so the next backward starts from zero."""
    grads = GradientsParams()
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.register(name, p.grad)
            p.grad = None
    return grads


def set_grads(model: nn.Module, grads: GradientsParams, *, allow_empty: bool = False) -> None:
    """Write `.grad` of every parameter from `grads`, cast to the parameter's dtype and
    device; parameters absent from `grads` get None. Empty `grads` (an accumulator's
    `grads()` taken twice, or before any `accumulate`) would make the next
    `optimizer.step()` do nothing: they raise `ValueError` unless `allow_empty=True`."""
    if not isinstance(grads, GradientsParams):
        raise TypeError(f"grads must be GradientsParams, got {type(grads).__name__}")
    if grads.is_empty() and not allow_empty:
        raise ValueError(
            "grads is empty: every .grad would be None and optimizer.step() would do nothing "
            "(was acc.grads() already taken this window?); pass allow_empty=True to clear .grad"
        )
    for name, p in model.named_parameters():
        g = grads.get(name)
        if g is None:
            p.grad = None
            continue
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"gradient for {name!r} must be a tensor of shape {tuple(p.shape)}")
        p.grad = g.detach().to(device=p.device, dtype=p.dtype)
