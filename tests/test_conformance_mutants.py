"""Mutation test of the conformance suite: broken variants of the numpy reference adapter
and of an out-of-tree adapter for minigrad (tests/trainrec_minigrad.py: gradients pending
in `.grad`, mutable tensors whose `add` is not in place, a framework-global RNG), each
breaking one documented requirement (spec/ADAPTERS.md, the contract sentences of
core/protocols.py), must each fail the suite with a `contract:` message naming the
component and key. The unbroken adapters pass the same checks."""

from __future__ import annotations

import inspect
import itertools
import re
import tempfile
from pathlib import Path
from typing import Any

import minigrad
import numpy as np
import pytest
from trainrec_minigrad import MiniBackend, MiniModule, MiniWorkload, take_grads

from trainrec import DType, RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import Parts, RngRecord, check_tensor_map, expect_kind
from trainrec.adapters.numpy.backend import NumpyBackend
from trainrec.adapters.numpy.demo import NumpyWorkload
from trainrec.adapters.numpy.mlp import MLP
from trainrec.adapters.numpy.optim import AdamW
from trainrec.adapters.numpy.schedulers import LinearWarmupCosineLr
from trainrec.conformance import AdapterConformance
from trainrec.conformance.harness import midway

# checks that run a fresh process or read spec files: the same for every mutant
_NOT_PER_ADAPTER = {"test_exact_continuation_in_a_fresh_process", "test_spec_vectors_load_bit_exactly"}


def _checks() -> list[tuple[str, dict[str, Any]]]:
    """Every check of the suite, once per parameter combination, as pytest would run it."""
    out = []
    for name, fn in inspect.getmembers(AdapterConformance, inspect.isfunction):
        if not name.startswith("test_") or name in _NOT_PER_ADAPTER:
            continue
        grids: list[list[dict[str, Any]]] = []
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "parametrize":
                names = [n.strip() for n in mark.args[0].split(",")]
                grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
        for combo in itertools.product(*grids):
            out.append((name, {k: v for d in combo for k, v in d.items()}))
    return out


def run_suite(harness: Any) -> list[tuple[str, str, str]]:
    """The suite's checks run on `harness`: (check, "fail" or "error", message) of each that
    did not pass."""
    suite = type("Suite", (AdapterConformance,), {"workload": harness})()
    failures = []
    for name, params in _checks():
        method = getattr(suite, name)
        wanted = inspect.signature(method).parameters
        with tempfile.TemporaryDirectory() as tmp:
            fixtures = {"h": harness, "tmp_path": Path(tmp)}
            if "parts" in wanted:
                fixtures["parts"] = midway(harness)
            try:
                method(**{k: v for k, v in fixtures.items() if k in wanted}, **params)
            except pytest.skip.Exception:
                pass
            except (AssertionError, pytest.fail.Exception) as e:
                failures.append((f"{name}{params}", "fail", str(e)))
            except Exception as e:  # noqa: BLE001 - reported, the test decides
                failures.append((f"{name}{params}", "error", f"{type(e).__name__}: {e}"))
    return failures


# -- the broken variants -------------------------------------------------------------------


def _backend(**methods: Any) -> type[MLP]:
    backend = type("BrokenBackend", (NumpyBackend,), methods)
    return type("MLPWithBrokenBackend", (MLP,), {"backend": property(lambda self: backend())})


async def _view_async(self: Any, tensor: Any) -> Any:
    return tensor


def _add_into_grad(self: Any, pending: Any, grad: Any) -> Any:
    np.add(pending, grad, out=grad)
    return grad


class _PositionalAdamW(AdamW):
    """Keys per-parameter state by position in `param_ids()`, not by ParamId."""

    def into_record(self, module: Any) -> StateRecord:
        rec = super().into_record(module)
        ids = list(module.param_ids())
        item: Any = rec.item
        return StateRecord(self.kind, {"hyper": item["hyper"],
                                       "state": {str(ids.index(p)): e for p, e in item["state"].items()}})

    def _checked(self, record: Any, module: Any) -> Any:
        ids, item = list(module.param_ids()), record.item
        state = {ids[int(k)] if k.isdigit() and int(k) < len(ids) else k: e for k, e in item["state"].items()}
        return super()._checked(StateRecord(record.kind, {**item, "state": state}), module)


