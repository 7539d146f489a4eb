"""What `trainrec check` compares: a snapshot of the training state split into the
components a report names (`components_of`), the leaves that differ between two of them
(`differences`, `compare`), and the recorders `--recorder` names (`named_recorder`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import numpy as np

from ..items.tensor import TensorData
from ..items.tree import Item, join_key, walk_pairs
from ..precision import NativePrecisionSettings
from ..workload.loop import Workload, recorders_for

__all__ = ["COLLECTIVE", "COMPONENTS", "as_map", "compare", "components_of", "differences",
           "load_target", "named_recorder", "recorder_names", "rng_fields"]

SCRIPT_MODULE = "__trainrec_check_script__"
"""The module name a `script.py:attr` target's file is imported under in a fresh process."""


def load_target(target: str) -> Any:
    """The workload `target` names: `module:attr` (`trainrec.workload.loop.load_workload`), or
    `path/to/script.py:attr`, whose file is imported as a module of its own (its
    `if __name__ == "__main__":` block does not run), so that a script may check the
    workload it defines. A class is instantiated."""
    from ..workload.loop import load_workload

    module, _, attr = target.rpartition(":")
    if not module.endswith(".py"):
        return load_workload(target)
    import importlib.util
    import sys

    loaded = sys.modules.get(SCRIPT_MODULE)
    if loaded is None or getattr(loaded, "__file__", None) != module:
        spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, module)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {module}")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[SCRIPT_MODULE] = loaded  # dataclasses look their module up while built
        spec.loader.exec_module(loaded)
    found = getattr(loaded, attr)
    return found() if isinstance(found, type) else found

COMPONENTS = ("model", "optimizer", "scheduler", "pending", "state", "rng", "data")
"""What a check compares, in the order a report lists them."""

_NATIVE = NativePrecisionSettings()
_RNG_NAME = re.compile(r"rng|random|key|seed|generator", re.I)

CHECK_RECORDERS_GROUP = "trainrec.check_recorders"
"""Where adapters declare the recorders `trainrec check --recorder NAME` takes: `name =
"module:attr"`, a callable given native precision settings that returns the recorder (the
bundled adapters' `torch`, `ddp`, `dcp` and `orbax` are declared in trainrec's pyproject)."""


def _flax_recorder(native: Any) -> Any:
    from ..recorders.flaxmsgpack import FlaxMsgpackFileRecorder

    return FlaxMsgpackFileRecorder(native)


@functools.cache
def _adapter_recorders() -> dict[str, Any]:
    """Recorders by name beyond the core ones and the workload's own: core's flax msgpack
    and those adapters declare (read once from the entry points; an entry point of the
    same name replaces core's)."""
    found: dict[str, Any] = {"flax": _flax_recorder}
    found.update({ep.name: ep for ep in metadata.entry_points(group=CHECK_RECORDERS_GROUP)})
    return found


COLLECTIVE = ("DistributedRecorder", "DCPRecorder", "OrbaxRecorder")
"""Recorders whose checkpoint is one path for all ranks (each rank writes its part)."""


def recorder_names(workload: Workload) -> list[str]:
    """The names `--recorder` takes for `workload` (besides `module:attr`)."""
    return sorted({*recorders_for(workload), *_adapter_recorders()})


def named_recorder(workload: Workload, name: str) -> Any:
    """The recorder `--recorder name` means: a core one (`mpk`, `mpk-full`, `gz`, `bytes`),
    the workload's own (its `recorders`), an adapter's (`torch`, `ddp`, `dcp`, `flax`,
    `orbax`, each with native precision), or `module:attr` naming a recorder object.
    Raises `ValueError` for a name it does not know."""
    own = recorders_for(workload)
    if name in own:
        return own[name]
    if name in _adapter_recorders():
        factory = _adapter_recorders()[name]
        make = factory.load() if isinstance(factory, metadata.EntryPoint) else factory
        return make(_NATIVE)
    if ":" in name:
        module, _, attr = name.partition(":")
        found = getattr(importlib.import_module(module), attr)
        return found() if isinstance(found, type) else found
    raise ValueError(f"no recorder {name!r}: one of {recorder_names(workload)}, or module:attr")


# -- what a snapshot holds ------------------------------------------------------------------


def rng_fields(workload: Workload, state: Any) -> list[str]:
    """The fields of `state` a report calls `rng`: those the workload names in
    `rng_fields`, those holding an RNG record (`RngRecord`, `TorchRngRecord`,
    `JaxRngRecord`, ...) and those whose name says RNG, key, seed or generator."""
    if not dataclasses.is_dataclass(state):
        return []
    named = set(getattr(workload, "rng_fields", ()))
    return [f.name for f in dataclasses.fields(state)
            if f.name in named or type(getattr(state, f.name, None)).__name__.endswith("RngRecord")
            or _RNG_NAME.search(f.name)]


