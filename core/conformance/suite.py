"""`AdapterConformance`: the conformance suite, as a pytest test class to subclass.

    from trainrec.conformance import AdapterConformance
    from mypkg.testing import MyHarness

    class TestMyAdapter(AdapterConformance):
        harness = MyHarness()

Every test checks one contract of spec/PROTOCOLS.md or the seed documents, and its
failure message starts with the contract that broke.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from ..accumulator import GradientsAccumulator
from ..demo import checkpoint_path, compare_items, recorders_for, train_until
from ..dtypes import DType, FloatDType
from ..errors import LossyPrecisionError, RecorderError
from ..gradients import GradientsParams, GradientsParamsRecord
from ..items import Item
from ..precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
    first_lossy,
)
from ..protocols import AutodiffBackend, AutodiffModule, LrScheduler, Optimizer, Recorder
from ..recorders import NamedMpkBytesRecorder, read_file
from ..records import StateRecord
from ..registry import adapt, adapt_module
from ..tensor import TensorData
from ..training import TrainingRecord
from .harness import Harness, Parts
from .vectors import check_vectors

__all__ = ["AdapterConformance"]

SETTINGS = [FullPrecisionSettings(), HalfPrecisionSettings(), DoublePrecisionSettings(),
            NativePrecisionSettings()]
CORE_RECORDERS = ["mpk", "gz", "bytes"]
_NATIVE = NativePrecisionSettings()


def _sample(dtype: DType) -> np.ndarray[Any, Any]:
    """Values every precision holds exactly: small non-negative ints and halves."""
    vals = np.arange(12).reshape(3, 4) % 7
    out: np.ndarray[Any, Any] = (
        vals % 2 == 1 if dtype is DType.BOOL else (vals / 2 if dtype.is_float else vals).astype(dtype.numpy)
    )
    return out


def _snapshot(h: Harness, parts: Parts) -> bytes:
    """Every tensor and scalar of the live objects and the caller state, as bytes."""
    h.before_capture(parts)
    rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                 parts.accumulator, parts.state)
    data: bytes = rec.save(NamedMpkBytesRecorder(_NATIVE))
    return data


def _run(h: Harness, parts: Parts, micro_steps: int) -> None:
    train_until(h, parts, parts.state.micro + micro_steps, h.window)


def _save(recorder: Recorder, record: Any, tmp: Path) -> Any:
    if isinstance(recorder, NamedMpkBytesRecorder):
        return recorder.record(record, None)
    return recorder.record(record, tmp / "payload")


class AdapterConformance:
    """Subclass with `harness = YourHarness()`; pytest runs every test for it."""

    harness: ClassVar[Harness]
    continuation_cache: ClassVar[dict[str, Any]]

    # -- fixtures --------------------------------------------------------------------------

    @pytest.fixture
    def h(self) -> Harness:
        return self.harness

    @pytest.fixture
    def parts(self, h: Harness) -> Parts:
        """A run in the middle of its second accumulation window: optimizer state exists
        and gradients are pending."""
        parts = h.build(0)
        _run(h, parts, h.window + 2)
        return parts

    # -- protocols and resolution ----------------------------------------------------------

    def test_protocol_objects(self, h: Harness, parts: Parts) -> None:
        m = adapt(parts.model)
        assert isinstance(m, AutodiffModule), "contract: the model must adapt to an AutodiffModule"
        assert isinstance(m.backend, AutodiffBackend), "contract: module.backend is an AutodiffBackend"
        assert isinstance(adapt(parts.optimizer), Optimizer), "contract: the optimizer adapts to Optimizer"
        if parts.scheduler is not None:
            assert isinstance(adapt(parts.scheduler), LrScheduler), \
                "contract: the scheduler adapts to LrScheduler"
        ids = list(m.param_ids())
        assert ids == list(m.param_shapes()) and len(set(ids)) == len(ids), \
            "contract: param_ids() are unique and ordered as param_shapes()"

    def test_adapt_resolves_native_types(self, h: Harness, parts: Parts) -> None:
        for obj in h.native_objects(parts):
            try:
                adapt(obj)
            except TypeError as e:
                pytest.fail(f"contract: trainrec.adapt must resolve {type(obj).__qualname__}: {e}")
        t = h.tensor(parts, np.zeros(2, np.float32))
        assert adapt(t) is not None and adapt(type(t)) is not None, \
            "contract: trainrec.adapt resolves the backend's tensors and tensor type"

    # -- record round trips ----------------------------------------------------------------

    @pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.name)
    @pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
    def test_record_roundtrip(self, h: Harness, parts: Parts, dtype: DType, settings: Any,
                              tmp_path: Path) -> None:
        if dtype not in h.dtypes:
            pytest.skip(f"{h.name} does not support {dtype.value}")
        backend = self.harness.backend(parts)
        device = backend.device(h.device)
        t = h.tensor(parts, _sample(dtype))
        assert backend.dtype_of(t) is dtype, f"contract: dtype_of gives {dtype.value}"
        host = backend.to_host(t)
        for name, recorder in self._recorders(settings).items():
            record = StateRecord("t", {"t": TensorData.from_array(host, copy=False)})
            payload = _save(recorder, record, tmp_path)
            back = recorder.load(payload, device, StateRecord)
            loaded = back.item["t"]
            assert loaded.dtype is dtype, \
                f"contract: {name} with {settings.name} precision loads a {dtype.value} tensor as " \
                f"{loaded.dtype.value} (settings choose only the storage dtype)"
            # as a restore does: back into the live tensor's dtype, on the given device
            placed = backend.from_host(loaded.array.astype(dtype.numpy), device)
            assert backend.device_of(placed) == device, "contract: from_host places on the given device"
            np.testing.assert_array_equal(
                backend.to_host(placed).astype(np.float64), _sample(dtype).astype(np.float64),
                err_msg=f"contract: {name} round trip keeps the values")

    def _recorders(self, settings: Any) -> dict[str, Recorder]:
        out: dict[str, Recorder] = {}
        for name, rec in recorders_for(self.harness).items():  # type: ignore[arg-type]
            base = name.split("-")[0]
            if base in CORE_RECORDERS or name in self.harness.recorders:
                out.setdefault(base, type(rec)(settings))  # type: ignore[call-arg]
        return out

    # -- GradientsAccumulator sentences ----------------------------------------------------

    def test_try_to_record_snapshots_without_resetting(self, h: Harness, parts: Parts) -> None:
        acc = parts.accumulator
        snap = acc.try_to_record()
        assert snap.grads, "the harness fixture leaves gradients pending"
        before = {k: t.to_bytes() for k, t in snap.grads.items()}
        h.micro_step(parts)
        assert {k: t.to_bytes() for k, t in snap.grads.items()} == before, \
            "contract: a snapshot is a copy; accumulating later does not change it"
        assert not acc.grads().is_empty(), \
            "contract: try_to_record does not reset the accumulation window"

    def test_to_record_async_equals_try_to_record(self, parts: Parts) -> None:
        sync = parts.accumulator.try_to_record()
        asyn = asyncio.run(parts.accumulator.to_record_async())
        assert sync.grads.keys() == asyn.grads.keys() and all(
            sync.grads[k].bitwise_equal(asyn.grads[k]) for k in sync.grads), \
            "contract: to_record_async gives the same contents as try_to_record"
        assert parts.accumulator.pending_ids(), "contract: to_record_async does not reset"

    def test_grads_returns_the_sum_and_resets(self, parts: Parts) -> None:
        expected = parts.accumulator.try_to_record()
        g = parts.accumulator.grads()
        backend = adapt_module(parts.model).backend
        assert {k: backend.to_host(v).tobytes() for k, v in g.items()} == \
            {k: t.to_bytes() for k, t in expected.grads.items()}, "contract: grads() returns the sum"
        assert parts.accumulator.grads().is_empty(), "contract: grads() resets the accumulator"

    def test_load_record_replaces_pending_on_the_device(self, h: Harness, parts: Parts) -> None:
        rec = parts.accumulator.try_to_record()
        fresh: GradientsAccumulator[Any] = GradientsAccumulator(backend=adapt_module(parts.model).backend)
        fresh.load_record(rec, h.device)
        backend = adapt_module(parts.model).backend
        g = fresh.grads()
        assert set(g) == set(rec.grads), "contract: load_record replaces the pending set"
        for k, v in g.items():
            assert backend.device_of(v) == backend.device(h.device), \
                "contract: load_record places gradients on the given device"
            assert backend.to_host(v).tobytes() == rec.grads[k].to_bytes()

    def test_a_rejected_record_leaves_the_accumulator_unchanged(self, parts: Parts) -> None:
        acc = parts.accumulator
        before = {k: t.to_bytes() for k, t in acc.try_to_record().grads.items()}
        bad = dict(acc.try_to_record().grads)
        first = next(iter(bad))
        bad[first] = TensorData.from_array(np.zeros(3, np.int32))  # not a float
        with pytest.raises(RecorderError):
            acc.load_record(GradientsParamsRecord(bad), self.harness.device)
        with pytest.raises(RecorderError):
            acc.load_record({"not": "a record"}, self.harness.device)  # type: ignore[arg-type]
        assert {k: t.to_bytes() for k, t in acc.try_to_record().grads.items()} == before, \
            "contract: a rejected record leaves the accumulator unchanged"

    def test_f32_accumulation_retains_small_half_precision_additions(self, h: Harness, parts: Parts) -> None:
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
        assert f32.dtype is DType.F32, "contract: accumulate_with_dtype keeps pending in the given dtype"
        assert float(f32.array.reshape(-1)[0]) > float(f16.array.reshape(-1)[0]), \
            "contract: f32 accumulation retains additions that f16 accumulation loses"
        r = NamedMpkBytesRecorder(FullPrecisionSettings())
        back = r.load(r.record(wide.try_to_record(), None), None, GradientsParamsRecord)
        assert back.grads[pid].dtype is DType.F32, "contract: checkpoints preserve the pending dtype"

    # -- TrainingRecord sentences ----------------------------------------------------------

    def test_capture_copies_and_consumes_nothing(self, h: Harness, parts: Parts) -> None:
        pending = parts.accumulator.pending_ids()
        record = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                        parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(_NATIVE)
        first = record.save(r)
        assert parts.accumulator.pending_ids() == pending, "contract: capture clears no gradients"
        _run(h, parts, h.window)
        assert record.save(r) == first, "contract: capture copies; later training does not change it"

    def test_capture_async_equals_capture(self, h: Harness, parts: Parts) -> None:
        h.before_capture(parts)
        args = (parts.model, parts.optimizer, parts.scheduler, parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(_NATIVE)
        assert TrainingRecord.capture(*args).save(r) == \
            asyncio.run(TrainingRecord.capture_async(*args)).save(r), \
            "contract: capture_async records the same as capture"

    def test_restore_is_exact_and_performs_no_step(self, h: Harness, parts: Parts) -> None:
        expected = _snapshot(h, parts)
        r = NamedMpkBytesRecorder(_NATIVE)
        record = TrainingRecord.load(r, expected, h.device, state_type=h.state_type)
        fresh = h.build(1)
        restored = record.restore(fresh.model, fresh.optimizer, fresh.scheduler, h.device)
        fresh.accumulator, fresh.state = restored.accumulator, restored.state
        h.after_restore(fresh)
        assert _snapshot(h, fresh) == expected, \
            "contract: restore reproduces every component exactly, with no optimizer step, " \
            "scheduler step or gradient reset"

    @pytest.mark.parametrize("damage", ["missing parameter", "wrong shape", "optimizer kind",
                                        "pending gradient for an unknown parameter"])
    def test_a_rejected_restore_changes_nothing(self, h: Harness, parts: Parts, damage: str) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        item = rec.into_item(_NATIVE)
        assert isinstance(item, list)
        model_i, optimizer_i, grads_i = item[0], item[1], item[3]
        assert isinstance(model_i, dict) and isinstance(optimizer_i, dict) and isinstance(grads_i, dict)
        tensors = _tensor_map(model_i["state"])
        first = next(iter(tensors))
        if damage == "missing parameter":
            del tensors[first]
        elif damage == "wrong shape":
            tensors[first] = TensorData.from_array(np.zeros((7, 3, 5), np.float32))
        elif damage == "optimizer kind":
            optimizer_i["kind"] = "not.the.same.optimizer"
        else:
            grads_i["no.such.param"] = next(iter(grads_i.values()))
        bad = TrainingRecord.from_item(item, h.device, h.state_type)
        target = h.build(1)
        _run(h, target, h.window + 1)
        before = _snapshot(h, target)
        with pytest.raises(RecorderError):
            bad.restore(target.model, target.optimizer, target.scheduler, h.device)
        assert _snapshot(h, target) == before, \
            f"contract: a restore rejected for a {damage} leaves model, optimizer and scheduler unchanged"

    def test_save_refuses_lossy_precision(self, h: Harness, parts: Parts, tmp_path: Path) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        r = NamedMpkBytesRecorder(HalfPrecisionSettings())
        if first_lossy(rec.into_item(_NATIVE), r.settings) is None:
            pytest.skip("every value of this harness fits in half precision")
        with pytest.raises(LossyPrecisionError):
            rec.save(r)

    def test_corrupt_payloads_raise_recorder_errors(self, h: Harness, parts: Parts, tmp_path: Path) -> None:
        h.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                     parts.accumulator, parts.state)
        for name, recorder in recorders_for(h).items():  # type: ignore[arg-type]
            payload = _save(recorder, rec, tmp_path)
            data = payload if isinstance(payload, bytes) else Path(payload).read_bytes()
            for cut in (0, 1, len(data) // 3, len(data) - 1):
                damaged = data[:cut]
                target: Any = damaged if isinstance(payload, bytes) else _write(tmp_path, damaged)
                with pytest.raises(RecorderError):
                    TrainingRecord.load(recorder, target, h.device, state_type=h.state_type)
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0x40
            target = bytes(flipped) if isinstance(payload, bytes) else _write(tmp_path, bytes(flipped))
            try:
                TrainingRecord.load(recorder, target, h.device, state_type=h.state_type)
            except RecorderError:
                pass
            except Exception as e:  # noqa: BLE001 - the contract is about the type
                pytest.fail(f"contract: {name} must raise RecorderError for a damaged payload, "
                            f"not {type(e).__name__}: {e}")

    # -- exact continuation in a fresh process ---------------------------------------------

    @pytest.mark.parametrize("position", range(4))
    def test_exact_continuation_in_a_fresh_process(self, h: Harness, position: int,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
        if position >= h.window:
            pytest.skip("position beyond the harness's window")
        if not h.ref:
            pytest.fail("contract: a harness needs `ref` ('module:attr') to run in a fresh process")
        cache = type(self).__dict__.get("continuation_cache")
        if cache is None:
            cache = {}
            type(self).continuation_cache = cache
        if "results" not in cache:
            cache["results"] = _continuation(h, tmp_path_factory.mktemp(h.name))
        reference, resumed, dropped = cache["results"]
        exact, diff, paths = compare_items(reference, resumed[position])
        assert exact, (f"contract: resuming at micro-step {position} of the window in a fresh "
                       f"process is bitwise identical; differs at {paths[:5]} (max {diff})")
        if position == h.window // 2:
            assert not compare_items(reference, dropped)[0], \
                "the comparison must detect a resume that drops the pending gradients"

    # -- spec test vectors -----------------------------------------------------------------

    def test_spec_vectors_load_bit_exactly(self) -> None:
        problems = check_vectors(core_only=True)
        assert not problems, "contract: the spec test vectors load bit-exactly: " + "; ".join(problems)


def _tensor_map(state: Item) -> dict[str, Item]:
    """The map of the model's named tensors inside a component record's state."""
    assert isinstance(state, dict)
    tensors = state.get("tensors")
    return tensors if isinstance(tensors, dict) else state


def _write(tmp: Path, data: bytes) -> Path:
    path = tmp / "damaged"
    path.write_bytes(data)
    return path


def _continuation(h: Harness, tmp: Path) -> tuple[Item, dict[int, Item], Item]:
    steps = 3 * h.window
    base = [sys.executable, "-m", "trainrec.demo"]
    common = ["--backend", h.ref, "--steps", str(steps), "--window", str(h.window)]
    ats = [h.window + p for p in range(h.window)]

    def run(args: list[str]) -> None:
        out = subprocess.run(base + args + common, capture_output=True, text=True)
        if out.returncode:
            raise AssertionError(f"{' '.join(args[:1])} failed in a fresh process:\n{out.stderr}")

    run(["reference", "--out", str(tmp / "ref.mpk")])
    run(["checkpoint", "--at", *map(str, ats), "--recorder", "mpk", "bytes",
         "--checkpoint", str(tmp / "ckpt")])
    resumed: dict[int, Item] = {}
    for p, at in enumerate(ats):
        rec = "mpk" if p % 2 == 0 else "bytes"
        run(["resume", "--recorder", rec, "--checkpoint", str(checkpoint_path(tmp / "ckpt", at, rec)),
             "--out", str(tmp / f"res{p}.mpk")])
        resumed[p] = read_file(tmp / f"res{p}.mpk")[1]
    mid = h.window + h.window // 2
    run(["resume", "--drop-pending", "--checkpoint", str(checkpoint_path(tmp / "ckpt", mid, "mpk")),
         "--out", str(tmp / "drop.mpk")])
    return read_file(tmp / "ref.mpk")[1], resumed, read_file(tmp / "drop.mpk")[1]

