"""Caller state comes back as it was saved, or the save refuses it: non-init fields keep
their data, a record field holds exactly its declared record type, NamedTuples and enums
rebuild as themselves, unions of several record types and records whose annotations
cannot be resolved are refused; a device that is not there is no corrupt file."""

from __future__ import annotations

import dataclasses
import enum
import typing

import numpy as np
import pytest

import trainrec
from trainrec import (
    CorruptRecordError,
    DefaultRecorder,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    RngRecord,
    TrainingRecord,
)
from trainrec.training.records import RecordDeclarationError

R = NamedMpkBytesRecorder(NativePrecisionSettings())


def roundtrip(value: typing.Any) -> typing.Any:
    return R.load(R.record(value, None), None, type(value))


# -- a device that is not there is not a corrupt file -----------------------------------------


def _state_with_tensor(tensor_type: type) -> type:
    @trainrec.record
    class S:
        micro: int
        noise: tensor_type  # type: ignore[valid-type]

    S.__annotations__["noise"] = tensor_type  # evaluated: not a string to resolve
    return S


def test_loading_torch_state_onto_a_missing_gpu_is_not_a_corrupt_file(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("trainrec.adapters.torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    state_cls = _state_with_tensor(torch.Tensor)
    model = torch.nn.Linear(2, 1)
    path = tmp_path / "a.mpk"
    TrainingRecord.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                           GradientsAccumulator(), state_cls(1, torch.zeros(2))).save(DefaultRecorder(), path)
    with pytest.raises(RecorderError, match="no CUDA device is visible") as e:
        TrainingRecord.load(DefaultRecorder(), path, "cuda", state_type=state_cls)
    assert not isinstance(e.value, CorruptRecordError)
    assert isinstance(e.value, RecordMismatchError)
    back = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=state_cls)  # the file is good
    assert back.state.micro == 1 and torch.equal(back.state.noise, torch.zeros(2))


def test_loading_jax_state_onto_a_missing_gpu_is_not_a_corrupt_file():
    jax = pytest.importorskip("jax")
    pytest.importorskip("trainrec.adapters.jax")
    try:
        jax.devices("gpu")
        pytest.skip("a GPU is visible to JAX")
    except RuntimeError:
        pass
    state_cls = _state_with_tensor(jax.Array)
    data = R.record(state_cls(1, jax.numpy.zeros(2)), None)
    with pytest.raises(RecordMismatchError, match="no CUDA device is visible to JAX") as e:
        R.load(data, "gpu:0", state_cls)
    assert not isinstance(e.value, CorruptRecordError)
    assert R.load(data, "cpu", state_cls).micro == 1


# -- what saves, loads: non-init fields, subclasses of a declared record ----------------------


@trainrec.record
class WithCache:
    micro: int
    cache: list[int] = dataclasses.field(default_factory=list, init=False)
    seen: dict[str, float] = dataclasses.field(default_factory=dict, init=False)


@trainrec.record
@dataclasses.dataclass(frozen=True)
class FrozenWithTotal:
    a: int
    total: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.a * 10)


def test_non_init_fields_load_back_with_their_saved_values():
    state = WithCache(3)
    state.cache.extend([1, 2])
    state.seen["loss"] = 0.5
    back = roundtrip(state)
    assert back == state and back.cache == [1, 2] and back.seen == {"loss": 0.5}
    frozen = FrozenWithTotal(2)
    object.__setattr__(frozen, "total", 7)  # changed after construction: the saved 7 is kept
    back = roundtrip(frozen)
    assert back.a == 2 and back.total == 7


@trainrec.record
class Inner:
    a: int


@dataclasses.dataclass
class SubWithExtra(Inner):
    extra: int = 0


class SubPlain(Inner):
    """No fields of its own: it would still load back as an `Inner`."""


@trainrec.record
class Outer:
    inner: Inner
    maybe: Inner | None = None


@pytest.mark.parametrize("value", [SubWithExtra(1, 2), SubPlain(1)], ids=["extra field", "plain"])
def test_a_subclass_of_a_declared_record_is_refused_at_save(value):
    with pytest.raises(TypeError, match=rf"Outer.inner is declared Inner but holds a value of type "
                       rf"{type(value).__name__}.*declare it `{type(value).__name__}`"):
        R.record(Outer(value), None)
    with pytest.raises(TypeError, match="Outer.maybe is declared Inner | None"):
        R.record(Outer(Inner(1), value), None)
    back = roundtrip(Outer(Inner(1), Inner(2)))
    assert type(back.inner) is Inner and back.maybe == Inner(2)


def test_a_subclass_loads_back_as_itself_where_it_is_declared():
    @trainrec.record
    class Holder:
        inner: SubWithExtra

    back = roundtrip(Holder(SubWithExtra(1, 2)))
    assert type(back.inner) is SubWithExtra and back.inner.extra == 2


# -- caller state comes back as its declared type ---------------------------------------------


class Pos(typing.NamedTuple):
    epoch: int
    batch: int


class Phase(enum.IntEnum):
    WARMUP = 1
    MAIN = 2


class Mode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Color(enum.Enum):
    RED = 1
    BLUE = "blue"


@trainrec.record
class Kinds:
    pos: Pos
    phase: Phase
    mode: Mode
    color: Color
    phases: list[Phase]
    maybe_pos: Pos | None = None
    scores: tuple[float, ...] = ()


def test_named_tuples_and_enums_load_back_as_themselves():
    state = Kinds(Pos(3, 4), Phase.MAIN, Mode.EVAL, Color.BLUE, [Phase.WARMUP], Pos(0, 1), (1.5,))
    back = roundtrip(state)
    assert back == state
    assert type(back.pos) is Pos and back.pos.batch == 4 and type(back.maybe_pos) is Pos
    assert back.phase is Phase.MAIN and back.mode is Mode.EVAL and back.color is Color.BLUE
    assert back.phases == [Phase.WARMUP] and type(back.phases[0]) is Phase