class _LenientAdamW(AdamW):
    """Drops state for ParamIds the model lacks instead of refusing it."""

    def _checked(self, record: Any, module: Any) -> Any:
        item = record.item
        if isinstance(item, dict) and isinstance(item.get("state"), dict):
            shapes = module.param_shapes()
            item = {**item, "state": {k: e for k, e in item["state"].items() if k in shapes}}
        return super()._checked(StateRecord(record.kind, item), module)


def _no_check(self: Any, record: Any, *module: Any) -> None:
    return None


def _check_loads(self: MLP, record: Any) -> None:
    self.load_record(record, "cpu")


class _SteppingScheduler(LinearWarmupCosineLr):
    def load_record(self, record: Any) -> None:
        super().load_record(record)
        self.count += 1


def _shared_record(self: MLP) -> StateRecord:
    return StateRecord(self.kind, {k: TensorData.from_array(v, copy=False) for k, v in self.params.items()})


class _ShallowAdamW(AdamW):
    """Checks kind, the {hyper, state} layout and unknown ParamIds only: not the buffers'
    shapes or dtype kinds, not the hyperparameters' types."""

    def _checked(self, record: Any, module: Any) -> Any:
        item = expect_kind(record, self.kind, "optimizer")
        if not isinstance(item, dict) or set(item) != {"hyper", "state"}:
            raise RecordMismatchError("optimizer record must be {hyper, state}", key="optimizer")
        if any(p not in module.param_shapes() for p in item["state"]):
            raise RecordMismatchError("state for parameters the model lacks", key="optimizer.state")
        return dict(item["hyper"]), {k: dict(v) for k, v in item["state"].items()}


def _check_shapes_only(self: MLP, record: Any) -> None:
    """Names and shapes, not the dtype kind."""
    item = expect_kind(record, self.kind, "model")
    if not isinstance(item, dict) or set(item) != set(self.params) or any(
            getattr(v, "shape", None) != self.params[k].shape for k, v in item.items()):
        raise RecordMismatchError("names or shapes differ", key="model")


class _UncheckedCastMLP(MLP):
    """Checks names, shapes and dtype kinds, then casts each tensor to the live dtype
    unchecked: f64 `1 + 2**-40` into f32 is `1.0`."""

    def check_record(self, record: Any) -> None:
        check_tensor_map(expect_kind(record, self.kind, "model"), self._expected(), "model", keep_dtype=False)

    def load_record(self, record: Any, device: Any) -> None:
        item = expect_kind(record, self.kind, "model")
        for k, t in check_tensor_map(item, self._expected(), "model", keep_dtype=False).items():
            self.params[k][...] = t.array.astype(self.params[k].dtype)


def _any_cpu(self: Any, spec: Any) -> str:
    """Checks the device kind, not the index: accepts "cpu:7"."""
    if spec is None or (isinstance(spec, str) and spec.partition(":")[0] == "cpu"):
        return "cpu"
    raise ValueError(f"not a cpu device: {spec!r}")


class Mutant(NumpyWorkload):
    """The numpy reference workload with some classes replaced by broken ones."""

    def __init__(self, name: str, model: type | None = None, optimizer: type | None = None,
                 scheduler: type | None = None) -> None:
        self.name, self.classes = name, (model, optimizer, scheduler)

    def build(self, seed: int) -> Any:
        parts = super().build(seed)
        for obj, cls in zip((parts.model, parts.optimizer, parts.scheduler), self.classes):
            if cls is not None:
                obj.__class__ = cls
        return parts


# -- broken variants of the minigrad adapter ------------------------------------------------


