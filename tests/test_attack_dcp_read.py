"""Attacks on `DCPRecorder.load`'s in-place read (`_read_in_place`): every entry it reads
straight into its live tensor must give what `torch.load(weights_only=True)` of the entry
gives (values and dtype), every other entry is left to DCP untouched, a hostile entry is a
False return (never a crash, an escaping exception or unbounded memory), and a load
refused in the planning step reads nothing into the live objects."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import tracemalloc
import zipfile
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

from test_torch_dcp_read import _Planner, _saved  # noqa: E402 - the stub planner, torch.save bytes

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
import trainrec.adapters.torch.dcp_reader as dcp_reader  # noqa: E402
import trainrec.adapters.torch.dcp_zip as dcp_zip  # noqa: E402
from trainrec import CorruptRecordError  # noqa: E402


def _read(tmp_path, payload: bytes, target) -> bool:
    """`_read_in_place` of `payload` (one DCP entry, at an odd offset of its file) into
    `target`."""
    lead = b"\x00" * 29
    path = tmp_path / "shard.distcp"
    path.write_bytes(lead + payload + b"\xee" * 13)
    where = SimpleNamespace(offset=len(lead), length=len(payload), transform_descriptors=None)
    item = SimpleNamespace(storage_offsets=(0,) * target.dim(), lengths=tuple(target.shape),
                           dest_index=SimpleNamespace(fqn="x"))
    planner = _Planner(target)
    with open(path, "rb") as f:
        done = dcp_zip._read_in_place(f, where, item, planner)
    assert type(done) is bool and len(planner.committed) == int(done)
    return done


def _bytes_of(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _reference(payload: bytes, target):
    """What DCP's own read puts into `target`: `torch.load` of the entry, copied in."""
    out = target.clone()
    out.copy_(torch.load(io.BytesIO(payload), weights_only=True))
    return out


def _rezipped(payload: bytes, *, pkl: bytes | None = None, method: int = zipfile.ZIP_STORED,
              data=None) -> bytes:
    """`payload` (a `torch.save` zip) written again by Python's zipfile: `data.pkl`
    replaced by `pkl`, the data records (`data`: a function of their bytes) compressed
    with `method`."""
    src = zipfile.ZipFile(io.BytesIO(payload))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            record = src.read(info)
            stored = zipfile.ZIP_STORED
            if info.filename.endswith("/data.pkl") and pkl is not None:
                record = pkl
            elif "/data/" in info.filename:
                record, stored = (data(record) if data else record), method
            dst.writestr(info.filename, record, compress_type=stored)
    return out.getvalue()


