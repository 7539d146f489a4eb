"""Bindings of native torch objects to trainrec's protocols, and the adapter that finds them.

- `TorchModule(nn.Module)`: ParamIds from `named_parameters()` of the model inside any
  `torch.compile` / DDP / DataParallel wrappers (`wrappers.py`); the record is the whole
  `state_dict` (persistent buffers too), tied tensors stored once, plus every parameter's
  `.grad` that is not None (gradients accumulated natively with repeated `backward()`
  are pending gradients too); restore copies in place under `no_grad`, so optimizers
  keep pointing at the live parameters, and sets `.grad` to the recorded value or None.
- `TorchOptimizer(Optimizer)`: `state_dict` re-keyed from position to ParamId, with every
  param-group hyperparameter.
- `TorchLrScheduler(LRScheduler | ReduceLROnPlateau)`: `state_dict`. Functions (the
  lambdas of LambdaLR) are code, not data: torch records them as None and they come from
  the caller's program.

This module holds `TorchAdapter` (and `ADAPTER`); each binding lives in its own module
beside it, `module_binding`, `optimizer_binding` (with `_STATE_KEYS`), `scheduler_binding`,
and the state values they share in `state_values`. Every name importable from here before
the split still is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backend import TorchBackend, from_torch_dtype, numpy_to_tensor  # noqa: F401
from .identity import (  # noqa: F401
    IDENTITY_KEY,
    flatten,
    group_keys_differ,
    hyperparameter_fields,
    identity_of,
    scheduler_fields,
    take_live_hyperparameters,
)
from .module_binding import (  # noqa: F401
    TorchModule,
    _torch_module,
)
from .optimizer_binding import (  # noqa: F401
    _STATE_KEYS,
    TorchOptimizer,
    _adam_keys,
    _builtin_state_mismatches,
    _cast_problems,
    _optim,
    _rmsprop_keys,
    _state_mismatches,
    _StateKeys,
)
from .scheduler_binding import (  # noqa: F401
    TorchLrScheduler,
    _is_scheduler,
)
from .scheduler_binding import take_live as take_live  # imported from here by trainrec itself
from .state_values import (  # noqa: F401
    _BACKEND,
    _PAIRS,
    _kind,
    decode,
    encode,
)
from .wrappers import named_parameters, named_state, refuse_dtensors  # noqa: F401

__all__ = ["TorchModule", "TorchOptimizer", "TorchLrScheduler", "TorchAdapter", "ADAPTER",
           "encode", "decode"]


class TorchAdapter:
    """Finds the binding for torch objects: modules, optimizers, LR schedulers, and the
    backend for tensors, tensor types and devices."""

    name = "torch"

    def adapt(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return TorchModule(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return TorchOptimizer(obj)
        if _is_scheduler(obj):
            return TorchLrScheduler(obj)
        if isinstance(obj, (torch.Tensor, torch.device)):
            return _BACKEND
        if isinstance(obj, type) and issubclass(obj, torch.Tensor):
            return _BACKEND
        return None


ADAPTER = TorchAdapter()