class _GradsDroppingModule(MiniModule):
    """Records the parameters, not the gradients pending in their `.grad`."""

    def into_record(self) -> StateRecord:
        rec = super().into_record()
        return StateRecord(self.kind, {**rec.item, "grads": {}})


class _ViewCastBackend(MiniBackend):
    """`cast` to a tensor's own dtype returns a new tensor over the same buffer (a lazy
    framework's view): the accumulator, given it as a new tensor, keeps the caller's buffer."""

    def cast(self, tensor: Any, dtype: DType) -> Any:
        return minigrad.Tensor.wrap(tensor.data) if tensor.dtype == dtype.numpy else super().cast(tensor, dtype)


class _SameCloneBackend(MiniBackend):
    """`clone` returns the tensor itself; `add` (not in place) never shows it."""

    def clone(self, tensor: Any) -> Any:
        return tensor


class MiniMutant(MiniWorkload):
    """The minigrad workload with its model binding or backend replaced by a broken one."""

    def __init__(self, name: str, model: type | None = None, backend: type | None = None) -> None:
        self.name, self.model_class, self.backend_class = name, model, backend

    def build(self, seed: int) -> Parts:
        parts = super().build(seed)
        cls = self.model_class or MiniModule
        if self.backend_class is not None:
            cls = type("BrokenBackendModule", (cls,), {"backend": self.backend_class()})
        parts.model.__class__ = cls
        return parts


class _SharedGlobalRng(MiniWorkload):
    """Draws from minigrad's global RNG as it is, not from one kept per run: runs side by
    side in one process draw from each other's stream."""

    name = "minigrad-global-rng"

    def micro_step(self, parts: Parts) -> None:
        net = parts.model.net
        x = minigrad.randn(6, 8).data
        loss = minigrad.mlp_backward([net.l1, net.l2], x, np.tanh(x[:, :3]), dropout=0.2)
        parts.accumulator.accumulate(parts.model, take_grads(parts.model))
        parts.state.losses.append(loss)

    def before_capture(self, parts: Parts) -> None:
        gen = np.random.Generator(np.random.PCG64())
        gen.bit_generator.state = minigrad.rng_state()
        parts.state.rng = RngRecord.capture(gen)

    def after_restore(self, parts: Parts) -> None:
        gen = np.random.Generator(np.random.PCG64())
        parts.state.rng.apply(gen)
        minigrad.set_rng_state(gen.bit_generator.state)


class _UnrecordedRng(MiniWorkload):
    """Keeps an RNG per run but records none of it."""

    name = "minigrad-unrecorded-rng"

    def before_capture(self, parts: Parts) -> None:
        pass

    def after_restore(self, parts: Parts) -> None:
        pass


class _CheckSetsCount(LinearWarmupCosineLr):
    """`check_record` takes the record's position before checking the rest."""

    def check_record(self, record: Any) -> None:
        item = record.item
        if isinstance(item, dict) and isinstance(item.get("count"), int):
            self.count = item["count"]
        super().check_record(record)


def _add_many_keeping_grad(self: Any, pending: list[Any], grads: list[Any], dtype: Any) -> list[Any]:
    """The accumulator's per-pair sums, except that where nothing is pending and no cast is
    needed it keeps the caller's gradient itself."""
    out = []
    for p, g in zip(pending, grads):
        if p is None:
            out.append(g if dtype is None or self.dtype_of(g) is dtype else self.cast(g, dtype))
        else:
            target = dtype or self.dtype_of(p)
            out.append(self.add(self.cast(p, target), self.cast(g, target)))
    return out


class _ListedMLP(MLP):
    """Records its tensors as a list of {name, value}: keyed by ParamId, and it restores,
    but not in the layout the suite reads (a tensor at a key path ending in its ParamId)."""

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {"tensors": [{"name": k, "value": TensorData.from_array(self.params[k])}
                                                   for k in sorted(self.params)]})

    def _as_map(self, record: Any) -> StateRecord:
        item = expect_kind(record, self.kind, "model")
        entries = item.get("tensors") if isinstance(item, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) and set(e) == {"name", "value"}
                                                    for e in entries):
            raise RecordMismatchError("model record must be {tensors: [{name, value}]}", key="model")
        return StateRecord(self.kind, {str(e["name"]): e["value"] for e in entries})

    def check_record(self, record: Any) -> None:
        super().check_record(self._as_map(record))

    def load_record(self, record: Any, device: Any) -> None:
        super().load_record(self._as_map(record), device)


