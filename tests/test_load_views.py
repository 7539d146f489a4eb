"""`Recorder.load` of a `@trainrec.record` reads the file once: its arrays are writable
views of the load's own read buffer, never of another load's or of the caller's bytes, and
never of a tensor someone else still reads. With `mmap=True` the load is lazy: each field
holding tensors is built when first read, its arrays read-only views of the map, verified
then."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import trainrec
from trainrec import (
    ChecksumError,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
)

NATIVE = NativePrecisionSettings()  # every dtype stored as it is: no conversion copies


@trainrec.record
class Arrays:
    step: int
    arrays: dict[str, np.ndarray]


def _state(n_bytes: int) -> Arrays:
    """Eight arrays of mixed dtypes, `n_bytes` in all (the file recorder reads files of
    8 MiB and more on a background thread, smaller ones at once: both are covered)."""
    rng = np.random.default_rng(0)
    per = n_bytes // 8
    dtypes = [np.float32, np.float64, np.int64, np.float16, np.int32, np.uint8, np.float32, np.bool_]
    arrays = {}
    for i, dt in enumerate(dtypes):
        raw = rng.integers(0, 255, per, dtype=np.uint8)
        arrays[f"a{i}"] = (raw % 2).astype(np.bool_) if dt is np.bool_ else raw.view(np.uint8).astype(dt)
    arrays["shaped"] = rng.standard_normal((3, 5, 7)).astype(np.float32)
    return Arrays(7, arrays)


def _root(a: np.ndarray) -> object:
    """The object that holds `a`'s memory: the array that owns it, or the buffer under it."""
    owner: object = a
    while True:
        if isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        elif isinstance(owner, memoryview) and owner.obj is not None:
            owner = owner.obj
        else:
            return owner


def _same(a: Arrays, b: Arrays) -> bool:
    return a.step == b.step and a.arrays.keys() == b.arrays.keys() and all(
        x.dtype == b.arrays[k].dtype and x.shape == b.arrays[k].shape and np.array_equal(x, b.arrays[k])
        for k, x in a.arrays.items())


@pytest.mark.parametrize("n_bytes", [64 << 10, 16 << 20], ids=["read-at-once", "background-read"])
def test_a_record_load_hands_out_views_of_one_read_buffer(n_bytes, tmp_path):
    saved = _state(n_bytes)
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    recorder.record(saved, tmp_path / "s.mpk")
    loaded = recorder.load(tmp_path / "s.mpk", None, Arrays)
    assert _same(loaded, saved)
    arrays = list(loaded.arrays.values())
    roots = {id(_root(a)) for a in arrays}
    assert len(roots) == 1, "every array is a view of the one read buffer (no copy per tensor)"
    assert memoryview(_root(arrays[0])).nbytes >= (tmp_path / "s.mpk").stat().st_size
    assert all(a.flags.writeable and a.flags.c_contiguous for a in arrays)
    for a, b in itertools.combinations(arrays, 2):
        assert not np.shares_memory(a, b)
    loaded.arrays["a0"][:] = 1  # writing one array changes no other
    assert _same(Arrays(7, {k: v for k, v in loaded.arrays.items() if k != "a0"}),
                 Arrays(7, {k: v for k, v in saved.arrays.items() if k != "a0"}))


def test_two_loads_never_alias(tmp_path):
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    recorder.record(_state(1 << 20), tmp_path / "s.mpk")
    first = recorder.load(tmp_path / "s.mpk", None, Arrays)
    second = recorder.load(tmp_path / "s.mpk", None, Arrays)
    for k, a in first.arrays.items():
        assert not np.shares_memory(a, second.arrays[k])
    before = {k: v.copy() for k, v in second.arrays.items()}
    for a in first.arrays.values():
        a[...] = 0
    assert all(np.array_equal(second.arrays[k], v) for k, v in before.items())


def test_an_item_someone_holds_is_copied_not_handed_out(tmp_path):
    """`load_item` gives the caller the item: rebuilding a record from it copies, so the
    item's tensors stay immutable."""
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    recorder.record(_state(1 << 20), tmp_path / "s.mpk")
    item = recorder.load_item(tmp_path / "s.mpk")
    rebuilt = Arrays.from_item(item, None)
    for k, a in rebuilt.arrays.items():
        t = item["arrays"][k]
        assert a.flags.writeable and not t.array.flags.writeable
        assert not np.shares_memory(a, t.array)
    kept = item["arrays"]["a1"].array.copy()
    rebuilt.arrays["a1"][...] = 0
    assert np.array_equal(item["arrays"]["a1"].array, kept)


def test_the_callers_bytes_are_copied():
    saved = _state(1 << 20)
    payload = bytearray(NamedMpkBytesRecorder(NATIVE).record(saved, None))
    kept = bytes(payload)
    loaded = NamedMpkBytesRecorder(NATIVE).load(payload, None, Arrays)
    for a in loaded.arrays.values():
        a[...] = 0
    assert payload == kept, "arrays loaded from the caller's bytearray must not write into it"


def test_a_gzip_load_hands_out_views_too(tmp_path):
    saved = _state(1 << 20)
    recorder = NamedMpkGzFileRecorder(NATIVE, compresslevel=1)
    recorder.record(saved, tmp_path / "s.mpk.gz")
    loaded = recorder.load(tmp_path / "s.mpk.gz", None, Arrays)
    assert _same(loaded, saved)
    assert len({id(_root(a)) for a in loaded.arrays.values()}) == 1


