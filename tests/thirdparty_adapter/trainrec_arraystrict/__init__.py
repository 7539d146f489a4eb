"""trainrec adapter for array-api-strict: backend, a linear model, SGD, a step schedule."""

from .adapter import ADAPTER, ArrayStrictAdapter, StrictBackend
from .model import SGD, Linear, StepSchedule

__all__ = ["ADAPTER", "ArrayStrictAdapter", "Linear", "SGD", "StepSchedule", "StrictBackend"]
