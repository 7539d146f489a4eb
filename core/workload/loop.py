"""`Workload`: a training loop described in five methods, which `trainrec check`,
`trainrec demo` and the conformance suite drive.

A workload builds a model, optimizer, scheduler and caller state (`Parts`) and runs one
micro-step of gradient accumulation at a time; `train_until` strings micro-steps into
accumulation windows. Users describe their own loop as one (`trainrec check module:attr`
proves that it resumes exactly, README "Checking your own loop"); each adapter ships its own
(`trainrec.adapters.<name>.demo`), a third-party adapter writes one for its tests
(spec/ADAPTERS.md, section 4), and `load_workload` finds any of them by name.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, ClassVar

import numpy as np

from ..items.dtypes import DType
from ..items.tree import Item
from ..precision import NativePrecisionSettings
from ..recorders.namedmpk import NamedMpkBytesRecorder, NamedMpkFileRecorder, NamedMpkGzFileRecorder
from ..training.accumulator import GradientsAccumulator
from ..training.protocols import AutodiffBackend, Recorder
from ..training.registry import adapt_module
from .fingerprint import fingerprint

__all__ = ["CORE_RECORDERS", "Parts", "Workload", "load_workload", "recorders_for", "train_until"]


@dataclass
class Parts:
    """The live objects of one training run.

    `model`, `optimizer`, `scheduler` (or None), `state` (your `@trainrec.record`, with an
    int field `micro`) and `accumulator` (the pending gradients) are what a checkpoint
    holds. `extras` holds everything else the loop uses (data iterators, generators, a
    GradScaler, jitted steps): `trainrec check` compares them too after a resume, to name
    one that the checkpoint does not carry. `batches` is what the current micro-step
    reported with `report_batch`."""

    model: Any
    optimizer: Any
    scheduler: Any
    state: Any
    accumulator: GradientsAccumulator[Any] = field(default_factory=GradientsAccumulator)
    extras: dict[str, Any] = field(default_factory=dict)
    batches: list[Item] = field(default_factory=list)

    def report_batch(self, batch: Any) -> None:
        """Tell `trainrec check` what this micro-step consumed, so that it can tell the data
        from the arithmetic: sample ids (ints, a list or an integer array of up to
        `trainrec.workload.fingerprint.MAX_IDS`, shown in its report) or the batch itself (arrays,
        tensors or a tuple or dict of them, kept as a SHA-256). Call it in `micro_step`;
        several calls in one micro-step are kept in order. Costs a host copy of what it is
        given; outside a check it is kept until the next micro-step of a check only."""
        self.batches.append(fingerprint(batch))


class Workload:
    """A training loop, one micro-step at a time: subclass it and fill in the job.

    Required: `state_type` (a `@trainrec.record` dataclass with an int field `micro`,
    which the driver counts), `build(seed)` (fresh `Parts`: seed everything, so two
    processes built with the same seed compute the same bits), `micro_step(parts)` (draw
    a batch, compute gradients, accumulate them into `parts.accumulator`, or into `.grad`
    where the framework accumulates there) and `apply_window(parts, window)` (take the
    window's gradients, step optimizer and scheduler).
    Optional: `before_capture(parts)` (put the framework RNG into `parts.state` right
    before a checkpoint), `after_restore(parts)` (put it back after a restore, before the
    next batch), `ref` (`"module:attr"` naming this workload for fresh processes; a class
    or `TARGET` names itself), `window` (the default accumulation window), `device`,
    `rng_fields` (the state fields that hold RNG state, where their names or types do not
    say so: `trainrec check` reports them as `rng`), `save_checkpoint(parts, path)` and
    `load_checkpoint(parts, path)` (a tool's own save and resume, such as Accelerate's
    `save_state` / `load_state`, in place of a trainrec recorder).
    For adapter authors: `dtypes` (those the backend supports), `recorders` (the adapter's
    own, by name), `native_objects(parts)` (objects `trainrec.adapt` must resolve),
    `reorder(parts)` (the same parameters in another order, where the framework allows it),
    `native_grads` / `set_native_grads` (gradients pending in the framework's own gradient
    slots, torch's `.grad`), `overwrite(parts, tensor, array)` (write into a tensor in
    place, as a compiled step reusing its output buffers does).
    The micro-steps are run by `train_until`: `micro_step`, then `state.micro += 1`, then
    `apply_window` when `state.micro` is a multiple of the window.
    """

    name: ClassVar[str] = "adapter"
    ref: str = ""  # an instance may name its variant
    state_type: ClassVar[type[Any]]
    device: Any = None
    dtypes: ClassVar[tuple[DType, ...]] = tuple(DType)
    recorders: ClassVar[dict[str, Recorder]] = {}
    window: ClassVar[int] = 4
    rng_fields: ClassVar[tuple[str, ...]] = ()

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

    def native_grads(self, parts: Parts) -> dict[str, np.ndarray[Any, Any]] | None:
        """The gradients pending in the framework's own gradient slots (torch's and
        tinygrad's `.grad`, which a second `backward()` adds into), by ParamId, as host
        arrays; ParamIds with none pending are absent. Default None: the framework keeps
        no gradients on its tensors. A workload that gives this gives `set_native_grads`
        too, and the suite checks that a module record carries them, or that capture
        refuses them."""
        return None

    def set_native_grads(self, parts: Parts, grads: dict[str, np.ndarray[Any, Any]]) -> None:
        """Make `grads` (by ParamId) the gradients pending in the framework's own slots,
        and no others (as repeated `backward()` calls leave them)."""
        raise NotImplementedError(f"{type(self).__name__} gives native_grads but not set_native_grads")

    def overwrite(self, parts: Parts, tensor: Any, array: np.ndarray[Any, Any]) -> bool:
        """Write `array` into `tensor` in place, as a compiled step that reuses its output
        buffers (or zeroing `.grad` in place) does, and return True; False where the
        framework's tensors cannot be written in place (JAX arrays), where sharing one is
        safe. Default: `tensor[...] = <array as a backend tensor>`, False when that raises."""
        try:
            tensor[...] = self.tensor(parts, array)
        except Exception:  # noqa: BLE001 - an immutable tensor refuses in its own way
            return False
        return True

    def backend(self, parts: Parts) -> AutodiffBackend:
        return adapt_module(parts.model).backend

    def native_objects(self, parts: Parts) -> list[Any]:
        return [o for o in (parts.model, parts.optimizer, parts.scheduler) if o is not None]

    def tensor(self, parts: Parts, array: np.ndarray[Any, Any]) -> Any:
        """A backend tensor holding `array` on the workload's device."""
        backend = self.backend(parts)
        return backend.from_host(array, backend.device(self.device))


def train_until(workload: Workload, parts: Parts, until: int, window: int) -> None:
    """Micro-steps until `parts.state.micro == until`, stepping the optimizer at the end of
    every window of `window` micro-steps."""
    while parts.state.micro < until:
        workload.micro_step(parts)
        parts.state.micro += 1
        if parts.state.micro % window == 0:
            workload.apply_window(parts, window)


CORE_RECORDERS: dict[str, Recorder] = {
    "mpk": NamedMpkFileRecorder(NativePrecisionSettings()),
    "mpk-full": NamedMpkFileRecorder(),
    "gz": NamedMpkGzFileRecorder(NativePrecisionSettings()),
    "bytes": NamedMpkBytesRecorder(NativePrecisionSettings()),
}
"""The recorders every workload is checkpointed with, by the names roles and the suite use."""


def recorders_for(workload: Workload) -> dict[str, Recorder]:
    """The core recorders plus the workload's own (its `recorders`)."""
    return {**CORE_RECORDERS, **getattr(workload, "recorders", {})}


ENTRY_POINT_GROUP = "trainrec.workloads"
"""Where adapters declare their workloads by name: `name = "module"` (a module with
`WORKLOADS`, a dict of variants, or `WORKLOAD`); the bundled adapters declare theirs
(`numpy`, `torch`, `jax`) in trainrec's pyproject as any adapter does."""


@functools.cache
def workload_modules() -> dict[str, str]:
    """The workloads adapters declare, name -> module (read once from the entry points)."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_workload(backend: str, variant: str = "default") -> Workload:
    """The adapter's workload: `WORKLOADS[variant]` of the module an adapter declares as
    `backend` (`workload_modules()`),
    or, for `backend` of the form `"module:attr"`, that object (a class is instantiated):
    the workload of any adapter."""
    if ":" in backend:
        module_name, _, attr = backend.partition(":")
        found = getattr(importlib.import_module(module_name), attr)
        workload: Workload = found() if isinstance(found, type) else found
        return workload
    declared = workload_modules()
    if backend not in declared:
        raise ValueError(f"no bundled workload {backend!r}: one of {sorted(declared)}, or module:attr")
    module = importlib.import_module(declared[backend])
    workloads: dict[str, Workload] = getattr(module, "WORKLOADS", {"default": module.WORKLOAD})
    if variant not in workloads:
        raise ValueError(f"{backend} has no workload {variant!r}; it has {sorted(workloads)}")
    return workloads[variant]
