"""`DCPRecorder.load` reads a tensor entry straight into its live target when the entry's
bytes are exactly the target's (`_read_in_place`); DCP's own read loads it into a new
tensor and copies that. Every other entry (another layout, dtype or byte order, part of a
chunk, a pickle that is not one plain tensor) is left to DCP, untouched."""

from __future__ import annotations

import io
import zipfile
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
import trainrec.adapters.torch.dcp_reader as dcp_reader  # noqa: E402
import trainrec.adapters.torch.dcp_zip as dcp_zip  # noqa: E402
from trainrec import CorruptRecordError  # noqa: E402


class _Planner:
    def __init__(self, target):
        self.target, self.committed = target, []

    def resolve_tensor(self, item):
        return self.target

    def commit_tensor(self, item, tensor):
        self.committed.append(tensor)


def _entry(tmp_path, payload: bytes, lead: bytes = b"\x00" * 37):
    """`payload` at an odd offset of a file, as DCP keeps entries one after another."""
    path = tmp_path / "shard.distcp"
    path.write_bytes(lead + payload + b"\xff" * 11)
    return path, SimpleNamespace(offset=len(lead), length=len(payload), transform_descriptors=None)


def _saved(tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def _read(path, where, target, *, lengths=None, offsets=None):
    item = SimpleNamespace(storage_offsets=offsets or (0,) * target.dim(),
                           lengths=tuple(target.shape) if lengths is None else lengths,
                           dest_index=SimpleNamespace(fqn="x"))
    planner = _Planner(target)
    with open(path, "rb") as f:
        done = dcp_zip._read_in_place(f, where, item, planner)
    assert len(planner.committed) == int(done)  # DCP is told of what was read, only
    assert all(t.data_ptr() == target.data_ptr() for t in planner.committed)
    return done


@pytest.mark.parametrize("value", [
    torch.randn(5, 3),
    torch.randn(7).to(torch.bfloat16),
    torch.randn(2, 2).to(torch.float16),
    torch.randn(4, dtype=torch.float64),
    torch.arange(6, dtype=torch.int64).reshape(2, 3),
    torch.tensor([True, False, True]),
    torch.randn(3, dtype=torch.complex64),
    torch.tensor(3.0),  # 0-dim, as Adam's step
    torch.zeros(0, 4),
    torch.randn(4).to(torch.float8_e4m3fn),  # saved by _rebuild_tensor_v3, with its dtype
], ids=lambda v: f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
def test_a_plain_tensor_entry_is_read_straight_into_its_target_bit_for_bit(tmp_path, value):
    path, where = _entry(tmp_path, _saved(value))
    target = torch.full_like(value, 1) if value.dtype != torch.bool else torch.ones_like(value)
    assert _read(path, where, target)
    assert target.dtype == value.dtype
    assert torch.equal(target.view(torch.uint8) if value.dim() else target.reshape(1).view(torch.uint8),
                       value.view(torch.uint8) if value.dim() else value.reshape(1).view(torch.uint8))


def _rewritten(payload: bytes, byteorder=None, data=None) -> bytes:
    """`payload` (torch.save of a tensor) with its byteorder record and its data record
    replaced (`data`: a function of the old bytes)."""
    src = zipfile.ZipFile(io.BytesIO(payload))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            record = src.read(info)
            if info.filename.endswith("/byteorder") and byteorder is not None:
                record = byteorder
            elif "/data/" in info.filename and data is not None:
                record = data(record)
            dst.writestr(info.filename, record)
    return out.getvalue()


def _swapped_to_big_endian(payload: bytes) -> bytes:
    """`payload` (torch.save of a float32 tensor) as a big-endian machine writes it."""
    return _rewritten(payload, b"big", lambda b: torch.frombuffer(bytearray(b), dtype=torch.float32)
                      .numpy().byteswap().tobytes())


def test_a_data_record_shorter_than_its_storage_is_left_to_dcp(tmp_path):
    payload = _rewritten(_saved(torch.randn(6)), data=lambda b: b[:-4])
    path, where = _entry(tmp_path, payload)
    target = torch.zeros(6)
    assert not _read(path, where, target)
    assert torch.equal(target, torch.zeros(6))
    path, where = _entry(tmp_path, _rewritten(_saved(torch.randn(6))))  # the rewrite itself reads
    assert _read(path, where, target)


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('ran')",))


@pytest.mark.parametrize(("case", "make"), [
    ("stored transposed (strides)", lambda: (torch.randn(3, 4).t(), torch.zeros(4, 3))),
    ("stored with a storage offset", lambda: (torch.arange(8.0)[2:], torch.zeros(6))),
    ("another dtype than the target's", lambda: (torch.randn(4), torch.zeros(4, dtype=torch.float64))),
    ("another shape than the target's", lambda: (torch.randn(2, 3), torch.zeros(3, 2))),
    ("a target that is not contiguous", lambda: (torch.randn(3, 4), torch.zeros(4, 3).t())),
    ("a target on another device", lambda: (torch.randn(3), torch.zeros(3, device="meta"))),
    ("a parameter, not a plain tensor", lambda: (torch.nn.Parameter(torch.randn(3)), torch.zeros(3))),
    ("not a tensor at all", lambda: ({"a": torch.randn(3)}, torch.zeros(3))),
    ("a pickle that would run code", lambda: ([_Boom()], torch.zeros(3))),
])
def test_every_other_entry_is_left_to_dcp_untouched(tmp_path, case, make):
    value, target = make()
    path, where = _entry(tmp_path, _saved(value))
    before = target.clone()
    assert not _read(path, where, target)
    assert target.device.type == "meta" or torch.equal(target, before)


def test_a_big_endian_entry_is_left_to_torch_load_which_swaps_it(tmp_path):
    value = torch.randn(6)
    payload = _swapped_to_big_endian(_saved(value))
    assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), value)  # a real one
    path, where = _entry(tmp_path, payload)
    target = torch.zeros(6)
    assert not _read(path, where, target)
    assert torch.equal(target, torch.zeros(6))