@pytest.mark.parametrize(
    "state, where",
    [
        (Kinds((3, 4), Phase.MAIN, Mode.EVAL, Color.RED, []), "Kinds.pos is declared Pos"),
        (Kinds(Pos(3, "4"), Phase.MAIN, Mode.EVAL, Color.RED, []), "Kinds.pos is declared Pos"),
        (Kinds(Pos(3, 4), 2, Mode.EVAL, Color.RED, []), "Kinds.phase is declared Phase"),
        (Kinds(Pos(3, 4), Phase.MAIN, "eval", Color.RED, []), "Kinds.mode is declared Mode"),
        (Kinds(Pos(3, 4), Phase.MAIN, Mode.EVAL, Color.RED, [2]), "Kinds.phases is declared list[Phase]"),
        (Kinds(Pos(3, 4), Phase.MAIN, Mode.EVAL, Color.RED, [], scores=Pos(1, 2)),
         "Kinds.scores is declared tuple[float, ...]"),
    ],
)
def test_what_would_load_as_another_type_is_refused_at_save(state, where):
    with pytest.raises(TypeError) as e:
        R.record(state, None)
    assert str(e.value).startswith(where), str(e.value)


@trainrec.record
class Counters:
    micro: int
    epoch: float


def test_an_enum_where_a_plain_type_is_declared_is_refused():
    with pytest.raises(TypeError, match="Counters.micro is declared int but holds a value of type Phase"):
        R.record(Counters(Phase.MAIN, 1.0), None)


def test_a_stored_value_that_is_no_member_of_the_enum_is_a_corrupt_record():
    data = NamedMpkBytesRecorder(NativePrecisionSettings()).save_item(
        {"pos": [1, 2], "phase": 9, "mode": "train", "color": 1, "phases": [], "maybe_pos": None,
         "scores": []}, None, "Kinds")
    with pytest.raises(CorruptRecordError, match="9 is not a Phase"):
        R.load(data, None, Kinds)


# -- unions of several record types, classes whose annotations cannot be resolved --------------


@trainrec.record
class TwoRngs:
    micro: int
    rng: RngRecord | Inner | None = None


@trainrec.record
class PlainUnion:
    value: int | str | None
    values: list[int | str]


def test_a_union_of_several_record_types_is_refused_at_save_and_at_load():
    for state in (TwoRngs(1), TwoRngs(1, Inner(2)), TwoRngs(1, RngRecord.capture())):
        with pytest.raises(RecordDeclarationError, match=r"TwoRngs.rng is declared RngRecord \| Inner "
                           r"\| None: .*declare one type"):
            R.record(state, None)
    data = R.save_item({"micro": 1, "rng": None}, None, "TwoRngs")
    with pytest.raises(RecordDeclarationError, match="TwoRngs.rng is declared"):
        R.load(data, None, TwoRngs)


def test_a_union_of_plain_types_round_trips_and_is_checked():
    back = roundtrip(PlainUnion("a", [1, "b"]))
    assert back.value == "a" and back.values == [1, "b"]
    with pytest.raises(TypeError, match="PlainUnion.value is declared int | str | None"):
        R.record(PlainUnion(1.5, []), None)


def test_a_torch_rng_union_state_is_refused_with_the_fix_named():
    trt = pytest.importorskip("trainrec.adapters.torch")

    @trainrec.record
    class S:
        rng: RngRecord | trt.TorchRngRecord | None

    with pytest.raises(TypeError, match=r"declare one type \(such as `TorchRngRecord \| None`\)"):
        R.record(S(trt.TorchRngRecord.capture()), None)


def test_records_declared_in_a_function_resolve_the_functions_names():
    unrelated = np.zeros(4)  # a local the annotations do not name: not kept alive by Local

    @trainrec.record
    class LocalInner:
        a: int

    @trainrec.record
    class Local:
        inner: LocalInner
        pos: Pos

    assert "unrelated" not in vars(Local).get("__trainrec_locals__", {}) and unrelated.size == 4
    back = roundtrip(Local(LocalInner(1), Pos(1, 2)))
    assert type(back.inner) is LocalInner and back.inner.a == 1 and type(back.pos) is Pos
    with pytest.raises(TypeError, match=r"<locals>.Local.inner is declared .*LocalInner but holds a value of type dict"):
        R.record(Local({"a": 1}, Pos(1, 2)), None)  # checked at save like a module-level one


def test_annotations_that_cannot_be_resolved_are_refused_not_loaded_as_items(tmp_path):
    @trainrec.record
    class Early:
        later: Later  # noqa: F821 - defined after the decoration

    class Later:  # noqa: F841
        pass

    with pytest.raises(RecordDeclarationError, match=r"Early's field annotations cannot be resolved "
                       r"\(NameError: name 'Later' is not defined\).*at module level"):
        R.record(Early(1), None)
    data = R.save_item({"later": 1}, None, "Early")
    with pytest.raises(RecordDeclarationError, match="cannot be resolved"):
        R.load(data, None, Early)
    rec = TrainingRecord(*_components(), {"later": 1}, Early)
    with pytest.raises(RecordDeclarationError):  # not reported as a corrupt file
        _ = rec.state


def _components() -> tuple[typing.Any, ...]:
    from trainrec import StateRecord
    from trainrec.training.gradients import GradientsParamsRecord

    return StateRecord("m", {}), StateRecord("o", {}), None, GradientsParamsRecord({})
