"""`trainrec.adapters.jax`: JAX pytrees, optax optimizers and schedules, flax models.

JAX values are immutable, so the protocol objects are holders whose fields the training
loop reassigns: `JaxModule(params)`, `JaxOptimizer(tx, opt_state)`,
`JaxLrScheduler(schedule, count)`. `grads_from(grad_tree, module)` / `to_tree(grads,
module)` move gradients between pytrees and `GradientsParams`. Native models bind
as they are (`trainrec.adapt` finds them): a flax `nnx.Module` / `nnx.Optimizer` as
`NnxModule` / `NnxOptimizer` (restored in place), an `eqx.Module` as `EqxModule`
(restored as a new module: `RestoredTraining.model`). `JaxRngRecord` records JAX keys
(typed and raw) and flax nnx `Rngs`.
`FlaxMsgpackFileRecorder` writes flax's msgpack convention (readable by
`flax.serialization.msgpack_restore`) without needing flax; `OrbaxRecorder` writes
Orbax checkpoint directories through `orbax-checkpoint` (every process its own shards).
Restore targets may be abstract (`jax.ShapeDtypeStruct` leaves, from `jax.eval_shape`):
`TrainingRecord.restore(JaxModule(abstract), ...)` and `restore_tree(rec.model, abstract)`
give concrete arrays placed by the targets' shardings; sharded arrays are captured
shard by shard (`placement.py`).

Importing this package imports no JAX: each name is loaded on first use (so
`trainrec.adapters.jax.neutral`, the conversion form, works without JAX installed).

The bindings' modules in layers, each importing only those before it (tests/test_adapter_layers.py
fails on an import circle): `paths` (ParamIds), `placement`, `identity`, `neutral` ->
`rng` -> `backend` (`JaxBackend`, `accumulate_tree`) -> `trees` (leaves <-> record
items) -> `bindings` (`JaxModule`, `JaxOptimizer`, `JaxLrScheduler`) -> `_arrays` ->
`nnx`, `equinox` -> `adapter` (`ADAPTER`, which finds the native models) -> `grads`
(`grads_from`, `to_tree`, which take any module the adapter binds) -> `restore`. The
recorders (`recorder`, `orbax_*`) import at most `placement`; `demo` stands on top.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import ADAPTER, JaxAdapter
    from .backend import JaxBackend, accumulate_tree
    from .bindings import JaxLrScheduler, JaxModule, JaxOptimizer
    from .equinox import EqxModule
    from .grads import grads_from, to_tree
    from .nnx import NnxModule, NnxOptimizer
    from .orbax_recorder import OrbaxRecorder, shardings_of
    from .recorder import FlaxMsgpackFileRecorder
    from .restore import restore_tree
    from .rng import JaxRngRecord

__all__ = [
    "ADAPTER",
    "EqxModule",
    "FlaxMsgpackFileRecorder",
    "JaxAdapter",
    "JaxBackend",
    "JaxLrScheduler",
    "JaxModule",
    "JaxOptimizer",
    "NnxModule",
    "NnxOptimizer",
    "OrbaxRecorder",
    "JaxRngRecord",
    "accumulate_tree",
    "grads_from",
    "restore_tree",
    "shardings_of",
    "to_tree",
]

_HOME = {name: "bindings" for name in __all__}
_HOME["FlaxMsgpackFileRecorder"] = "recorder"
_HOME.update(NnxModule="nnx", NnxOptimizer="nnx", EqxModule="equinox")
_HOME["JaxRngRecord"] = "rng"
_HOME["restore_tree"] = "restore"
_HOME["OrbaxRecorder"] = _HOME["shardings_of"] = "orbax_recorder"
_HOME.update(ADAPTER="adapter", JaxAdapter="adapter", JaxBackend="backend",
             accumulate_tree="backend", grads_from="grads", to_tree="grads")


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{home}")
    except ImportError as e:
        if e.name is not None and e.name.partition(".")[0] in (
                "jax", "jaxlib", "optax", "flax", "equinox", "orbax"):
            root = e.name.partition(".")[0]
            extra = root if root in ("flax", "equinox", "orbax") else "jax"
            raise ImportError(f"trainrec.adapters.jax.{name} needs {root}, which is not "
                              f"installed: pip install 'trainrec[{extra}]'", name=e.name) from e
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