def components_of(record: Item, rng: Sequence[str]) -> dict[str, Item]:
    """A `TrainingRecord` item split into the components a report names. The pending
    gradients are the accumulator's and, for a torch model, the `.grad` its record holds
    (`grads`); the caller state's `rng` fields are `rng`, its others `state`."""
    if not isinstance(record, list) or len(record) != 5:
        raise ValueError("not a TrainingRecord item")
    model, optimizer, scheduler, grads, state = record
    out: dict[str, Item] = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    pending: dict[str, Item] = {}
    if isinstance(grads, dict):
        pending.update({k: v["value"] if isinstance(v, dict) and "value" in v else v
                        for k, v in grads.items()})
    if isinstance(model, dict) and isinstance(model.get("state"), dict):
        inner = dict(model["state"])  # type: ignore[arg-type]
        native_grads = inner.pop("grads", None)
        if isinstance(native_grads, dict):
            pending.update({f".grad:{k}": v for k, v in native_grads.items()})
        if isinstance(inner.get("tensors"), dict):  # a torch module: its state_dict's tensors
            inner.update(inner.pop("tensors"))  # type: ignore[arg-type]
        out["model"] = {"kind": model.get("kind"), **inner}
    if isinstance(optimizer, dict) and "state" in optimizer:
        out["optimizer"] = {"kind": optimizer.get("kind"), **as_map(optimizer["state"])}
    if isinstance(scheduler, dict) and "state" in scheduler:
        out["scheduler"] = {"kind": scheduler.get("kind"), **as_map(scheduler["state"])}
    out["pending"] = pending
    fields = state if isinstance(state, dict) else {"": state}
    out["rng"] = {k: v for k, v in fields.items() if k in rng}
    out["state"] = {k: v for k, v in fields.items() if k not in rng}
    return out


def as_map(item: Item) -> dict[str, Item]:
    return dict(item) if isinstance(item, dict) else {"": item}


def differences(a: Item, b: Item, prefix: str = "") -> list[tuple[str, float]]:
    """(key path, max |a - b|) for every leaf of `a` and `b` that differs, in walk order:
    tensors and numbers by value, bytes as unsigned bytes; inf for another shape, dtype,
    kind or length, a key only one side has, or a value with no size (a string, a hash).
    The elements of a list of scalars (an RNG's state words, a batch's ids) count as one
    leaf, the list, with the max over them."""
    out: dict[str, float] = {}
    for where, x, y in walk_pairs(a, b, prefix):
        if isinstance(x, dict) and isinstance(y, dict):  # other keys: each one apart
            for k in x:
                sub = join_key(where, k)
                if k in y:
                    for key, size in differences(x[k], y[k], sub):
                        out[key] = max(out.get(key, 0.0), size)
                else:
                    out[sub] = math.inf
            out.update({join_key(where, k): math.inf for k in y if k not in x})
            continue
        gap = _gap(x, y)
        if gap is not None:
            head, _, last = where.rpartition(".")
            key = head if head and last.isdigit() and not isinstance(x, TensorData) else where
            out[key] = max(out.get(key, 0.0), gap)
    return list(out.items())


def _gap(x: Any, y: Any) -> float | None:
    if isinstance(x, TensorData) and isinstance(y, TensorData):
        if x.shape != y.shape or x.dtype is not y.dtype:
            return math.inf
        ax, ay = x.array, y.array
        if ax.tobytes() == ay.tobytes():
            return None
        return _array_gap(ax, ay)
    if isinstance(x, bytes) and isinstance(y, bytes):
        if x == y:
            return None
        if len(x) != len(y):
            return math.inf
        return _array_gap(np.frombuffer(x, np.uint8), np.frombuffer(y, np.uint8))
    if isinstance(x, (dict, list)) or isinstance(y, (dict, list)):
        return math.inf  # another kind, other keys or another length
    if type(x) is type(y) and repr(x) == repr(y):
        return None
    numbers = (int, float)
    if isinstance(x, numbers) and isinstance(y, numbers) and not isinstance(x, bool) \
            and not isinstance(y, bool):
        gap = abs(float(x) - float(y))
        return gap if gap > 0 else math.inf  # 0.0 vs -0.0, 1 vs 1.0: another value all the same
    return math.inf


def _array_gap(ax: np.ndarray[Any, Any], ay: np.ndarray[Any, Any]) -> float:
    if ax.dtype.kind not in "fiub" or ax.size == 0:
        return math.inf  # no size to a difference of other dtypes (bfloat16 included below)
    fx, fy = ax.astype(np.float64), ay.astype(np.float64)
    nan_x, nan_y = np.isnan(fx), np.isnan(fy)
    if (nan_x != nan_y).any():
        return math.inf
    gap = np.abs(np.where(nan_x, 0.0, fx) - np.where(nan_y, 0.0, fy))
    worst = float(gap.max()) if gap.size else 0.0
    return worst if worst > 0 else math.inf  # the bytes differ (a -0.0, a NaN payload)


def compare(ref: dict[str, Item], got: dict[str, Item]) -> list[tuple[str, str, float]]:
    rows: list[tuple[str, str, float]] = []
    for component in COMPONENTS:
        if component in ref or component in got:
            for key, gap in differences(ref.get(component), got.get(component)):
                rows.append((component, key, gap))
    return rows
