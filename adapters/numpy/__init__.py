"""`trainrec.adapters.numpy`: the reference adapter, in pure numpy.

It is the executable specification of every protocol: `NumpyBackend`, the `MLP` module
with explicit backward, optimizers `SGD`, `Adam`, `AdamW` with torch.optim's formulas and
schedulers `ConstantLr`, `StepLr`, `CosineAnnealingLr`, `LinearWarmupCosineLr`.
"""

from .backend import ADAPTER, NumpyAdapter, NumpyBackend
from .mlp import MLP
from .optim import SGD, Adam, AdamW
from .schedulers import ConstantLr, CosineAnnealingLr, LinearWarmupCosineLr, StepLr

__all__ = [
    "ADAPTER",
    "MLP",
    "SGD",
    "Adam",
    "AdamW",
    "ConstantLr",
    "CosineAnnealingLr",
    "LinearWarmupCosineLr",
    "NumpyAdapter",
    "NumpyBackend",
    "StepLr",
]
