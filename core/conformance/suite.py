"""`AdapterConformance`: the conformance suite, as a pytest test class to subclass.

    from trainrec.conformance import AdapterConformance
    from mypkg.testing import MyWorkload

    class TestMyAdapter(AdapterConformance):
        workload = MyWorkload()

Every test checks one contract of spec/PROTOCOLS.md, spec/ADAPTERS.md or the seed
documents. Its failure message starts with `contract:`, then the component and key that
broke it (`backend.to_host`, `optimizer.check_record`, `model.layers.0.weight`), then the
sentence.

The module is one idea, the test class an adapter author subclasses (its tests share the
class's fixtures and helpers, so they stay together, which makes it longer than most);
how a failure is worded is `contract.py`'s, where the suite finds and edits parameters in
a record `record_edits.py`'s, the gradient tests' diagnosis `diagnosis.py`'s.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from ..errors import LossyPrecisionError, RecorderError, RecordMismatchError
from ..items.dtypes import DType, FloatDType
from ..items.tensor import TensorData
from ..items.tree import compare_items
from ..precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
    first_lossy,
)
from ..recorders.namedmpk import NamedMpkBytesRecorder
from ..training.accumulator import GradientsAccumulator
from ..training.gradients import GradientsParams, GradientsParamsRecord
from ..training.protocols import AutodiffBackend, AutodiffModule, LrScheduler, Optimizer, Recorder
from ..training.record import TrainingRecord
from ..training.records import StateRecord
from ..training.registry import adapt, adapt_module
from ..workload.loop import Workload, recorders_for
from .contract import _NATIVE, _broken, _differs, _expect, _rejects, _rng_note, _rng_paths, _where
from .diagnosis import _first_divergence, _overwrites, _pattern, _same_arrays, _when, _write
from .harness import Parts, continuation, midway, run, snapshot
from .record_edits import _at, _copy, _edited, _located, _replace_first, _with_unknown_param
from .vectors import check_vectors

__all__ = ["AdapterConformance"]

SETTINGS = [FullPrecisionSettings(), HalfPrecisionSettings(), DoublePrecisionSettings(),
            NativePrecisionSettings()]
CORE_RECORDERS = ["mpk", "gz", "bytes"]


def _sample(dtype: DType) -> np.ndarray[Any, Any]:
    """Values every precision holds exactly: small non-negative ints and halves."""
    vals = np.arange(12).reshape(3, 4) % 7
    out: np.ndarray[Any, Any] = (
        vals % 2 == 1 if dtype is DType.BOOL else (vals / 2 if dtype.is_float else vals).astype(dtype.numpy)
    )
    return out


def _save(recorder: Recorder, record: Any, tmp: Path) -> Any:
    if isinstance(recorder, NamedMpkBytesRecorder):
        return recorder.record(record, None)
    return recorder.record(record, tmp / "payload")


class AdapterConformance:
    """Subclass with `workload = YourWorkload()`; pytest runs every test for it."""

    workload: ClassVar[Workload]
    continuation_cache: ClassVar[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "harness" in cls.__dict__ and "workload" not in cls.__dict__:
            cls.workload = cls.__dict__["harness"]  # the attribute's former name

    # -- fixtures --------------------------------------------------------------------------

    @pytest.fixture
    def h(self) -> Workload:
        return self.workload

    @pytest.fixture
    def parts(self, h: Workload) -> Parts:
        """A run in the middle of its second accumulation window: optimizer state exists
        and gradients are pending."""
        return midway(h)

    # -- protocols and resolution ----------------------------------------------------------

    def test_protocol_objects(self, h: Workload, parts: Parts) -> None:
        m = adapt(parts.model)
        _expect(isinstance(m, AutodiffModule), "model", "adapts to an AutodiffModule")
        _expect(isinstance(m.backend, AutodiffBackend), "model.backend", "is an AutodiffBackend")
        _expect(isinstance(adapt(parts.optimizer), Optimizer), "optimizer", "adapts to Optimizer")
        if parts.scheduler is not None:
            _expect(isinstance(adapt(parts.scheduler), LrScheduler), "scheduler", "adapts to LrScheduler")
        ids = list(m.param_ids())
        _expect(ids == list(m.param_shapes()) and len(set(ids)) == len(ids), "model.param_ids",
                "are unique and ordered as param_shapes()")

    def test_adapt_resolves_native_types(self, h: Workload, parts: Parts) -> None:
        for obj in h.native_objects(parts):
            try:
                adapt(obj)
            except TypeError as e:
                raise _broken(f"adapt.{type(obj).__qualname__}", f"trainrec.adapt resolves it: {e}") from e
        t = h.tensor(parts, np.zeros(2, np.float32))
        _expect(adapt(t) is not None and adapt(type(t)) is not None, f"adapt.{type(t).__qualname__}",
                "trainrec.adapt resolves the backend's tensors and tensor type")

    # -- backend sentences (spec/ADAPTERS.md section 1) -------------------------------------

    def test_device_rejects_devices_the_backend_does_not_have(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        # an index no machine has, of the kinds backends name: a backend that checks only
        # the kind ("cpu:<anything>") accepts devices it does not have
        for spec in ("trainrec-no-such-device:7", object(), "cpu:4096", "gpu:4096", "cuda:4096"):
            _rejects(partial(backend.device, spec), "backend.device",
                     f"raises ValueError for a device it does not have ({spec!r})", ValueError)

    def test_to_host_returns_a_new_c_contiguous_array(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        sample = _sample(DType.F32)
        t = h.tensor(parts, sample)
        for name, host in (("to_host", backend.to_host(t)),
                           ("to_host_async", asyncio.run(backend.to_host_async(t)))):
            _expect(isinstance(host, np.ndarray) and host.flags.c_contiguous, f"backend.{name}",
                    "returns a C-contiguous numpy array")
            _expect(host.flags.writeable, f"backend.{name}",
                    "returns a new array: a read-only one is a view of live memory")
            host[...] = 5.0
            _expect(np.array_equal(backend.to_host(t), sample), f"backend.{name}",
                    "returns a new array, never a view: writing into it changed the tensor")

    def test_from_host_does_not_alias_the_array(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        array = _sample(DType.F32)
        t = backend.from_host(array, backend.device(h.device))
        array[...] = 5.0
        _expect(np.array_equal(backend.to_host(t), _sample(DType.F32)), "backend.from_host",
                "returns a new tensor that does not alias the array")

    def test_add_returns_the_sum_and_never_writes_into_grad(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        ones = np.ones((3, 4), np.float32)
        pending, grad = h.tensor(parts, ones), h.tensor(parts, 2 * ones)
        out = backend.add(pending, grad)
        _expect(np.array_equal(backend.to_host(grad), 2 * ones), "backend.add", "never writes into grad")
        _expect(np.array_equal(backend.to_host(out), 3 * ones) and backend.dtype_of(out) is DType.F32,
                "backend.add", "returns pending + grad in pending's dtype")

    def test_clone_is_independent(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        t = h.tensor(parts, _sample(DType.F32))
        backend.add(backend.clone(t), h.tensor(parts, np.ones((3, 4), np.float32)))
        _expect(np.array_equal(backend.to_host(t), _sample(DType.F32)), "backend.clone",
                "a clone is independent: adding into it changed the original")
        # whatever `add` does (it need not write into its first argument): write into the
        # original in place, as a compiled step reusing its buffers or a zeroed .grad does
        clone = backend.clone(t)
        if _overwrites(h, parts, t, np.full((3, 4), 5.0, np.float32)):
            _expect(np.array_equal(backend.to_host(clone), _sample(DType.F32)), "backend.clone",
                    "a clone is independent: writing into the original in place changed the clone "
                    "(a clone of a mutable tensor is a copy, never the tensor itself or a view)")

    # -- record round trips ----------------------------------------------------------------

    @pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.name)
    @pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
    def test_record_roundtrip(self, h: Workload, parts: Parts, dtype: DType, settings: Any,
                              tmp_path: Path) -> None:
        if dtype not in h.dtypes:
            pytest.skip(f"{h.name} does not support {dtype.value}")
        backend = self.workload.backend(parts)
        device = backend.device(h.device)
        t = h.tensor(parts, _sample(dtype))
        _expect(backend.dtype_of(t) is dtype, "backend.dtype_of", f"gives {dtype.value} for a {dtype.value} tensor")
        host = backend.to_host(t)
        for name, recorder in self._recorders(settings).items():
            record = StateRecord("t", {"t": TensorData.from_array(host, copy=False)})
            payload = _save(recorder, record, tmp_path)
            back = recorder.load(payload, device, StateRecord)
            loaded = back.item["t"]
            _expect(loaded.dtype is dtype, f"recorder {name}.t",
                    f"with {settings.name} precision loads a {dtype.value} tensor as "
                    f"{loaded.dtype.value} (settings choose only the storage dtype)")
            # as a restore does: back into the live tensor's dtype, on the given device
            placed = backend.from_host(loaded.array.astype(dtype.numpy), device)
            _expect(backend.device_of(placed) == device, "backend.from_host", "places on the given device")
            _expect(np.array_equal(backend.to_host(placed).astype(np.float64), _sample(dtype).astype(np.float64)),
                    f"recorder {name}.t", f"a {dtype.value} round trip with {settings.name} keeps the values")

    def _recorders(self, settings: Any) -> dict[str, Recorder]:
        out: dict[str, Recorder] = {}
        for name, rec in recorders_for(self.workload).items():
            base = name.split("-")[0]
            if base in CORE_RECORDERS or name in self.workload.recorders:
                out.setdefault(base, type(rec)(settings))  # type: ignore[call-arg]
        return out

    # -- GradientsAccumulator sentences ----------------------------------------------------

    def test_try_to_record_snapshots_without_resetting(self, h: Workload, parts: Parts) -> None:
        acc = parts.accumulator
        snap = acc.try_to_record()
        _expect(bool(snap.grads), "workload.micro_step", "accumulates gradients (the fixture leaves some pending)")
        before = {k: t.to_bytes() for k, t in snap.grads.items()}
        h.micro_step(parts)
        _expect({k: t.to_bytes() for k, t in snap.grads.items()} == before, "accumulator.try_to_record",
                "a snapshot is a copy; accumulating later does not change it")
        _expect(not acc.grads().is_empty(), "accumulator.try_to_record", "does not reset the accumulation window")

    def test_to_record_async_equals_try_to_record(self, parts: Parts) -> None:
        sync = parts.accumulator.try_to_record()
        asyn = asyncio.run(parts.accumulator.to_record_async())
        _expect(sync.grads.keys() == asyn.grads.keys() and all(
            sync.grads[k].bitwise_equal(asyn.grads[k]) for k in sync.grads), "accumulator.to_record_async",
            "gives the same contents as try_to_record")
        _expect(bool(parts.accumulator.pending_ids()), "accumulator.to_record_async", "does not reset")

    def test_grads_returns_the_sum_and_resets(self, parts: Parts) -> None:
        expected = parts.accumulator.try_to_record()
        g = parts.accumulator.grads()
        backend = adapt_module(parts.model).backend
        _expect({k: backend.to_host(v).tobytes() for k, v in g.items()} ==
                {k: t.to_bytes() for k, t in expected.grads.items()}, "accumulator.grads", "returns the sum")
        _expect(parts.accumulator.grads().is_empty(), "accumulator.grads", "resets the accumulator")

    def test_load_record_replaces_pending_on_the_device(self, h: Workload, parts: Parts) -> None:
        rec = parts.accumulator.try_to_record()
        fresh: GradientsAccumulator[Any] = GradientsAccumulator(backend=adapt_module(parts.model).backend)
        fresh.load_record(rec, h.device)
        backend = adapt_module(parts.model).backend
        g = fresh.grads()
        _expect(set(g) == set(rec.grads), "accumulator.load_record", "replaces the pending set")
        for k, v in g.items():
            _expect(backend.device_of(v) == backend.device(h.device), f"accumulator.load_record.{k}",
                    "places gradients on the given device")
            _expect(backend.to_host(v).tobytes() == rec.grads[k].to_bytes(), f"accumulator.load_record.{k}",
                    "restores each pending gradient's bytes")

    def test_a_rejected_record_leaves_the_accumulator_unchanged(self, parts: Parts) -> None:
        acc = parts.accumulator
        before = {k: t.to_bytes() for k, t in acc.try_to_record().grads.items()}
        bad = dict(acc.try_to_record().grads)
        first = next(iter(bad))
        bad[first] = TensorData.from_array(np.zeros(3, np.int32))  # not a float
        _rejects(lambda: acc.load_record(GradientsParamsRecord(bad), self.workload.device),
                 f"accumulator.load_record.{first}", "raises RecorderError for an int gradient")
        _rejects(lambda: acc.load_record({"not": "a record"}, self.workload.device),  # type: ignore[arg-type]
                 "accumulator.load_record", "raises RecorderError for what is not a record")
        _expect({k: t.to_bytes() for k, t in acc.try_to_record().grads.items()} == before,
                "accumulator.load_record", "a rejected record leaves the accumulator unchanged")

    def test_f32_accumulation_retains_small_half_precision_additions(self, h: Workload, parts: Parts) -> None:
        if DType.F16 not in h.dtypes:
            pytest.skip("needs f16")
        m = adapt_module(parts.model)
        pid, shape = next(iter(m.param_shapes().items()))
        plain: GradientsAccumulator[Any] = GradientsAccumulator()
        wide: GradientsAccumulator[Any] = GradientsAccumulator()
        one = h.tensor(parts, np.ones(shape, np.float16))
        tiny = h.tensor(parts, np.full(shape, 1e-4, np.float16))
        plain.accumulate(parts.model, GradientsParams({pid: one}))
        wide.accumulate_with_dtype(parts.model, GradientsParams({pid: one}), FloatDType.F32)
        for _ in range(50):
            plain.accumulate(parts.model, GradientsParams({pid: tiny}))
            wide.accumulate_with_dtype(parts.model, GradientsParams({pid: tiny}), FloatDType.F32)
        f16 = plain.try_to_record().grads[pid]
        f32 = wide.try_to_record().grads[pid]
        _expect(f32.dtype is DType.F32, f"accumulator.accumulate_with_dtype.{pid}",
                "keeps pending in the given dtype")
        _expect(float(f32.array.reshape(-1)[0]) > float(f16.array.reshape(-1)[0]),
                f"accumulator.accumulate_with_dtype.{pid}",
                "f32 accumulation retains additions that f16 accumulation loses")
        r = NamedMpkBytesRecorder(FullPrecisionSettings())
        back = r.load(r.record(wide.try_to_record(), None), None, GradientsParamsRecord)
        _expect(back.grads[pid].dtype is DType.F32, f"grads.{pid}", "checkpoints preserve the pending dtype")

    # -- TrainingRecord sentences ----------------------------------------------------------

    def test_capture_copies_and_consumes_nothing(self, h: Workload, parts: Parts) -> None:
        pending = parts.accumulator.pending_ids()
        record = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                        parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(_NATIVE)
        first = record.save(r)
        _expect(parts.accumulator.pending_ids() == pending, "accumulator", "capture clears no gradients")
        run(h, parts, h.window)
        later = record.save(r)
        _expect(later == first, "capture",
                f"copies every component (into_record copies); later training changed {_differs(first, later)}")

    def test_capture_async_equals_capture(self, h: Workload, parts: Parts) -> None:
        h.before_capture(parts)
        args = (parts.model, parts.optimizer, parts.scheduler, parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(_NATIVE)
        sync = TrainingRecord.capture(*args).save(r)
        asyn = asyncio.run(TrainingRecord.capture_async(*args)).save(r)
        _expect(sync == asyn, "capture_async", f"records the same as capture; differs at {_differs(sync, asyn)}")

    def test_restore_is_exact_and_performs_no_step(self, h: Workload, parts: Parts) -> None:
        expected = snapshot(h, parts)
        r = NamedMpkBytesRecorder(_NATIVE)
        record = TrainingRecord.load(r, expected, h.device, state_type=h.state_type)
        fresh = h.build(1)
        restored = record.restore(fresh.model, fresh.optimizer, fresh.scheduler, h.device)
        fresh.accumulator, fresh.state = restored.accumulator, restored.state
        h.after_restore(fresh)
        got = snapshot(h, fresh)
        _expect(got == expected, "restore", "reproduces every component exactly, with no optimizer step, "
                f"scheduler step or gradient reset; differs at {_differs(expected, got)}")

    @pytest.mark.parametrize("damage", ["missing parameter", "wrong shape", "optimizer kind",
                                        "optimizer state for an unknown parameter", "scheduler kind",
                                        "pending gradient for an unknown parameter"])
    def test_a_rejected_restore_changes_nothing(self, h: Workload, parts: Parts, damage: str) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        item = rec.into_item(_NATIVE)
        assert isinstance(item, list)
        model_i, optimizer_i, scheduler_i, grads_i = item[0], item[1], item[2], item[3]
        assert isinstance(model_i, dict) and isinstance(optimizer_i, dict) and isinstance(grads_i, dict)
        m = adapt_module(parts.model)
        first, where_first = next(iter(_located(model_i["state"], m).items()))
        if damage == "missing parameter":
            model_i["state"] = _edited(model_i["state"], where_first, None)
        elif damage == "wrong shape":
            model_i["state"] = _edited(model_i["state"], where_first,
                                       TensorData.from_array(np.zeros((7, 3, 5), np.float32)))
        elif damage == "optimizer kind":
            optimizer_i["kind"] = "not.the.same.optimizer"
        elif damage == "optimizer state for an unknown parameter":
            if not _with_unknown_param(optimizer_i["state"], m):
                pytest.skip("the optimizer record holds no per-parameter state (no tensor shaped like a parameter)")
        elif damage == "scheduler kind":
            if not isinstance(scheduler_i, dict):
                pytest.skip("the workload has no scheduler")
            scheduler_i["kind"] = "not.the.same.scheduler"
        else:
            grads_i["no.such.param"] = next(iter(grads_i.values()))
        bad = TrainingRecord.from_item(item, h.device, h.state_type)
        # a target at another position than the record (two optimizer and scheduler steps,
        # not one): a check that writes the record into its component shows
        target = h.build(1)
        run(h, target, 2 * h.window + 1)
        before = snapshot(h, target)
        component = damage.split()[0] if damage.startswith(("optimizer", "scheduler")) else \
            "grads" if damage.startswith("pending") else "model"
        _rejects(lambda: bad.restore(target.model, target.optimizer, target.scheduler, h.device),
                 f"{component}.check_record", f"restore raises RecorderError for a {damage}")
        after = snapshot(h, target)
        changed = _differs(before, after)
        _expect(after == before, f"{changed.partition('.')[0]}.check_record",
                f"never mutates: a restore refused for a {damage} (every check runs before any write) "
                f"changed {changed}")

    def test_restore_never_changes_a_value_it_was_not_asked_to(self, h: Workload, parts: Parts) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        item = rec.into_item(_NATIVE)
        assert isinstance(item, list) and isinstance(item[0], dict)
        m = adapt_module(parts.model)
        first, at = next(iter(_located(item[0]["state"], m).items()))
        saved = _at(item[0]["state"], at)
        if saved.dtype not in (DType.F32, DType.F16, DType.BF16):
            pytest.skip(f"{first} is {saved.dtype.value}: no wider float of its kind to record it in")
        # f64, the first element 1 + 2**-40: no narrower float holds it, so a cast to the
        # live dtype changes it
        wide = np.asarray(saved.array).astype(np.float64)
        wide.reshape(-1)[0] = 1 + 2.0 ** -40
        item[0]["state"] = _edited(item[0]["state"], at, TensorData.from_array(wide))
        bad = TrainingRecord.from_item(item, h.device, h.state_type)
        target = h.build(1)
        run(h, target, 2 * h.window + 1)
        before = snapshot(h, target)
        where = f"model.load_record.{first}"
        sentence = (f"a restore never changes a value it was not asked to: a record holding {first} as f64 "
                    f"(a value {saved.dtype.value} cannot hold) restores the value exactly, in the recorded "
                    "dtype, or is refused with a RecordMismatchError before anything is written")
        try:
            restored = bad.restore(target.model, target.optimizer, target.scheduler, h.device)
        except RecordMismatchError:
            after = snapshot(h, target)
            _expect(after == before, where, f"{sentence}; refused, it changed {_differs(before, after)}")
            return
        except Exception as e:  # noqa: BLE001 - the contract is about the type
            raise _broken(where, f"{sentence}; raised {type(e).__name__} instead: {e}") from e
        back = adapt_module(restored.model).into_record().item
        got = np.asarray(_at(back, _located(back, m)[first]).array)
        _expect(np.array_equal(got.astype(np.float64), wide), where,
                f"{sentence}; it was accepted and holds {got.reshape(-1)[0]!r} ({got.dtype}) for "
                f"{wide.reshape(-1)[0]!r}: a cast to the live dtype unchecked (check_tensor_map checks "
                "it, keep_dtype=True)")

    @pytest.mark.parametrize("component", ["model", "optimizer", "scheduler"])
    def test_check_record_rejects_what_does_not_fit_and_never_mutates(
            self, h: Workload, parts: Parts, component: str) -> None:
        m = adapt_module(parts.model)
        live = {"model": m, "optimizer": adapt(parts.optimizer),
                "scheduler": adapt(parts.scheduler) if parts.scheduler is not None else None}[component]
        if live is None:
            pytest.skip("the workload has no scheduler")

        def check(record: Any) -> None:
            if component == "optimizer":
                live.check_record(record, m)
            else:
                live.check_record(record)

        where = f"{component}.check_record"
        # the fitting record comes from a run at another position (two optimizer and scheduler
        # steps, `parts` has taken one), so a check that writes it into the live object shows
        other = h.build(1)
        run(h, other, 2 * h.window + 1)
        h.before_capture(other)
        fits = TrainingRecord.capture(other.model, other.optimizer, other.scheduler, other.accumulator,
                                      other.state)
        fitting: StateRecord = getattr(fits, component)
        before = snapshot(h, parts)
        check(fitting)
        after = snapshot(h, parts)
        _expect(after == before, where, f"never mutates; checking a record changed {_differs(before, after)}")
        damaged: dict[str, StateRecord] = {
            "another kind": StateRecord("not.the.same." + fitting.kind, fitting.item),
            "a map of unknown keys": StateRecord(fitting.kind, {"no_such_key": 1}),
        }
        not_checked: list[str] = []
        if component == "model":
            first, at = next(iter(_located(fitting.item, m).items()))
            saved = _at(fitting.item, at)
            damaged[f"no {first}"] = StateRecord(fitting.kind, _edited(fitting.item, at, None))
            damaged[f"{first} of the wrong shape"] = StateRecord(fitting.kind, _edited(
                fitting.item, at, TensorData.from_array(np.zeros((7, 3, 5), np.float32))))
            kind = DType.I32 if saved.dtype.is_float else DType.F32  # same shape, another kind
            damaged[f"{first} of another dtype kind ({kind.value} for {saved.dtype.value}, same shape)"] = \
                StateRecord(fitting.kind, _edited(fitting.item, at,
                                                  TensorData.from_array(np.zeros(saved.shape, kind.numpy))))
        if component == "optimizer":
            item = _copy(fitting.item)
            if _with_unknown_param(item, m):
                damaged["state for an unknown parameter (no.such.param)"] = StateRecord(fitting.kind, item)
            else:
                not_checked.append("state for an unknown parameter (the record holds no per-parameter state)")
            # a per-parameter buffer must have its parameter's shape; a hyperparameter keeps
            # its type (spec/PROTOCOLS.md, Optimizer)
            shapes = {tuple(s) for s in m.param_shapes().values() if int(np.prod(s)) > 1}
            item, where_t = _replace_first(
                fitting.item, lambda v: isinstance(v, TensorData) and v.shape in shapes,
                lambda v: TensorData.from_array(np.zeros((1,), v.array.dtype)))
            if where_t is not None:
                damaged[f"{where_t} of shape (1,), not its parameter's"] = StateRecord(fitting.kind, item)
            else:
                not_checked.append("a buffer of shape (1,) (no tensor in the record has a parameter's shape)")
            item, where_h = _replace_first(fitting.item, lambda v: type(v) is float, lambda v: str(v))
            if where_h is not None:
                damaged[f"{where_h} a str, not a number"] = StateRecord(fitting.kind, item)
            else:
                not_checked.append("a hyperparameter given as a str (the record holds no float)")
        for what, record in damaged.items():
            _rejects(partial(check, record), where, f"raises RecordMismatchError for a record with {what}",
                     RecordMismatchError)
            after = snapshot(h, parts)
            _expect(after == before, where, f"never mutates; rejecting {what} changed {_differs(before, after)}")
        if not_checked:  # everything else passed: say what could not be checked, and why
            pytest.skip(f"every other record was refused and changed nothing; not checked: {'; '.join(not_checked)}")

    def test_optimizer_record_survives_another_parameter_order(self, h: Workload, parts: Parts) -> None:
        fresh = h.build(1)
        if not h.reorder(fresh):
            pytest.skip(f"{h.name} keeps its parameters in one order")
        ids = list(adapt_module(parts.model).param_ids())
        new_ids = list(adapt_module(fresh.model).param_ids())
        _expect(new_ids != ids and sorted(new_ids) == sorted(ids), "workload.reorder",
                "gives the same parameters in another order")
        h.before_capture(parts)
        record = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler, parts.accumulator,
                                        parts.state)
        # beside the reordered run, one restored in the same order: what differs in both is
        # not the order's doing
        runs = {"reordered": fresh, "same order": h.build(1)}
        for name, target in runs.items():
            try:
                restored = record.restore(target.model, target.optimizer, target.scheduler, h.device)
            except RecorderError as e:
                if name == "reordered":
                    raise _broken("optimizer.load_record", "a record survives another parameter order (keyed "
                                  f"by ParamId, never by position); restoring it raised {e}") from e
                raise _broken("restore", f"restores a record into a freshly built run; raised {e}") from e
            target.accumulator, target.state = restored.accumulator, restored.state
            h.after_restore(target)
        first = _first_divergence(h, parts, runs)
        if "same order" in first:
            step, paths = first["same order"]
            rng = _rng_paths(paths)
            raise _broken(rng[0] if rng else _where(paths[0]),
                          "a run restored from its record trains on bitwise as the original beside it; "
                          "restored in the same parameter order it differs too, so the cause is not the "
                          f"order: {_when(step)} it differs at {', '.join(_where(p) for p in paths[:5])}"
                          + (_rng_note(paths) if rng else
                             ": something that changes training is not in the record, or is shared by the "
                             "runs side by side in one process (usually an RNG: record every RNG the workload "
                             "draws from in before_capture and put it back in after_restore, and keep a "
                             "framework-global RNG per run, spec/ADAPTERS.md section 4)"))
        if "reordered" in first:
            step, paths = first["reordered"]
            raise _broken("optimizer.load_record" if step == 0 else "optimizer.into_record",
                          "a record survives another parameter order (keyed by ParamId, never by "
                          f"position); restored into the reordered model, {_when(step)} the run differs "
                          f"first at {', '.join(_where(p) for p in paths[:5])}{_rng_note(paths)}")

    def test_save_refuses_lossy_precision(self, h: Workload, parts: Parts, tmp_path: Path) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(HalfPrecisionSettings())
        if first_lossy(rec.into_item(_NATIVE), r.settings) is None:
            pytest.skip("every value of this workload fits in half precision")
        _rejects(lambda: rec.save(r), "recorder.record", "a lossy save raises LossyPrecisionError",
                 LossyPrecisionError)

    def test_corrupt_payloads_raise_recorder_errors(self, h: Workload, parts: Parts, tmp_path: Path) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        for name, recorder in recorders_for(h).items():
            payload = _save(recorder, rec, tmp_path)
            data = payload if isinstance(payload, bytes) else Path(payload).read_bytes()
            for cut in (0, 1, len(data) // 3, len(data) - 1):
                damaged = data[:cut]
                target: Any = damaged if isinstance(payload, bytes) else _write(tmp_path, damaged)
                _rejects(partial(TrainingRecord.load, recorder, target, h.device, state_type=h.state_type),
                         f"recorder {name}.load", f"a payload cut at byte {cut} raises RecorderError")
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0x40
            target = bytes(flipped) if isinstance(payload, bytes) else _write(tmp_path, bytes(flipped))
            try:
                TrainingRecord.load(recorder, target, h.device, state_type=h.state_type)
            except RecorderError:
                pass
            except Exception as e:  # noqa: BLE001 - the contract is about the type
                raise _broken(f"recorder {name}.load", "a damaged payload raises RecorderError, "
                              f"not {type(e).__name__}: {e}") from e

    # -- gradients the caller or the framework holds ----------------------------------------

    def test_native_pending_gradients_are_recorded_or_refused(self, h: Workload, parts: Parts) -> None:
        if h.native_grads(parts) is None:
            pytest.skip(f"{h.name}'s workload gives no native_grads: its framework keeps no gradients on "
                        "its tensors (give Workload.native_grads where it does, as torch's .grad)")
        m = adapt_module(parts.model)
        pending = {pid: _pattern(s, 0.125) for pid, s in m.param_shapes().items()}
        h.set_native_grads(parts, pending)
        _expect(_same_arrays(h.native_grads(parts), pending) == [], "workload.set_native_grads",
                "sets the gradients native_grads then reads")
        where = "model.into_record"
        sentence = ("a module record carries the gradients pending in the framework's own gradient slots "
                    "(.grad, which repeated backward() calls add into), or capture refuses them with a "
                    "RecorderError")
        h.before_capture(parts)
        try:
            record = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                            parts.accumulator, parts.state)
        except RecorderError:
            return  # refused, saying so: the contract's other branch
        except Exception as e:  # noqa: BLE001 - the contract is about the type
            raise _broken(where, f"{sentence}; capture raised {type(e).__name__} instead: {e}") from e
        r = NamedMpkBytesRecorder(_NATIVE)
        target = h.build(1)
        run(h, target, 1)
        h.set_native_grads(target, {pid: -v for pid, v in pending.items()})
        TrainingRecord.load(r, record.save(r), h.device, state_type=h.state_type).restore(
            target.model, target.optimizer, target.scheduler, h.device)
        wrong = _same_arrays(h.native_grads(target), pending)
        _expect(not wrong, where, f"{sentence}; restored, the target's {', '.join(wrong[:3])}")
        h.set_native_grads(parts, {})
        none = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler, parts.accumulator,
                                      parts.state)
        none.restore(target.model, target.optimizer, target.scheduler, h.device)
        left = sorted(h.native_grads(target) or {})
        _expect(not left, "model.load_record", "a restore from a record with no native pending gradients "
                f"leaves none pending in the framework's own slots; left {left[:3]}")

    def test_the_accumulator_never_aliases_the_callers_gradients(self, h: Workload, parts: Parts) -> None:
        backend = self.workload.backend(parts)
        if not _overwrites(h, parts, h.tensor(parts, _sample(DType.F32)), np.zeros((3, 4), np.float32)):
            pytest.skip(f"{h.name}'s tensors cannot be written in place (Workload.overwrite gives False): "
                        "holding the caller's own is safe")
        shapes = dict(adapt_module(parts.model).param_shapes())

        def grads(scale: float) -> tuple[dict[str, Any], GradientsParams]:
            values = {pid: _pattern(s, scale) for pid, s in shapes.items()}
            return values, GradientsParams({pid: h.tensor(parts, v) for pid, v in values.items()})

        for how in ("accumulate", "adopt", "accumulate onto pending"):
            acc: GradientsAccumulator[Any] = GradientsAccumulator()
            expected, given = grads(0.5)
            (acc.adopt if how == "adopt" else acc.accumulate)(parts.model, given)
            if how == "accumulate onto pending":
                more, given = grads(0.25)
                acc.accumulate(parts.model, given)
                expected = {pid: expected[pid] + more[pid] for pid in expected}
            for pid, t in given.items():  # the caller's buffers are its own again
                h.overwrite(parts, t, np.full(shapes[pid], -3.0, np.float32))
            held = {pid: t.array for pid, t in acc.try_to_record().grads.items()}
            wrong = _same_arrays(held, expected)
            _expect(not wrong, f"accumulator.{how.split()[0]}", f"never aliases the caller's gradients ({how}): "
                    "the caller writing into its tensors afterwards (a compiled step reusing its output "
                    f"buffers, .grad zeroed in place) changed the pending gradients: {', '.join(wrong[:3])}; the "
                    f"backend ({backend.name}) must give new tensors from cast, clone and add_many")

    # -- exact continuation in a fresh process ---------------------------------------------

    @pytest.mark.parametrize("position", range(4))
    def test_exact_continuation_in_a_fresh_process(self, h: Workload, position: int,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
        if position >= h.window:
            pytest.skip("position beyond the workload's window")
        if not h.ref:
            raise _broken("workload.ref", "a workload needs `ref` ('module:attr') to run in a fresh process")
        cache = type(self).__dict__.get("continuation_cache")
        if cache is None:
            cache = {}
            type(self).continuation_cache = cache
        if "results" not in cache:
            cache["results"] = continuation(h, tmp_path_factory.mktemp(h.name))
        reference, resumed, dropped = cache["results"]
        exact, diff, paths = compare_items(reference, resumed[position])
        _expect(exact, ", ".join(_where(p) for p in paths[:5]), f"resuming at micro-step {position} of the "
                f"window in a fresh process is bitwise identical; differs (max {diff}){_rng_note(paths)}")
        if position == h.window // 2:
            _expect(not compare_items(reference, dropped)[0], "grads",
                    "the comparison detects a resume that drops the pending gradients")

    # -- spec test vectors -----------------------------------------------------------------

    def test_spec_vectors_load_bit_exactly(self) -> None:
        problems = check_vectors(core_only=True)
        _expect(not problems, "spec/vectors", "the golden files load bit-exactly: " + "; ".join(problems))