class _Call:
    """Pickles as `func(*args)`: `func` a real global, named by module and name."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


class _Storage:
    def __init__(self, pid):
        self.pid = pid


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def _layout_pickle(call: _Call) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(call)
    return out.getvalue()


def _v3(pid, offset, shape, stride, dtype, *rest):
    return _Call(torch._utils._rebuild_tensor_v3, _Storage(pid), offset, shape, stride, False,
                 collections.OrderedDict(), dtype, *rest)


def _v2(pid, offset, shape, stride, *rest, hooks=None):
    return _Call(torch._utils._rebuild_tensor_v2, _Storage(pid), offset, shape, stride, False,
                 collections.OrderedDict() if hooks is None else hooks, *rest)


# -- 1. what is read in place is what torch.load gives -------------------------------------

def _values():
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
    out = {}
    for dt in (torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
               torch.complex32, torch.complex128, torch.float8_e5m2, torch.float8_e4m3fn,
               torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.bits8,
               torch.float16, torch.bfloat16, torch.float64):
        out[str(dt).removeprefix("torch.")] = raw.view(dt).reshape(2, -1)
    out["bool"] = raw.reshape(4, 16) > 100
    out["requires_grad"] = torch.randn(3, 2, generator=g).requires_grad_()
    out["0-dim int64"] = torch.tensor(-5)
    out["size-1 dims, canonical strides"] = torch.randn(1, 3, 1, generator=g)
    out["empty"] = torch.zeros(2, 0, 3)
    return out


@pytest.mark.parametrize("name", list(_values()))
def test_every_entry_read_in_place_is_what_torch_load_gives(tmp_path, name):
    value = _values()[name]
    payload = _saved(value)
    target = torch.empty_like(value.detach())
    target.reshape(-1).view(torch.uint8).fill_(0xA5)  # no value of the entry's
    ref = _reference(payload, target)
    assert _read(tmp_path, payload, target)
    assert target.dtype == ref.dtype and target.shape == ref.shape
    assert torch.equal(_bytes_of(target), _bytes_of(ref))


@pytest.mark.parametrize(("case", "make"), [
    ("size-1 dim with an odd stride", lambda: torch.randn(1, 3).t()),  # (3, 1) strides (1, 3)
    ("size-1 dim, stride 0", lambda: torch.empty_strided((1, 4), (0, 1)).fill_(2)),
    ("size-1 dim, stride 100", lambda: torch.empty_strided((1, 4), (100, 1)).fill_(2)),
    ("empty with odd strides", lambda: torch.empty_strided((0, 3), (1, 7))),
    ("empty view of a bigger storage", lambda: torch.randn(10)[:0]),
    ("the head of a bigger storage", lambda: torch.randn(10)[:4]),
    ("a 0-dim view inside a storage", lambda: torch.randn(5)[2]),
    ("expanded", lambda: torch.randn(1).expand(3)),
    ("a conj view", lambda: torch.randn(4, dtype=torch.complex64).conj()),
    ("a neg view", lambda: torch._neg_view(torch.randn(4))),
    ("channels_last", lambda: torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)),
    ("sparse", lambda: torch.randn(4).to_sparse()),
])
def test_layouts_that_are_not_one_whole_canonical_tensor_are_left_to_dcp(tmp_path, case, make):
    value = make()
    payload = _saved(value)
    dense = value.to_dense() if value.layout != torch.strided else value
    target = torch.full(dense.shape, 9, dtype=dense.dtype)
    assert not _read(tmp_path, payload, target)
    assert torch.equal(target, torch.full(dense.shape, 9, dtype=dense.dtype))
    if value.layout == torch.strided:  # what DCP's read then gives
        assert torch.equal(_reference(payload, target), value.resolve_conj().resolve_neg())


def test_a_deflated_data_record_is_left_to_torch_load_which_inflates_it(tmp_path):
    """A zip writer may compress a record (torch.save does not); `torch.load` inflates
    it, and its record offset points at the compressed bytes, not the tensor's."""
    value = torch.arange(64.0)
    payload = _rezipped(_saved(value), method=zipfile.ZIP_DEFLATED)
    assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), value)
    target = torch.zeros(64)
    done = _read(tmp_path, payload, target)
    assert torch.equal(target, value if done else torch.zeros(64))  # never the deflated bytes
    assert not done


def test_a_stored_record_rewritten_by_another_zip_writer_is_still_read_in_place(tmp_path):
    value = torch.randn(33)
    target = torch.zeros(33)
    assert _read(tmp_path, _rezipped(_saved(value)), target)
    assert torch.equal(target, value)


def test_a_zip64_stored_record_is_read_in_place_bit_for_bit(tmp_path):
    """Records past 4 GiB carry zip64 sizes in their local header's extra field."""
    value = torch.randn(40)
    src = zipfile.ZipFile(io.BytesIO(_saved(value)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            with dst.open(info.filename, "w", force_zip64="/data/" in info.filename) as w:
                w.write(src.read(info))
    payload = out.getvalue()
    assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), value)
    target = torch.zeros(40)
    assert _read(tmp_path, payload, target)
    assert torch.equal(target, value)


def test_an_in_place_read_tells_autograd_as_copy_does(tmp_path):
    """DCP's read `copy_`s into the live tensor, which bumps its version, so a graph
    saved before the load refuses to backpropagate through the changed values; the
    in-place read must not let it compute a gradient from values it never saw."""
    w = torch.nn.Parameter(torch.ones(4))
    y = (w * w).sum()  # saves w
    version = w._version
    assert _read(tmp_path, _saved(torch.full((4,), 3.0)), w.detach())
    assert torch.equal(w.detach(), torch.full((4,), 3.0))
    assert w._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# -- 2. hostile entries: a False return, bounded memory, no crash ---------------------------

def test_a_pickle_memoizing_at_a_huge_index_does_not_grow_memory(tmp_path):
    """`LONG_BINPUT 2**22` (a 40-byte data.pkl): C's unpickler grows its memo array to
    twice the index (here 64 MiB; 2**30 asks 16 GiB), whatever the record's size."""
    pkl = b"\x80\x02N" + b"r" + struct.pack("<I", 2 ** 22) + b"."
    payload = _rezipped(_saved(torch.arange(4.0)), pkl=pkl)
    tracemalloc.start()
    try:
        assert not _read(tmp_path, payload, torch.zeros(4))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB for a {len(pkl)}-byte pickle"


