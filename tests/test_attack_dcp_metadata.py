"""Attacks on DCP's `.metadata` and on the distributed recorders' files (issue 29 items 3-5):
`.metadata` was covered by no checksum (two entries of one length swapped, or a chunk
moved, loaded silently and passed `trainrec verify`), its chunk tiling was checked pairwise
only up to 16 chunks, a 5 MB `.metadata` took 15 s and +990 MB, bit flips raised
AttributeError / KeyError, and permission or read-only errors escaped as OSError.

A forger who recomputes the manifest's CRC-32s is out of a checksum's reach (spec/SECURITY.md):
those cases here forge them, to reach the checks behind the checksum."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import zlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")
from torch import nn  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import ChecksumError, CorruptRecordError, RecorderError  # noqa: E402
from trainrec.adapters.torch.dcp_metadata import check_chunks  # noqa: E402


def _build(seed=0, width=8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _mid_window(model, opt):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model(torch.randn(3, 4)).sum().backward()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A one-process checkpoint mid window (moments, step, pending .grad), and another save."""
    d = tmp_path_factory.mktemp("dcp")
    model, opt = _build()
    _mid_window(model, opt)
    return (trt.DCPRecorder().save(d / "step-3", model, opt),
            trt.DCPRecorder().save(d / "step-4", model, opt))


@pytest.fixture
def ckpt(pristine, tmp_path):
    return Path(shutil.copytree(pristine[0], tmp_path / "step-3"))


def _metadata(path: Path) -> Metadata:
    return FileSystemReader(str(path / "dcp")).read_metadata()


def _write_metadata(path: Path, data: bytes | Metadata, *, forge: bool) -> None:
    """Replace `.metadata`; with `forge`, its size and CRC-32 in the manifest too (a forger)."""
    raw = data if isinstance(data, bytes) else pickle.dumps(data)
    (path / "dcp" / ".metadata").write_bytes(raw)
    if forge:
        doc = json.loads((path / "manifest.json").read_text())
        doc["metadata"] = {"size": len(raw), "crc32": zlib.crc32(raw)}
        (path / "manifest.json").write_text(json.dumps(doc))


def _live():
    model, opt = _build(seed=1)
    _mid_window(model, opt)
    return model, opt


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [p.grad.clone() for p in model.parameters()], repr(opt.state_dict()))


def _unchanged(before, model, opt) -> bool:
    params, grads, sd = before
    return (all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
            and sd == repr(opt.state_dict()))


def _refused(path: Path, error: type, match: str) -> None:
    """`load` and `read_file` (`trainrec verify`) both refuse, the live objects unchanged."""
    model, opt = _live()
    before = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    with pytest.raises(error, match=match):
        trainrec.read_file(path)


# -- 3. .metadata authenticated -------------------------------------------------------------

@pytest.mark.parametrize(("a", "b"), [
    ("model.0.weight", "grads.0.weight"),  # a parameter and its pending gradient
    ("optim.state.0.weight.exp_avg", "optim.state.0.weight.exp_avg_sq"),
])
def test_two_entries_of_one_length_swapped_are_a_checksum_error(ckpt, a, b, capsys):
    meta = _metadata(ckpt)
    index = {i.fqn: i for i in meta.storage_data}
    ia, ib = index[a], index[b]
    assert meta.storage_data[ia].length == meta.storage_data[ib].length
    meta.storage_data[ia], meta.storage_data[ib] = meta.storage_data[ib], meta.storage_data[ia]
    _write_metadata(ckpt, meta, forge=False)
    _refused(ckpt, ChecksumError, r"DCP's \.metadata is damaged: \d+ bytes with CRC-32")
    from trainrec.cli.commands import main

    assert main(["verify", str(ckpt)]) == 1
    assert "CORRUPT" in capsys.readouterr().out


def _chunked(meta: Metadata, name: str, rows: int) -> Metadata:
    """`name`'s one chunk split into chunks of `rows` rows, each pointing to the whole
    entry's bytes (whose CRC-32 the manifest has)."""
    entry = meta.state_dict_metadata[name]
    (index,) = [i for i in meta.storage_data if i.fqn == name]
    info = meta.storage_data.pop(index)
    size = list(entry.size)
    entry.chunks = []
    for r in range(0, size[0], rows):
        offsets, sizes = torch.Size([r, *[0] * (len(size) - 1)]), torch.Size([rows, *size[1:]])
        entry.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        meta.storage_data[MetadataIndex(name, offsets)] = info
    return meta


