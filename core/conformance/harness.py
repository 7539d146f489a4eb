"""`Harness`: what an adapter author writes to run the conformance suite.

A harness is a small training workload plus a few facts about the backend. It is also
what `trainrec demo --backend module:attr` and the fresh-process continuation tests run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..demo import Parts
from ..dtypes import DType
from ..protocols import AutodiffBackend, Recorder
from ..registry import adapt_module

__all__ = ["Harness", "Parts"]


class Harness:
    """Subclass and fill in the workload; the defaults cover the rest.

    Required: `ref` (an importable `"module:attr"` naming this harness, for fresh
    processes), `state_type` (a `@trainrec.record` dataclass with an int field `micro`),
    `build(seed)`, `micro_step(parts)` (draw a batch, compute gradients, accumulate them
    into `parts.accumulator`, keeping every RNG in the state) and `apply_window(parts,
    window)` (take `parts.accumulator.grads()`, step optimizer and scheduler).
    Optional: `before_capture` / `after_restore` (move framework RNG into / out of the
    state), `device`, `dtypes` (those the backend supports), `recorders` (the adapter's
    own, by name), `native_objects(parts)` (objects `trainrec.adapt` must resolve),
    `reorder(parts)` (the same parameters in another order, where the framework allows it).
    """

    name: ClassVar[str] = "adapter"
    ref: str = ""  # an instance may name its variant
    state_type: ClassVar[type[Any]]
    device: Any = None
    dtypes: ClassVar[tuple[DType, ...]] = tuple(DType)
    recorders: ClassVar[dict[str, Recorder]] = {}
    window: ClassVar[int] = 4

    def build(self, seed: int) -> Parts:
        raise NotImplementedError

    def micro_step(self, parts: Parts) -> None:
        raise NotImplementedError

    def apply_window(self, parts: Parts, window: int) -> None:
        raise NotImplementedError

    def before_capture(self, parts: Parts) -> None:
        """Put framework RNG state into `parts.state` (default: nothing to do)."""

    def after_restore(self, parts: Parts) -> None:
        """Put RNG state from `parts.state` back into the framework (default: nothing)."""

    def reorder(self, parts: Parts) -> bool:
        """Give the model of a freshly built `parts` the same parameters in another order
        (`param_ids()` lists them differently) and return True, so the suite checks that
        optimizer records are keyed by ParamId, never by position. Default: False (the
        framework keeps one order)."""
        return False

    def backend(self, parts: Parts) -> AutodiffBackend:
        return adapt_module(parts.model).backend

    def native_objects(self, parts: Parts) -> list[Any]:
        return [o for o in (parts.model, parts.optimizer, parts.scheduler) if o is not None]

    def tensor(self, parts: Parts, array: np.ndarray[Any, Any]) -> Any:
        """A backend tensor holding `array` on the harness's device."""
        backend = self.backend(parts)
        return backend.from_host(array, backend.device(self.device))