def _big_nesting(depth: int) -> bytes:
    return b"\x80\x02" + b"(" * depth + b")" + b"t" * depth + b"."


@pytest.mark.parametrize(("case", "pkl"), [
    ("a storage type that is a dtype",
     lambda: _layout_pickle(_v2(("storage", torch.float32, "0", "cpu", 4), 0, (4,), (1,)))),
    ("negative size", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage, "0", "cpu", 16),
                                                 0, (-4,), (1,), torch.float32))),
    ("bools for ints", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage, "0", "cpu", 16),
                                                  0, (True,) * 1, (True,), torch.float32))),
    ("huge numel", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage, "0", "cpu", 2 ** 70),
                                              0, (4,), (1,), torch.float32))),
    ("negative offset", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage, "0", "cpu", 16),
                                                   -4, (4,), (1,), torch.float32))),
    ("a key outside data/", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage,
                                                        "../byteorder", "cpu", 16),
                                                       0, (4,), (1,), torch.float32))),
    ("a huge key", lambda: _layout_pickle(_v3(("storage", torch.UntypedStorage, "k" * 200_000,
                                               "cpu", 16), 0, (4,), (1,), torch.float32))),
    ("v2 with metadata", lambda: _layout_pickle(_v2(("storage", torch.FloatStorage, "0", "cpu", 4),
                                                    0, (4,), (1,), {"x": 1}))),
    ("v2 with hooks", lambda: _layout_pickle(_v2(("storage", torch.FloatStorage, "0", "cpu", 4),
                                                 0, (4,), (1,),
                                                 hooks=collections.OrderedDict(a=1)))),
    ("a typed storage of the wrong dtype", lambda: _layout_pickle(
        _v2(("storage", torch.IntStorage, "0", "cpu", 4), 0, (4,), (1,)))),
    ("deep nesting", lambda: _big_nesting(100_000)),
    ("a persistent id that is no tuple", lambda: b"\x80\x02X\x01\x00\x00\x000Q."),
    ("an unknown global", lambda: b"\x80\x02cbuiltins\neval\n."),
    ("truncated", lambda: _layout_pickle(_v2(("storage", torch.FloatStorage, "0", "cpu", 4),
                                             0, (4,), (1,)))[:-7]),
])
def test_a_hostile_data_pkl_is_left_to_dcp_and_changes_nothing(tmp_path, case, pkl):
    payload = _rezipped(_saved(torch.arange(4.0)), pkl=pkl())
    target = torch.full((4,), 7.0)
    assert not _read(tmp_path, payload, target)
    assert torch.equal(target, torch.full((4,), 7.0))


def _central(payload: bytes, suffix: str) -> int:
    """Where the central directory entry of the record named `...suffix` begins."""
    at = payload.index(b"PK\x01\x02")
    while at >= 0:
        n = struct.unpack_from("<H", payload, at + 28)[0]
        if payload[at + 46:at + 46 + n].decode().endswith(suffix):
            return at
        at = payload.find(b"PK\x01\x02", at + 46 + n)
    raise AssertionError(suffix)