def test_one_of_17_chunks_moved_by_one_element_is_refused(tmp_path):
    """Beyond 16 chunks the tiling check compared none pairwise: a chunk moved by one row
    (its volume the same, its offset unique) loaded without a word, the rows it no longer
    covered keeping their live values."""
    model, opt = _build(width=34)
    _mid_window(model, opt)
    path = trt.DCPRecorder().save(tmp_path / "step", model, opt)
    meta = _chunked(_metadata(path), "model.0.weight", 2)  # 17 chunks of [2, 4]
    _write_metadata(path, meta, forge=True)
    trainrec.read_file(path)  # 17 chunks that tile it: accepted
    moved = meta.state_dict_metadata["model.0.weight"].chunks[5]
    info = meta.storage_data.pop(MetadataIndex("model.0.weight", moved.offsets))
    moved.offsets = torch.Size([11, 0])
    meta.storage_data[MetadataIndex("model.0.weight", moved.offsets)] = info
    _write_metadata(path, meta, forge=True)
    model2, opt2 = _build(seed=1, width=34)
    _mid_window(model2, opt2)
    before = _snapshot(model2, opt2)
    match = (r"chunks of model\.0\.weight do not cover its shape \[34, 4\] once \(136 elements "
             r"in 17 non-empty chunk\(s\): along dimension 0 one starts at 11")
    with pytest.raises(CorruptRecordError, match=match):
        trt.DCPRecorder().load(path, model2, opt2)
    assert _unchanged(before, model2, opt2)
    with pytest.raises(CorruptRecordError, match=match):
        trainrec.read_file(path)


def _tensor(size, chunks):
    meta = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage = {MetadataIndex("t", torch.Size(o)): None for o, _ in chunks}
    return Metadata(state_dict_metadata={"t": meta}, storage_data=storage)