def test_part_of_a_chunk_or_a_transformed_entry_is_left_to_dcp(tmp_path):
    path, where = _entry(tmp_path, _saved(torch.randn(4, 3)))
    assert not _read(path, where, torch.zeros(2, 3), lengths=(2, 3), offsets=(2, 0))
    where.transform_descriptors = ["zstd"]
    assert not _read(path, where, torch.zeros(4, 3))


class _Cut(io.BytesIO):
    """A file whose bytes in [cut, stop) are gone, as when it shrinks during a read: the
    zip directory after them still reads."""

    def __init__(self, payload: bytes, cut: int, stop: int) -> None:
        super().__init__(payload)
        self.cut, self.stop, self.name = cut, stop, "shard.distcp"

    def readinto(self, buffer):
        at = self.tell()
        if self.cut <= at < self.stop:
            return 0
        view = memoryview(buffer)
        return super().readinto(view[:self.cut - at] if at < self.cut else view)


def test_an_entry_cut_short_inside_its_bytes_is_a_corrupt_record():
    payload = _saved(torch.randn(1000))
    with io.BytesIO(payload) as f:
        start = torch._C.PyTorchFileReader(f).get_record_offset("data/0")
    where = SimpleNamespace(offset=0, length=len(payload), transform_descriptors=None)
    item = SimpleNamespace(storage_offsets=(0,), lengths=(1000,), dest_index=SimpleNamespace(fqn="w"))
    cut = _Cut(payload, start + 100, start + 4000)
    with pytest.raises(CorruptRecordError, match="ends 3900 bytes before the end of the tensor entry 'w'"):
        dcp_zip._read_in_place(cut, where, item, _Planner(torch.zeros(1000)))


@trainrec.record
class _Micro:
    micro: int


def test_a_dcp_recorder_load_reads_most_entries_in_place_and_the_rest_dcp_s_way(tmp_path, monkeypatch):
    """One process: bf16, float64 and int64 entries (0-dim steps, BatchNorm's counter) in
    place, a transposed parameter DCP's way; all back bit for bit, dtypes kept."""
    from torch import nn

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Module()
        model.lin = nn.Linear(3, 4).to(torch.bfloat16)
        model.norm = nn.BatchNorm1d(4)
        model.wide = nn.Parameter(torch.randn(4, dtype=torch.float64))
        model.turned = nn.Parameter(torch.randn(3, 5).t())  # not contiguous
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        model.norm(torch.randn(6, 4))  # running stats and num_batches_tracked move
        opt.step()
        for p in model.parameters():
            p.grad = torch.randn_like(p)  # pending
        return model, opt

    model, opt = build(0)
    path = trt.DCPRecorder().save(tmp_path / "ck", model, opt, None, _Micro(3))
    into, opt2 = build(1)
    outcomes = []
    real = dcp_reader._read_in_place

    def spy(*args):
        outcomes.append(real(*args))
        return outcomes[-1]

    monkeypatch.setattr(dcp_reader, "_read_in_place", spy)
    back = trt.DCPRecorder().load(path, into, opt2, state_type=_Micro)
    assert back.state.micro == 3
    assert outcomes.count(True) >= 10 and outcomes.count(False) >= 1
    for (name, a), b in zip(model.state_dict().items(), into.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for p, q in zip(model.parameters(), into.parameters()):
        assert torch.equal(p.grad, q.grad) and p.grad.dtype == q.grad.dtype
        for key, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][key]) and v.dtype == opt2.state[q][key].dtype
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