MUTANTS = {
    "device() accepts an unknown device": (
        Mutant("device", model=_backend(device=lambda self, spec: "cpu")), r"contract: backend\.device: "),
    "to_host returns a view": (
        Mutant("to_host", model=_backend(to_host=lambda self, t: np.asarray(t))), r"contract: backend\.to_host: "),
    "to_host returns Fortran order": (
        Mutant("fortran", model=_backend(to_host=lambda self, t: np.asfortranarray(np.array(t, copy=True)))),
        r"contract: backend\.to_host: returns a C-contiguous"),
    "to_host_async returns a view": (
        Mutant("to_host_async", model=_backend(to_host_async=_view_async)), r"contract: backend\.to_host_async: "),
    "from_host aliases the array": (
        Mutant("from_host", model=_backend(from_host=lambda self, a, d: a)), r"contract: backend\.from_host: "),
    "add writes into grad": (
        Mutant("add", model=_backend(add=_add_into_grad)), r"contract: backend\.add: never writes into grad"),
    "clone returns the same mutable array": (
        Mutant("clone", model=_backend(clone=lambda self, t: t)), r"contract: backend\.clone: "),
    "dtype_of says f32 for everything": (
        Mutant("dtype_of", model=_backend(dtype_of=lambda self, t: DType.F32)), r"contract: backend\.dtype_of: "),
    "param_ids lists a parameter twice": (
        Mutant("param_ids", model=type("M", (MLP,), {"param_ids": lambda self: [*self.params, "layers.0.bias"]})),
        r"contract: model\.param_ids: "),
    "optimizer state keyed by position": (
        Mutant("positional", optimizer=_PositionalAdamW),
        r"contract: optimizer\.(load_record|into_record): a record survives another parameter order"),
    "optimizer state for an unknown ParamId accepted": (
        Mutant("lenient", optimizer=_LenientAdamW),
        r"contract: optimizer\.check_record: .*unknown parameter"),
    "model check_record checks nothing": (
        Mutant("model-check", model=type("M", (MLP,), {"check_record": _no_check})),
        r"contract: model\.check_record: raises RecordMismatchError"),
    "optimizer check_record checks nothing": (
        Mutant("optimizer-check", optimizer=type("O", (AdamW,), {"check_record": _no_check})),
        r"contract: optimizer\.check_record: raises RecordMismatchError"),
    "scheduler check_record checks nothing": (
        Mutant("scheduler-check", scheduler=type("S", (LinearWarmupCosineLr,), {"check_record": _no_check})),
        r"contract: scheduler\.check_record: raises RecordMismatchError"),
    "model check_record writes the record": (
        Mutant("check-mutates", model=type("M", (MLP,), {"check_record": _check_loads})),
        r"contract: model\.check_record: never mutates; checking a record changed model\."),
    "scheduler load_record steps": (
        Mutant("load-steps", scheduler=_SteppingScheduler), r"contract: restore: .*scheduler\.count"),
    "device() checks the kind, not the index (accepts cpu:7)": (
        Mutant("any-cpu", model=_backend(device=_any_cpu)), r"contract: backend\.device: .*'cpu:4096'"),
    "optimizer check_record checks only kind, layout and unknown ParamIds": (
        Mutant("shallow", optimizer=_ShallowAdamW),
        r"contract: optimizer\.check_record: raises RecordMismatchError for a record with "
        r"(state\.layers\.0\.weight\.exp_avg of shape \(1,\)|hyper\.beta1 a str)"),
    "model check_record ignores the dtype kind": (
        Mutant("dtype-kind", model=type("M", (MLP,), {"check_record": _check_shapes_only})),
        r"contract: model\.check_record: .*layers\.0\.weight of another dtype kind"),
    "model load_record casts to the live dtype unchecked": (
        Mutant("unchecked-cast", model=_UncheckedCastMLP),
        r"contract: model\.load_record\.layers\.0\.weight: a restore never changes a value it was not asked "
        r"to: .*accepted and holds np\.float32\(1\.0\)"),
    "model into_record shares live memory": (
        Mutant("shared", model=type("M", (MLP,), {"into_record": _shared_record})),
        r"contract: capture: copies every component .*model\.layers\."),
    # what the suite let through silently before (a stranger's tinygrad adapter)
    "model record drops the gradients pending in .grad": (
        MiniMutant("drops-grad", model=_GradsDroppingModule),
        r"contract: model\.into_record: a module record carries the gradients pending in the framework's own "
        r"gradient slots .*l\d\.\w+ is missing \(dropped\)"),
    "accumulator keeps the caller's buffer (cast returns a view)": (
        MiniMutant("view-cast", backend=_ViewCastBackend),
        r"contract: accumulator\.accumulate: never aliases the caller's gradients \(accumulate\)"),
    "accumulator keeps the caller's array (add_many returns it)": (
        Mutant("add-many", model=_backend(add_many=_add_many_keeping_grad)),
        r"contract: accumulator\.accumulate: never aliases the caller's gradients \(accumulate\)"),
    "clone returns the same tensor, add never writes in place": (
        MiniMutant("same-clone", backend=_SameCloneBackend),
        r"contract: backend\.clone: a clone is independent: writing into the original in place"),
    "scheduler check_record takes the record's position": (
        Mutant("check-sets-count", scheduler=_CheckSetsCount),
        r"contract: scheduler\.check_record: never mutates.*scheduler\.count"),
    "model record nests its tensors in a list": (
        Mutant("listed", model=_ListedMLP),
        r"contract: model\.into_record: holds each parameter as a tensor of its shape at a key path"),
    # failures that point at the cause: an RNG, not the optimizer's keying
    "a framework-global RNG shared by the runs side by side": (
        _SharedGlobalRng(),
        r"contract: state\.rng\.[\w.]+: a run restored from its record trains on bitwise .*the cause is not "
        r"the order: right after the restore, before a micro-step of its own, .*only the caller state's RNG "
        r"differs .*a framework-global RNG be kept per run"),
    "an RNG the record does not hold": (
        _UnrecordedRng(),
        r"contract: \w+\.[\w.]+: a run restored from its record trains on bitwise .*the cause is not the "
        r"order: after micro-step 1 .*usually an RNG"),
}

# a cause the suite must not name for a mutant that breaks something else
NOT_BLAMED = {
    "a framework-global RNG shared by the runs side by side": r"a record survives another parameter order",
    "an RNG the record does not hold": r"a record survives another parameter order",
}


@pytest.mark.parametrize("workload", [NumpyWorkload(), MiniWorkload()], ids=lambda w: w.name)
def test_the_unbroken_adapters_pass_every_check(workload):
    assert len(_checks()) > 50
    assert run_suite(workload) == []


@pytest.mark.parametrize("name", list(MUTANTS))
def test_every_broken_adapter_fails_the_suite(name):
    harness, expected = MUTANTS[name]
    failures = run_suite(harness)
    assert any(kind == "fail" and re.match(expected, message) for _, kind, message in failures), \
        f"{name}: no failure matches {expected!r}; failures: {failures}"
    blamed = [m for _, _, m in failures if name in NOT_BLAMED and re.search(NOT_BLAMED[name], m)]
    assert not blamed, f"{name}: a failure names the wrong cause: {blamed}"
    unnamed = [(check, message) for check, kind, message in failures
               if kind == "fail" and not message.startswith("contract: ")]
    assert not unnamed, f"failure messages must start with 'contract: ': {unnamed}"
