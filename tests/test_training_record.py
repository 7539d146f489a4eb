"""Every sentence of seeds/TrainingRecord.txt, on the numpy reference adapter."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

import trainrec
from trainrec import (
    CompactRecorder,
    DefaultRecorder,
    GradientsAccumulator,
    GradientsParamsRecord,
    LossyPrecisionError,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    RngRecord,
    TrainingRecord,
)
from trainrec.adapters.numpy import MLP, SGD, AdamW, CosineAnnealingLr, StepLr


@trainrec.record
class Counters:
    micro: int
    epoch: int
    rng: RngRecord


def run(model, opt, sched, acc, steps, gen, window=3):
    for i in range(steps):
        x = gen.normal(size=(4, 3)).astype(np.float32)
        y = gen.normal(size=(4, 2)).astype(np.float32)
        _, g = model.loss_and_grads(x, y)
        acc.accumulate(model, g)
        if (i + 1) % window == 0:
            opt.step(sched.step(), model, acc.grads())


@pytest.fixture
def live():
    model, opt, sched, acc = MLP([3, 5, 2], seed=1), AdamW(), CosineAnnealingLr(0.05, 7), GradientsAccumulator()
    gen = np.random.default_rng(3)
    run(model, opt, sched, acc, 7, gen)  # 7 micro-steps: 1 gradient pending
    return model, opt, sched, acc, gen


def snapshot(model, opt, sched, acc):
    """Every tensor and scalar of the live objects, copied."""
    return (
        {k: v.copy() for k, v in model.params.items()},
        copy.deepcopy(opt.state),
        copy.deepcopy(opt.hyper),
        (sched.count, dict(sched.config)),
        {k: t.array.copy() for k, t in acc.try_to_record().grads.items()},
    )


def assert_same(a, b):
    pa, sa, ha, sch_a, ga = a
    pb, sb, hb, sch_b, gb = b
    assert pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert sa.keys() == sb.keys()
    for pid in sa:
        assert sa[pid].keys() == sb[pid].keys()
        for name in sa[pid]:
            assert np.array_equal(sa[pid][name], sb[pid][name])
    assert ha == hb and sch_a == sch_b
    assert ga.keys() == gb.keys() and all(np.array_equal(ga[k], gb[k]) for k in ga)


def counters(gen=None):
    return Counters(7, 0, RngRecord.capture(*(g for g in [gen] if g is not None)))


def test_capture_copies_and_consumes_nothing(live):
    model, opt, sched, acc, gen = live
    before = snapshot(model, opt, sched, acc)
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    assert_same(before, snapshot(model, opt, sched, acc))  # nothing consumed or cleared
    saved = rec.save(NamedMpkBytesRecorder(NativePrecisionSettings()))
    run(model, opt, sched, acc, 5, gen)  # later training
    assert rec.save(NamedMpkBytesRecorder(NativePrecisionSettings())) == saved


def test_capture_async_equals_capture(live):
    model, opt, sched, acc, gen = live
    state = counters(gen)
    a = TrainingRecord.capture(model, opt, sched, acc, state)
    b = asyncio.run(TrainingRecord.capture_async(model, opt, sched, acc, state))
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    assert a.save(r) == b.save(r)


@pytest.mark.parametrize(
    "recorder", [DefaultRecorder(), NamedMpkGzFileRecorder(), NamedMpkFileRecorder(NativePrecisionSettings())],
    ids=["default", "gz", "native"],
)
def test_save_writes_one_payload_and_load_restores_everything(live, recorder, tmp_path):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    out = rec.save(recorder, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    back = TrainingRecord.load(recorder, out, "cpu", state_type=Counters)
    assert isinstance(back.state, Counters) and back.state.micro == 7
    m2, o2, s2 = MLP([3, 5, 2], seed=9), AdamW(), CosineAnnealingLr(0.05, 7)
    r = back.restore(m2, o2, s2, "cpu")
    assert r.model is m2 and r.optimizer is o2 and r.scheduler is s2
    assert_same(snapshot(model, opt, sched, acc), snapshot(m2, o2, s2, r.accumulator))


def test_save_refuses_lossy_precision_naming_the_first_tensor(live, tmp_path):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    with pytest.raises(LossyPrecisionError, match=r"model\.state\.layers\.0\.weight") as e:
        rec.save(CompactRecorder(), tmp_path / "c.mpk")
    assert e.value.key == "model.state.layers.0.weight"
    assert not (tmp_path / "c.mpk").exists()
    rec.save(CompactRecorder(), tmp_path / "c.mpk", allow_lossy=True)
    back = TrainingRecord.load(CompactRecorder(), tmp_path / "c.mpk", "cpu", state_type=Counters)
    weight = rec.model.item["layers.0.weight"]
    got = back.model.item["layers.0.weight"]  # stored as f16, back in its saved dtype
    assert got.dtype is weight.dtype
    np.testing.assert_array_equal(got.array, weight.array.astype(np.float16).astype(weight.array.dtype))


def test_load_without_state_type_gives_the_item_tree(live):
    model, opt, sched, acc, gen = live
    r = NamedMpkBytesRecorder()
    data = TrainingRecord.capture(model, opt, sched, acc, counters(gen)).save(r)
    back = TrainingRecord.load(r, data)
    assert back.state["micro"] == 7 and back.state["epoch"] == 0


def test_load_refuses_another_record_type(tmp_path):
    path = DefaultRecorder().record(GradientsParamsRecord({}), tmp_path / "g.mpk")
    with pytest.raises(RecordMismatchError, match="GradientsParamsRecord"):
        TrainingRecord.load(DefaultRecorder(), path, "cpu")


def test_into_item_is_a_5_tuple_and_from_item_inverts_it(live):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    item = rec.into_item(NativePrecisionSettings())
    assert isinstance(item, list) and len(item) == 5
    back = TrainingRecord.from_item(item, "cpu", state_type=Counters)
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    assert back.save(r) == rec.save(r)


def test_restore_performs_no_step_and_no_reset(live):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    expected = snapshot(model, opt, sched, acc)
    m2, o2, s2 = MLP([3, 5, 2], seed=4), AdamW(), CosineAnnealingLr(0.05, 7)
    r = rec.restore(m2, o2, s2, "cpu")
    assert_same(expected, snapshot(m2, o2, s2, r.accumulator))
    assert s2.count == sched.count  # no scheduler step
    assert {p: s["step"] for p, s in o2.state.items()} == {p: s["step"] for p, s in opt.state.items()}
    assert len(r.accumulator.pending_ids()) == len(model.params)  # no gradient reset
    assert s2.step() == sched.step()  # the next learning rate is the same


def _mismatches():
    return {
        "model shape": lambda: (MLP([3, 6, 2]), AdamW(), CosineAnnealingLr(0.05, 7)),
        "model extra ParamId": lambda: (MLP([3, 5, 2, 2]), AdamW(), CosineAnnealingLr(0.05, 7)),
        "model dtype kind": lambda: (_int_mlp(), AdamW(), CosineAnnealingLr(0.05, 7)),
        "optimizer kind": lambda: (MLP([3, 5, 2]), SGD(momentum=0.9), CosineAnnealingLr(0.05, 7)),
        "optimizer hyper": lambda: (MLP([3, 5, 2]), _adamw_extra(), CosineAnnealingLr(0.05, 7)),
        "scheduler kind": lambda: (MLP([3, 5, 2]), AdamW(), StepLr(0.1, 2)),
        "scheduler missing": lambda: (MLP([3, 5, 2]), AdamW(), None),
    }


def _int_mlp():
    m = MLP([3, 5, 2])
    m.params["layers.0.bias"] = m.params["layers.0.bias"].astype(np.int32)
    return m


def _adamw_extra():
    o = AdamW()
    o.hyper["amsgrad"] = False
    return o


@pytest.mark.parametrize("case", list(_mismatches()))
def test_restore_checks_everything_first_and_changes_nothing_on_error(live, case):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    m2, o2, s2 = _mismatches()[case]()
    # give the targets some state of their own, which must survive the failed restore
    acc2 = GradientsAccumulator()
    run(m2, o2, s2 or CosineAnnealingLr(0.1, 3), acc2, 3, np.random.default_rng(0)) if case != "model dtype kind" else None
    before = snapshot(m2, o2, s2 or CosineAnnealingLr(0.1, 3), acc2)
    with pytest.raises(RecordMismatchError) as e:
        rec.restore(m2, o2, s2, "cpu")
    assert str(e.value)
    assert_same(before, snapshot(m2, o2, s2 or CosineAnnealingLr(0.1, 3), acc2))


def test_restore_rejects_pending_gradients_for_unknown_parameters_unchanged(live):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    grads = dict(rec.grads.grads)
    grads["layers.9.weight"] = next(iter(grads.values()))
    bad = TrainingRecord(rec.model, rec.optimizer, rec.scheduler, GradientsParamsRecord(grads),
                         rec.into_item(NativePrecisionSettings())[4], Counters)
    m2, o2, s2 = MLP([3, 5, 2], seed=5), AdamW(), CosineAnnealingLr(0.05, 7)
    before = snapshot(m2, o2, s2, GradientsAccumulator())
    with pytest.raises(RecordMismatchError, match="layers.9.weight"):
        bad.restore(m2, o2, s2, "cpu")
    assert_same(before, snapshot(m2, o2, s2, GradientsAccumulator()))


def test_restore_rejects_a_wrong_device_unchanged(live):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    m2, o2, s2 = MLP([3, 5, 2], seed=5), AdamW(), CosineAnnealingLr(0.05, 7)
    before = snapshot(m2, o2, s2, GradientsAccumulator())
    with pytest.raises(RecordMismatchError, match="device"):
        rec.restore(m2, o2, s2, "cuda:0")
    assert_same(before, snapshot(m2, o2, s2, GradientsAccumulator()))


def test_scheduler_none_round_trip(live):
    model, opt, _, acc, gen = live
    rec = TrainingRecord.capture(model, opt, None, acc, counters(gen))
    r = NamedMpkBytesRecorder()
    back = TrainingRecord.load(r, rec.save(r), state_type=Counters)
    assert back.scheduler is None
    restored = back.restore(MLP([3, 5, 2]), AdamW(), None, "cpu")
    assert restored.scheduler is None
    with pytest.raises(RecordMismatchError, match="no scheduler"):
        back.restore(MLP([3, 5, 2]), AdamW(), StepLr(0.1, 2), "cpu")


def test_state_must_be_a_record(live):
    model, opt, sched, acc, _ = live
    with pytest.raises(TypeError, match="Record"):
        TrainingRecord.capture(model, opt, sched, acc, {"micro": 1})
    with pytest.raises(TypeError):
        TrainingRecord.capture(object(), opt, sched, acc, counters())


def test_a_recorder_class_or_a_non_recorder_is_a_type_error_naming_it(live, tmp_path):
    model, opt, sched, acc, gen = live
    rec = TrainingRecord.capture(model, opt, sched, acc, counters(gen))
    path = tmp_path / "r.mpk"
    rec.save(NamedMpkFileRecorder(), path)
    with pytest.raises(TypeError, match=r"got the class NamedMpkFileRecorder: pass NamedMpkFileRecorder\(\)"):
        TrainingRecord.load(NamedMpkFileRecorder, path, "cpu", state_type=Counters)
    with pytest.raises(TypeError, match=r"got the class NamedMpkFileRecorder: pass NamedMpkFileRecorder\(\)"):
        rec.save(NamedMpkFileRecorder, tmp_path / "other.mpk")
    with pytest.raises(TypeError, match=r"got str, which has no read\(\)"):
        TrainingRecord.load("r.mpk", path, "cpu", state_type=Counters)
    assert not (tmp_path / "other.mpk").exists()


@pytest.mark.parametrize("state_type", [dict, int, "Counters", object()])
def test_a_state_type_that_is_not_a_record_class_is_a_type_error_before_the_read(state_type, tmp_path):
    class Unread(NamedMpkFileRecorder):
        def read(self, args, **kw):
            raise AssertionError("read before the arguments were checked")

    with pytest.raises(TypeError, match=r"state_type must be the caller state's record class .*got "):
        TrainingRecord.load(Unread(), tmp_path / "r.mpk", "cpu", state_type=state_type)


def test_a_generic_record_class_is_a_state_type_and_a_record_class_as_the_device_is_refused(live, tmp_path):
    import typing

    T = typing.TypeVar("T")

    @trainrec.record
    class Generic(typing.Generic[T]):
        micro: int = 0

    model, opt, sched, acc, gen = live
    path = TrainingRecord.capture(model, opt, sched, acc, Generic(3)).save(NamedMpkFileRecorder(), tmp_path / "g.mpk")
    assert TrainingRecord.load(NamedMpkFileRecorder(), path, "cpu", state_type=Generic[int]).state.micro == 3
    with pytest.raises(TypeError, match=r"Generic was given as the device: state_type is keyword-only"):
        TrainingRecord.load(NamedMpkFileRecorder(), path, Generic)