def _grid(rows, cols, n, m):
    return [((r, c), (min(rows // n, rows - r), min(cols // m, cols - c)))
            for r in range(0, rows, rows // n) for c in range(0, cols, cols // m)]


@pytest.mark.parametrize(("size", "chunks", "problem"), [
    ([34], [((2 * i,), (2,)) for i in range(17)], None),
    ([34], [((2 * i + (i == 5),), (2,)) for i in range(17)], r"one starts at 11, leaving 10\.\.11"),
    ([34], [((2 * i - (i == 6),), (2,)) for i in range(17)], "one starts at 11, overlapping"),
    ([34], [((2 * i,), (2,)) for i in range(17) if i != 9], r"leaving 18\.\.20 uncovered"),
    ([34], [((2 * i,), (2,)) for i in range(17)] + [((4,), (2,))], "two at one place"),
    ([34], [((2 * i,), (2,)) for i in range(17)] + [((30,), (0,))], None),  # empty: ignored
    ([6, 10], _grid(6, 10, 3, 5), None),  # a 3 x 5 grid (2-D sharding)
    ([6, 10], _grid(6, 10, 3, 5)[:-1] + [((4, 8), (2, 1)), ((4, 9), (2, 1))], None),  # a band's
    ([6, 10], [((0, 0), (3, 10)), ((3, 0), (3, 5)), ((3, 5), (3, 5))], None),  # own grid
    ([6, 10], [((0, 0), (3, 10)), ((3, 0), (3, 5))], "along dimension 1 they end at 5"),
    ([6, 10], _grid(6, 10, 3, 5) + [((2, 4), (2, 2))], "two at one place, overlapping"),
    ([6, 10], [((0, 0), (6, 4)), ((0, 4), (6, 6)), ((0, 3), (6, 7))], "overlapping"),
    ([], [((), ())], None),  # a 0-d step
    ([0, 3], [((0, 0), (0, 3))], None),  # nothing to cover
])
def test_the_tiling_check_takes_any_number_of_chunks(size, chunks, problem):
    meta = _tensor(size, chunks)
    if problem is None:
        check_chunks(meta, Path("x"))
    else:
        with pytest.raises(CorruptRecordError, match=problem):
            check_chunks(meta, Path("x"))


def test_the_tiling_check_takes_tens_of_thousands_of_chunks():
    """20 000 chunks (a 1-D tensor over 20 000 ranks), one moved: the pairwise check was
    2e8 pairs (and skipped beyond 16 chunks); sorted, each band is checked once."""
    chunks = [((2 * i,), (2,)) for i in range(20_000)]
    check_chunks(_tensor([40_000], chunks), Path("x"))
    chunks[12_345] = ((24_691,), (2,))
    with pytest.raises(CorruptRecordError, match="one starts at 24691"):
        check_chunks(_tensor([40_000], chunks), Path("x"))


def test_a_dcp_folder_of_another_save_is_named_as_such(ckpt, pristine):
    """It was 'shard file __0_0.distcp is damaged': the disk was blamed."""
    shutil.rmtree(ckpt / "dcp")
    shutil.copytree(pristine[1] / "dcp", ckpt / "dcp")
    other = json.loads((pristine[1] / "manifest.json").read_text())["save_id"]
    match = rf"the dcp/ folder is another save's: its \.metadata was written by save '{other}'"
    _refused(ckpt, CorruptRecordError, match)
    try:
        trainrec.read_file(ckpt)
    except CorruptRecordError as e:
        assert not isinstance(e, ChecksumError) and "damaged" not in str(e)


# -- 4. bounded ------------------------------------------------------------------------------

def _verify_in_a_child(path: Path, timeout: float = 30) -> dict:
    """`trainrec verify path` in a forked child (this process's imports done: only the
    verify is measured): its exit code, CPU seconds and peak memory growth, or a kill
    after `timeout` seconds (tests/bounded_runner.py's way, without its imports of every
    framework)."""
    import contextlib
    import io
    import resource
    import select
    import signal
    import time

    from trainrec.cli.commands import main

    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(rd)
        start = resource.getrusage(resource.RUSAGE_SELF)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                outcome = f"exit {main(['verify', str(path)])}"
        except BaseException as e:  # noqa: BLE001 - reported
            outcome = f"raised {type(e).__name__}: {e}"
        end = resource.getrusage(resource.RUSAGE_SELF)
        os.write(wr, json.dumps({"outcome": outcome[:300],
                                 "rss_mib": (end.ru_maxrss - start.ru_maxrss) / 1024,
                                 "cpu_s": end.ru_utime + end.ru_stime - start.ru_utime
                                 - start.ru_stime}).encode())
        os._exit(0)
    os.close(wr)
    deadline, chunks = time.monotonic() + timeout, []
    while select.select([rd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(rd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(rd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks)) if chunks else {"outcome": "killed", "cpu_s": timeout,
                                                        "rss_mib": 0}


def test_a_huge_or_heavy_metadata_is_refused_within_a_second_and_bounded_memory(pristine, tmp_path):
    """A 5 MB .metadata of empty dicts took 15 s and +990 MB (its CRC-32 forged into the
    manifest); now at most 64 KiB + 2 KiB a shard entry is read, and at most 16 Ki + 512
    pickle opcodes an entry are run. Each case is `trainrec verify` in a forked child."""
    paths = {}
    entries = sum(len(f["items"]) for part in json.loads(
        (pristine[0] / "manifest.json").read_text())["shards"] for f in part.values())
    bodies = {
        "5 MB": b"\x80\x04](" + b"}" * (5 << 20) + b"e.",
        # within the byte budget, 1-byte opcodes far beyond the opcode budget
        "heavy": b"\x80\x04](" + b"}" * (60 << 10) + b"e.",
    }
    assert len(bodies["heavy"]) < (64 << 10) + (2 << 10) * entries
    for name, body in bodies.items():
        path = Path(shutil.copytree(pristine[0], tmp_path / name.replace(" ", "")))
        _write_metadata(path, body, forge=True)
        paths[name] = path
    trainrec.read_file(pristine[0])  # the reader's imports, before the forks
    for name, path in paths.items():
        r = _verify_in_a_child(path)
        assert r["outcome"] == "exit 1", (name, r)
        assert r["cpu_s"] < 1 and r["rss_mib"] < 64, (name, r)
    with pytest.raises(CorruptRecordError, match=r"holds 5242\d+ bytes, more than the \d+ a "
                       r"checkpoint of this many shard entries can need"):
        trt.DCPRecorder().load(paths["5 MB"], *_live())
    with pytest.raises(CorruptRecordError, match="needs more than .* pickle opcodes"):
        trt.DCPRecorder().load(paths["heavy"], *_live())


# -- 5. only RecorderError -------------------------------------------------------------------

def test_metadata_bit_flips_are_recorder_errors_and_change_nothing_when_refused(ckpt):
    """132 of 18,200 flips of a .metadata raised AttributeError or KeyError. Each flip
    here has its CRC-32 recomputed into the manifest (a forger: else every one is a
    ChecksumError, checked first), so the checks behind the checksum see it."""
    raw = (ckpt / "dcp" / ".metadata").read_bytes()
    manifest = (ckpt / "manifest.json").read_text()
    rng = random.Random(20261203)
    model, opt = _live()
    outcomes = set()
    for i in range(96):
        data = bytearray(raw)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (ckpt / "manifest.json").write_text(manifest)
        _write_metadata(ckpt, bytes(data), forge=i % 8 != 0)
        before = _snapshot(model, opt)
        try:
            trt.DCPRecorder().load(ckpt, model, opt)
            outcomes.add("loaded")
        except RecorderError as e:
            outcomes.add(type(e).__name__)
            assert _unchanged(before, model, opt), e
            if i % 8 == 0:
                assert isinstance(e, ChecksumError), e
        try:
            trainrec.read_file(ckpt)
        except RecorderError:
            pass
    assert {"ChecksumError", "CorruptRecordError"} <= outcomes


def _fail_on(monkeypatch, target, name, error, when=lambda *a: True):
    real = getattr(target, name)

    def fail(*args, **kwargs):
        if when(*args):
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fail)


_DENIED = PermissionError(errno.EACCES, "Permission denied")
_READ_ONLY = OSError(errno.EROFS, "Read-only file system")


@pytest.mark.parametrize("error", [_DENIED, _READ_ONLY], ids=["EACCES", "EROFS"])
@pytest.mark.parametrize("where", ["temp directory", "part", "dcp", "manifest"])
def test_permission_and_read_only_errors_of_a_save_are_recorder_errors(tmp_path, monkeypatch, error, where):
    """They escaped as PermissionError / OSError (root here ignores chmod: the errors are
    injected where the file system would raise them); the previous checkpoint is kept."""
    from torch.distributed.checkpoint import FileSystemWriter

    from trainrec.adapters.torch import distributed_commit

    model, opt = _build()
    _mid_window(model, opt)
    old = trt.DCPRecorder().save(tmp_path / "step-1", model, opt)
    rng = trt.TorchRngRecord.capture()
    ddp_path = trt.DistributedRecorder().record(rng, tmp_path / "ddp-1")
    kept = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    if where == "temp directory":
        _fail_on(monkeypatch, Path, "mkdir", error)
    elif where == "part":
        _fail_on(monkeypatch, trainrec.NamedMpkFileRecorder, "save_item", error)
    elif where == "dcp":
        _fail_on(monkeypatch, FileSystemWriter, "write_data", error)
    else:
        _fail_on(monkeypatch, distributed_commit, "atomic_write", error)
    with pytest.raises(RecorderError, match=error.strerror):
        trt.DCPRecorder().save(tmp_path / "step-2", model, opt)
    if where != "dcp":
        with pytest.raises(RecorderError, match=error.strerror):
            trt.DistributedRecorder().record(rng, tmp_path / "ddp-2")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ddp-1", "step-1"]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == kept
    trt.DCPRecorder().load(old, *_build())
    assert trt.DistributedRecorder().load(ddp_path, None, trt.TorchRngRecord) == rng


@pytest.mark.parametrize("file", ["manifest.json", ".metadata", "__0_0.distcp", "rank-00000-of-00001.mpk"])
def test_a_file_that_cannot_be_read_is_a_recorder_error_not_damage(ckpt, monkeypatch, file):
    """A permission error reading the manifest was 'unreadable manifest.json' (a
    CorruptRecordError: `trainrec verify` said CORRUPT); .metadata's was a raw OSError."""
    import builtins

    real_open, real_os_open = builtins.open, os.open

    def denied(target):
        return Path(str(target)).name == file

    def fake_open(target, *args, **kwargs):
        if denied(target):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real_open(target, *args, **kwargs)

    def fake_os_open(target, *args, **kwargs):
        if denied(target):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real_os_open(target, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    model, opt = _live()
    before = _snapshot(model, opt)
    with pytest.raises(RecorderError, match="Permission denied") as raised:
        trt.DCPRecorder().load(ckpt, model, opt)
    assert not isinstance(raised.value, CorruptRecordError), raised.value
    assert _unchanged(before, model, opt)
    with pytest.raises(RecorderError, match="Permission denied") as raised:
        trainrec.read_file(ckpt)
    assert not isinstance(raised.value, CorruptRecordError), raised.value