def _patched(payload: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(payload)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


@pytest.mark.parametrize(("case", "edit"), [
    ("the data record's header past the entry",
     lambda p: _patched(p, _central(p, "/data/0") + 42, "<I", len(p) + 1000)),
    ("the data record's header at the entry's end",
     lambda p: _patched(p, _central(p, "/data/0") + 42, "<I", len(p) - 10)),
    ("the data record's header on the central directory",
     lambda p: _patched(p, _central(p, "/data/0") + 42, "<I", _central(p, "/data/0"))),
    ("a huge extra field in the local header",
     lambda p: _patched(p, p.index(b"PK\x03\x04", p.index(b"/data/0") - 60) + 28, "<H", 0xFFFF)),
    ("a size of 2**32-1 in the central directory (zip64 marker, no zip64 field)",
     lambda p: _patched(p, _central(p, "/data/0") + 24, "<I", 0xFFFFFFFF)),
    ("an encrypted data record",
     lambda p: _patched(p, _central(p, "/data/0") + 8, "<H", 1)),
])
def test_a_data_record_pointing_elsewhere_is_left_to_dcp_and_changes_nothing(tmp_path, case, edit):
    payload = edit(_rezipped(_saved(torch.arange(16.0))))
    target = torch.full((16,), 7.0)
    assert not _read(tmp_path, payload, target)
    assert torch.equal(target, torch.full((16,), 7.0))


def test_a_quantized_live_tensor_with_a_forged_qint8_entry_is_not_read_into(tmp_path):
    """A v3 pickle may name any dtype; a quantized target holds no plain bytes."""
    target = torch.quantize_per_tensor(torch.zeros(4), 0.5, 0, torch.qint8)
    payload = _rezipped(_saved(torch.zeros(4, dtype=torch.int8)), pkl=_layout_pickle(
        _v3(("storage", torch.UntypedStorage, "0", "cpu", 4), 0, (4,), (1,), torch.qint8)))
    try:
        done = _read(tmp_path, payload, target)
    except CorruptRecordError:
        done = False
    assert not done


# -- 3. a load refused in the planning step reads nothing in place --------------------------

@trainrec.record
class _Micro:
    micro: int


def _model(seed):
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def _flip_a_tensor_byte(path):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    where = next(info for index, info in meta.storage_data.items() if index.fqn.endswith("1.weight"))
    shard = path / "dcp" / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset + where.length - 30] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["a damaged tensor entry", "another state type"])
def test_a_refused_load_reads_nothing_in_place_and_changes_nothing(tmp_path, monkeypatch, how):
    model, opt = _model(0)
    path = trt.DCPRecorder().save(tmp_path / "ck", model, opt, None, _Micro(3))
    into, opt2 = _model(1)
    before = [t.clone() for t in into.state_dict().values()]
    before += [v.clone() for s in opt2.state.values() for v in s.values()]
    calls = []
    real = dcp_reader._read_in_place
    monkeypatch.setattr(dcp_reader, "_read_in_place", lambda *a: calls.append(a) or real(*a))

    @trainrec.record
    class _Other:
        other: str

    if how == "a damaged tensor entry":
        _flip_a_tensor_byte(path)
        with pytest.raises(CorruptRecordError):
            trt.DCPRecorder().load(path, into, opt2, state_type=_Micro)
    else:
        with pytest.raises(trainrec.RecorderError):
            trt.DCPRecorder().load(path, into, opt2, state_type=_Other)
    assert calls == []
    after = [t for t in into.state_dict().values()]
    after += [v for s in opt2.state.values() for v in s.values()]
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    # and the same checkpoint, undamaged, does go the in-place way
    if how != "a damaged tensor entry":
        trt.DCPRecorder().load(path, into, opt2, state_type=_Micro)
        assert calls and all(torch.equal(a, b) for a, b in
                             zip(model.state_dict().values(), into.state_dict().values()))


def test_a_dcp_metadata_memoizing_at_a_huge_index_is_refused_without_growing_memory(tmp_path):
    """The same memo opcode in `.metadata` (its CRC-32 forged into the manifest; its
    unpickler was C's too): refused, without the memory."""
    import zlib

    from trainrec.adapters.torch.dcp_metadata import read_metadata

    pkl = b"\x80\x02N" + b"r" + struct.pack("<I", 2 ** 22) + b"."
    (tmp_path / ".metadata").write_bytes(pkl)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecordError, match=r"\.metadata"):
            read_metadata(tmp_path, {"size": len(pkl), "crc32": zlib.crc32(pkl)}, "x", 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB for a {len(pkl)}-byte pickle"


def test_randomly_damaged_entries_never_raise_and_leave_what_they_refuse_untouched(tmp_path):
    """1 to 4 bytes anywhere in an entry (zip headers, data.pkl, the tensor's bytes), as
    with `verify=False`: a False return leaves the target as it was; no exception."""
    import random

    rng = random.Random(20261201)
    bases = [_saved(torch.arange(16.0)), _rezipped(_saved(torch.arange(16.0)))]
    seen = set()
    for _ in range(400):
        payload = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF,
                                                               rng.randrange(256)])
        target = torch.full((16,), -1.0)
        done = _read(tmp_path, bytes(payload), target)
        seen.add(done)
        if not done:
            assert torch.equal(target, torch.full((16,), -1.0))
    assert seen == {True, False}