@pytest.mark.parametrize("n_bytes", [64 << 10, 16 << 20], ids=["read-at-once", "background-read"])
def test_a_view_load_still_verifies_every_checksum(n_bytes, tmp_path):
    saved = _state(n_bytes)
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    path = recorder.record(saved, tmp_path / "s.mpk")
    data = bytearray(path.read_bytes())
    last = saved.arrays["shaped"].tobytes()
    at = data.rindex(last)
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="arrays.shaped"):
        recorder.load(path, None, Arrays)


def test_a_torch_field_does_not_alias_the_read_buffer(tmp_path):
    torch = pytest.importorskip("torch")

    # made, not declared: the annotations must be types, not strings of a local import
    Mixed = trainrec.record(  # noqa: N806 - a class
        dataclasses.make_dataclass("Mixed", [("weights", torch.Tensor), ("moments", np.ndarray)]))
    saved = Mixed(torch.arange(1 << 16, dtype=torch.float32), np.arange(1 << 16, dtype=np.float64))
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    recorder.record(saved, tmp_path / "m.mpk")
    loaded = recorder.load(tmp_path / "m.mpk", None, Mixed)
    assert torch.equal(loaded.weights, saved.weights) and loaded.weights.dtype == torch.float32
    buffer = _root(loaded.moments)
    assert isinstance(buffer, np.ndarray)
    lo, hi = buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes
    assert not lo <= loaded.weights.data_ptr() < hi, "from_host copies out of the read buffer"
    loaded.weights.add_(1)
    assert np.array_equal(loaded.moments, saved.moments)


@trainrec.record
class Weights:
    step: np.ndarray
    weights: np.ndarray
    scale: float = 1.0


def test_a_mapped_load_builds_each_field_when_first_read(tmp_path):
    """`load(..., mmap=True)` copied every tensor and verified every checksum at once
    (3-8 s for a record with a 1 GiB field, to read a 3-element one); the README promises
    lazy reads: a field's tensors are read and verified when the field is first read."""
    saved = Weights(np.arange(3.0), np.arange(1 << 16, dtype=np.float32), 2.0)
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    path = recorder.record(saved, tmp_path / "w.mpk")
    data = bytearray(path.read_bytes())
    at = data.rindex(saved.weights.tobytes()[-64:])
    data[at + 5] ^= 0x40  # inside the big field's bytes
    path.write_bytes(bytes(data))
    loaded = recorder.load(path, None, Weights, mmap=True)
    assert "weights" not in vars(loaded) and loaded.scale == 2.0
    assert np.array_equal(loaded.step, saved.step) and not loaded.step.flags.writeable
    with pytest.raises(ChecksumError, match="weights"):
        loaded.weights  # noqa: B018 - the first read verifies
    with pytest.raises(ChecksumError, match="weights"):
        loaded.weights  # noqa: B018 - still unread: refused again
    with pytest.raises(ChecksumError):
        recorder.load(path, None, Weights)  # an eager load verifies everything at once
    recorder.record(saved, path.with_name("good.mpk"))
    good = recorder.load(path.with_name("good.mpk"), None, Weights, mmap=True)
    weights = good.weights
    assert np.array_equal(weights, saved.weights) and not weights.flags.writeable
    assert isinstance(_root(weights), __import__("mmap").mmap)  # a view of the map, no copy
    assert good.weights is weights and list(vars(good)["__trainrec_pending__"]) == ["step"]
    good.step  # noqa: B018 - the last field built: nothing pending
    assert "__trainrec_pending__" not in vars(good)


def test_a_mapped_record_compares_copies_and_pickles_as_a_loaded_one(tmp_path):
    import copy
    import pickle

    saved = Weights(np.arange(3.0), np.arange(8, dtype=np.float32))
    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    path = recorder.record(saved, tmp_path / "w.mpk")
    for how in (copy.copy, copy.deepcopy, lambda r: pickle.loads(pickle.dumps(r)),
                lambda r: dataclasses.replace(r, scale=3.0), repr):
        out = how(recorder.load(path, None, Weights, mmap=True))
        if how is not repr:
            assert np.array_equal(out.weights, saved.weights)
            assert "__trainrec_pending__" not in vars(out)
    assert "weights=array" in repr(recorder.load(path, None, Weights, mmap=True))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        recorder.load(path, None, Weights, mmap=True).nope  # noqa: B018


def test_a_record_with_post_init_or_a_torch_field_loads_mapped_too(tmp_path):
    """__post_init__ reads its fields: such a record is built at once. A torch field is a
    copy of the map (torch has no read-only tensors), made when the field is first read."""
    torch = pytest.importorskip("torch")

    @trainrec.record
    class Checked:
        weights: np.ndarray

        def __post_init__(self) -> None:
            assert self.weights.ndim == 1

    recorder = NamedMpkFileRecorder(NATIVE, durable=False)
    path = recorder.record(Checked(np.arange(4.0)), tmp_path / "c.mpk")
    assert "weights" in vars(recorder.load(path, None, Checked, mmap=True))
    Mixed = trainrec.record(  # noqa: N806 - a class
        dataclasses.make_dataclass("Mixed", [("weights", torch.Tensor)]))
    path = recorder.record(Mixed(torch.arange(4.0)), tmp_path / "m.mpk")
    loaded = recorder.load(path, None, Mixed, mmap=True)
    assert "weights" not in vars(loaded)
    loaded.weights.add_(1)  # its own memory
    assert torch.equal(recorder.load(path, None, Mixed, mmap=True).weights, torch.arange(4.0))
