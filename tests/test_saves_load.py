"""What saves, loads: the writer refuses what the reader would refuse (one `Limits`), and
caller state must rebuild as its declared type."""

from __future__ import annotations

import contextlib
import typing

import numpy as np
import pytest

import trainrec
import trainrec.format as fmt
from trainrec import (
    CorruptRecordError,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RngRecord,
    TensorData,
    TrainingRecord,
)

NATIVE = NativePrecisionSettings()


def nested(depth: int, leaf: object = 1) -> object:
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


def save(recorder, item, path):
    return recorder.save_item(item, None if isinstance(recorder, NamedMpkBytesRecorder) else path)


def load(recorder, out):
    return recorder.load_item(out)


RECORDERS = [NamedMpkFileRecorder, NamedMpkGzFileRecorder, NamedMpkBytesRecorder]


@pytest.mark.parametrize("recorder_cls", RECORDERS)
@pytest.mark.parametrize(
    "item, key",
    [
        ({"deep": nested(100)}, "deep.0.0"),
        ({"s": "x" * (17 << 20)}, "s"),
        ({"k": {"y" * (17 << 20): 1}}, "k"),
        ({"t": TensorData.from_array(np.zeros((1,) * 33, np.float32))}, "t"),
    ],
    ids=["100-deep list", "17 MiB string", "17 MiB key", "33-dim tensor"],
)
def test_what_the_reader_refuses_does_not_save(recorder_cls, item, key, tmp_path):
    path = tmp_path / "ckpt"
    recorder = recorder_cls(NATIVE)
    old = save(recorder, {"old": 1}, path)
    with pytest.raises(CorruptRecordError, match="never load") as e:
        save(recorder, item, path)
    assert e.value.key.startswith(key)
    if not isinstance(recorder, NamedMpkBytesRecorder):
        assert load(recorder, path) == {"old": 1}  # the failed save left the old file
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    else:
        assert load(recorder, old) == {"old": 1}


def test_a_deep_caller_state_fails_at_save_not_at_resume(tmp_path):
    import trainrec.adapters.numpy as trn

    @trainrec.record
    class State:
        micro: int
        tree: list

    model = trn.MLP([2, 2], seed=0)
    rec = TrainingRecord.capture(model, trn.SGD(), None, GradientsAccumulator(), State(0, nested(100)))
    with pytest.raises(RecorderError, match="Limits.max_depth"):
        rec.save(NamedMpkFileRecorder(), tmp_path / "c.mpk")
    assert not (tmp_path / "c.mpk").exists()


def _writes_and_reads(item: object, limits: fmt.Limits) -> tuple[bool, bool]:
    """(the writer accepts `item`, the reader accepts what an unbounded writer writes)."""
    try:
        fmt.write_document(_Sink(), item, NATIVE, "Item")
        writes = True
    except CorruptRecordError:
        writes = False
    unbounded = fmt.Limits(max_header_bytes=1 << 40, max_depth=1 << 20, max_str_bytes=1 << 40,
                           max_dims=1 << 20)
    sink = _Sink()
    fmt.write_document(sink, item, NATIVE, "Item", limits=unbounded)
    try:
        fmt.read_document(bytes(sink.data), "<bytes>", limits=limits)
        reads = True
    except CorruptRecordError:
        reads = False
    return writes, reads


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += bytes(b)
        return len(b)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: nested(d),
        lambda d: nested(d, []),
        lambda d: nested(d, {"k": None}),
        lambda d: nested(d, TensorData.from_array(np.zeros(2, np.float32))),
        lambda d: nested(d, TensorData.from_array(np.float32(1))),
    ],
    ids=["int", "empty list", "map", "tensor", "0-d tensor"],
)
def test_the_writer_refuses_exactly_what_the_reader_refuses(make):
    limits = fmt.Limits()
    seen = set()
    for depth in range(55, 70):
        writes, reads = _writes_and_reads(make(depth), limits)
        assert writes == reads, f"depth {depth}: writer {writes}, reader {reads}"
        seen.add(writes)
    assert seen == {True, False}


def test_string_and_dims_limits_match_the_reader():
    small = fmt.Limits(max_str_bytes=100, max_dims=3)
    for s in ["x" * 100, "x" * 101, "\u00e9" * 50, "\u00e9" * 51]:
        ok = True
        try:
            fmt.check_limits({"s": s}, small)
        except CorruptRecordError:
            ok = False
        sink = _Sink()
        fmt.write_document(sink, {"s": s}, NATIVE, "Item")
        try:
            fmt.read_document(bytes(sink.data), "<bytes>", limits=small)
            reads = True
        except CorruptRecordError:
            reads = False
        assert ok == reads == (len(s.encode()) <= 100)
    for dims in (3, 4):
        t = TensorData.from_array(np.zeros((1,) * dims, np.float32))
        with pytest.raises(CorruptRecordError) if dims > 3 else contextlib.nullcontext():
            fmt.check_limits({"t": t}, small)


def test_a_header_the_reader_refuses_does_not_save():
    with pytest.raises(CorruptRecordError, match="max_header_bytes"):
        NamedMpkBytesRecorder(NATIVE).save_item({}, None, "R" * (1 << 20))


# -- the adapters' recorders share the limits ------------------------------------------------


def _adapter_recorders():
    out = []
    try:
        import trainrec.adapters.torch as trt

        out.append(pytest.param(trt.TorchFileRecorder, "trainrec.adapters.torch.recorder", id="torch"))
    except ImportError:
        pass
    try:
        from trainrec.recorders.flaxmsgpack import FlaxMsgpackFileRecorder

        out.append(pytest.param(FlaxMsgpackFileRecorder, "trainrec.recorders.flaxmsgpack", id="flax"))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("recorder_cls, module", _adapter_recorders())
