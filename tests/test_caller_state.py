"""Caller state: `@trainrec.record` dataclasses and `RngRecord`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

import trainrec
from trainrec import NamedMpkBytesRecorder, NativePrecisionSettings, RecordMismatchError, RngRecord


@trainrec.record
class Inner:
    name: str
    weights: np.ndarray


@trainrec.record
@dataclass
class Everything:
    step: int
    lr: float
    tag: str
    blob: bytes
    nothing: None
    history: list[float]
    pair: tuple[int, str]
    table: dict[str, list[int]]
    arr: np.ndarray
    scalar: np.float32
    inner: Inner
    maybe: Inner | None
    rng: RngRecord
    extra: dict[str, int] = field(default_factory=dict)


def roundtrip(value, tp):
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return r.load(r.record(value, None), None, tp)


def test_every_field_kind_round_trips():
    v = Everything(
        step=12, lr=1e-3, tag="warm", blob=b"\x00\x01", nothing=None, history=[0.5, 0.25],
        pair=(3, "x"), table={"a": [1, 2]}, arr=np.arange(6, dtype=np.int64).reshape(2, 3),
        scalar=np.float32(2.5), inner=Inner("n", np.ones(3, np.float16)), maybe=None,
        rng=RngRecord.capture(np.random.default_rng(1)), extra={"k": 1},
    )
    back = roundtrip(v, Everything)
    assert isinstance(back, Everything) and isinstance(back.inner, Inner)
    assert (back.step, back.lr, back.tag, back.blob, back.nothing) == (12, 1e-3, "warm", b"\x00\x01", None)
    assert back.history == [0.5, 0.25] and back.pair == (3, "x") and back.table == {"a": [1, 2]}
    assert back.arr.dtype == np.int64 and np.array_equal(back.arr, v.arr)
    assert back.scalar == np.float32(2.5) and back.scalar.dtype == np.float32
    assert back.inner.weights.dtype == np.float16 and back.maybe is None and back.extra == {"k": 1}


def test_record_makes_plain_classes_dataclasses():
    @trainrec.record
    class Plain:
        a: int
        b: list[int]

    assert roundtrip(Plain(1, [2]), Plain) == Plain(1, [2])


def test_unrecordable_fields_are_type_errors():
    @trainrec.record
    class Bad:
        f: object

    with pytest.raises(TypeError, match="cannot be recorded"):
        Bad(object()).into_item(NativePrecisionSettings())


def test_field_mismatch_is_reported():
    @trainrec.record
    class A:
        x: int

    @trainrec.record
    class B:
        y: int

    r = NamedMpkBytesRecorder()
    data = r.save_item(A(1).into_item(NativePrecisionSettings()), None, "B")
    with pytest.raises(RecordMismatchError, match="missing"):
        r.load(data, None, B)


@pytest.mark.parametrize("bitgen", [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937,
                                    np.random.Philox, np.random.SFC64])
def test_rng_record_restores_python_numpy_and_generators(bitgen):
    random.seed(5)
    np.random.seed(6)
    gen = np.random.Generator(bitgen(7))
    for _ in range(3):
        random.random(), np.random.normal(), gen.normal()  # noqa: B018 - advance
    rec = roundtrip(RngRecord.capture(gen), RngRecord)
    expected = (random.random(), np.random.normal(), gen.normal(size=5))
    random.seed(0)
    np.random.seed(0)
    other = np.random.Generator(bitgen(0))
    rec.apply(other)
    got = (random.random(), np.random.normal(), other.normal(size=5))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert np.array_equal(got[2], expected[2])


def test_pcg64_128_bit_state_survives_msgpack():
    gen = np.random.default_rng(2**100)
    state = gen.bit_generator.state["state"]["state"]
    assert state >= 2**64  # msgpack cannot hold this as an int
    rec = roundtrip(RngRecord.capture(gen), RngRecord)
    fresh = np.random.default_rng(0)
    rec.apply(fresh)
    assert fresh.bit_generator.state == gen.bit_generator.state


def test_rng_record_apply_checks_generators():
    rec = RngRecord.capture(np.random.default_rng(1))
    with pytest.raises(ValueError, match="1 generator"):
        rec.apply()
    with pytest.raises(RecordMismatchError, match="MT19937"):
        rec.apply(np.random.Generator(np.random.MT19937(0)))
    with pytest.raises(TypeError):
        RngRecord.capture(random.Random())  # type: ignore[arg-type]