@pytest.mark.parametrize("leaf", [1, TensorData.from_array(np.zeros(2, np.float32))], ids=["int", "tensor"])
def test_adapter_recorders_refuse_exactly_what_they_cannot_read(recorder_cls, module, leaf, tmp_path,
                                                                monkeypatch):
    import importlib

    mod = importlib.import_module(module)
    recorder = recorder_cls(NATIVE)
    seen = set()
    for depth in range(60, 68):
        item = {"x": nested(depth, leaf)}
        try:
            recorder.save_item(item, tmp_path / "a")
            writes = True
        except CorruptRecordError:
            writes = False
        with monkeypatch.context() as m:
            m.setattr(mod, "check_limits", lambda *a, **k: None)
            recorder.save_item(item, tmp_path / "b")
        try:
            recorder.load_item(tmp_path / "b")
            reads = True
        except CorruptRecordError:
            reads = False
        assert writes == reads, f"depth {depth}: writer {writes}, reader {reads}"
        seen.add(writes)
    assert seen == {True, False}


# -- caller state rebuilds as its declared type -----------------------------------------------


@trainrec.record
class ReadmeState:
    micro: int
    rng: RngRecord | None = None


@trainrec.record
class Typed:
    arr: np.ndarray
    lr: float
    history: list[float]
    pair: tuple[int, str]
    table: dict[str, int]


def test_readme_state_with_a_torch_rng_record_fails_at_save():
    trt = pytest.importorskip("trainrec.adapters.torch")
    state = ReadmeState(0)
    state.rng = trt.TorchRngRecord.capture()
    with pytest.raises(TypeError, match=r"ReadmeState.rng is declared RngRecord \| None but holds "
                       r"a value of type TorchRngRecord.*declare it `TorchRngRecord \| None`"):
        NamedMpkBytesRecorder(NATIVE).record(state, None)


def test_state_of_its_declared_type_round_trips():
    r = NamedMpkBytesRecorder(NATIVE)
    state = ReadmeState(3, RngRecord.capture())
    back = r.load(r.record(state, None), None, ReadmeState)
    assert back.micro == 3 and isinstance(back.rng, RngRecord)
    typed = Typed(np.arange(3), 2, [1, 2.5], (1, "a"), {"a": 1})
    back = r.load(r.record(typed, None), None, Typed)
    assert back.lr == 2.0 and isinstance(back.lr, float) and back.pair == (1, "a")


@pytest.mark.parametrize(
    "state, where",
    [
        (ReadmeState(np.int64(3)), "ReadmeState.micro is declared int but holds a value of type int64"),
        (ReadmeState(0, {"python": 1}), "ReadmeState.rng is declared RngRecord | None"),
        (Typed([1.0], 1.0, [], (1, "a"), {}), "Typed.arr is declared ndarray but holds a value of type list"),
        (Typed(np.ones(1), np.float32(1), [], (1, "a"), {}), "Typed.lr is declared float"),
        (Typed(np.ones(1), 1.0, [np.float32(1)], (1, "a"), {}), "Typed.history is declared list[float]"),
        (Typed(np.ones(1), 1.0, [], (1, 2, 3), {}), "Typed.pair is declared tuple[int, str]"),
        (Typed(np.ones(1), 1.0, [], (1, "a"), {"a": "b"}), "Typed.table is declared dict[str, int]"),
    ],
)
def test_state_that_would_not_rebuild_as_declared_fails_at_save(state, where):
    with pytest.raises(TypeError) as e:
        NamedMpkBytesRecorder(NATIVE).record(state, None)
    assert str(e.value).startswith(where)


@trainrec.record
class Base:
    n: int


class Sub(Base):
    """Records itself with Base's methods, but would load back as a Base: refused where a
    Base is declared (tests/test_record_rebuilds.py)."""


@trainrec.record
class Holder:
    base: Base
    text: str
    arr: np.ndarray


def test_what_to_item_records_as_a_scalar_is_checked_as_one():
    r = NamedMpkBytesRecorder(NATIVE)
    back = r.load(r.record(Holder(Base(1), np.str_("s"), np.ones(2)), None), None, Holder)
    assert type(back.base) is Base and back.text == "s"
    with pytest.raises(TypeError, match="Holder.base is declared Base but holds a value of type Sub"):
        r.record(Holder(Sub(1), "s", np.ones(2)), None)
    with pytest.raises(TypeError, match="Holder.arr is declared ndarray but holds a value of type float64"):
        r.record(Holder(Base(1), "s", np.float64(2.0)), None)  # a float64 is saved as a float


@trainrec.record
class Bare:
    seq: list
    pair: tuple


def test_bare_list_and_tuple_annotations_round_trip_as_declared():
    r = NamedMpkBytesRecorder(NATIVE)
    back = r.load(r.record(Bare((1, 2), (3, "a")), None), None, Bare)
    assert back.seq == [1, 2] and back.pair == (3, "a")
    with pytest.raises(TypeError, match="Bare.seq is declared list but holds a value of type str"):
        r.record(Bare("ab", ()), None)


@trainrec.record
class Loose:
    anything: typing.Any
    items: list[typing.Any]
    table: dict[str, typing.Any]


def test_any_is_not_checked():
    r = NamedMpkBytesRecorder(NATIVE)
    back = r.load(r.record(Loose(np.ones(1), [1, "a", None], {"k": [2]}), None), None, Loose)
    assert back.items == [1, "a", None] and back.table == {"k": [2]}
