"""Attacks on the loaders (issue 14, items 1 and 2): no silently changed load in any format,
and every load bounded in memory and time whatever the file says.

The crafted files are built here; `bounded_runner.py` loads each in a forked child and
reports the outcome, the peak RSS growth and the CPU time of that load alone.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import random
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from same_items import same

import trainrec
import trainrec.format as fmt
from trainrec import (
    FullPrecisionSettings,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    UnsupportedVersionError,
)

HERE = Path(__file__).parent
MIB = 1 << 20
CPU_S = 1.5
"""Every refusal within 1.5 s of CPU time (CPU, not wall: the CI machine is shared). The
object budget is what bounds the work (the heaviest case, maps of empty maps, stops at it
after 0.8-1.06 s alone on the 2-core VM); the room above a second is for a core that the
parallel suite (pytest -n auto) shares, which slows even CPU time."""
SLACK_MIB = 48
"""Fixed overhead a load may use beyond the file and the object budget (allocator, buffers)."""


def _small_item():
    return {"w": TensorData.from_array(np.arange(4, dtype=np.float32)),
            "opt": {"maximize": False, "lr": 0.01, "betas": [0.9, 0.999], "name": "adam",
                    "blob": b"\x01", "none": None, "step": 7}}


def _torch():
    return pytest.importorskip("trainrec.adapters.torch")


def _flax():
    return pytest.importorskip("trainrec.adapters.jax.recorder")


# -- item 1: every single-bit flip is refused ----------------------------------------------


def _every_flip_is_refused(recorder, path: Path) -> None:
    data = path.read_bytes()
    case = path.with_name("flipped" + path.suffix)
    case.write_bytes(data)
    loaded = []
    fd = os.open(case, os.O_WRONLY)
    try:
        for i in range(len(data)):
            for bit in range(8):
                os.pwrite(fd, bytes([data[i] ^ (1 << bit)]), i)  # in place: no truncation
                try:
                    recorder.load_item(case)
                    loaded.append((i, bit))
                except RecorderError:
                    pass
            os.pwrite(fd, data[i : i + 1], i)
    finally:
        os.close(fd)
    assert loaded == [], f"{len(loaded)} of {8 * len(data)} single-bit flips loaded, e.g. {loaded[:5]}"


def test_every_single_bit_flip_of_a_pt_record_is_refused(tmp_path):
    trt = _torch()
    r = trt.TorchFileRecorder(NativePrecisionSettings())
    path = r.save_item({"maximize": False, "w": TensorData.from_array(np.ones(2, np.float32))},
                       tmp_path / "small.pt")
    _every_flip_is_refused(r, path)


def test_every_single_bit_flip_of_a_flax_record_is_refused(tmp_path):
    fl = _flax()
    r = fl.FlaxMsgpackFileRecorder(NativePrecisionSettings())
    _every_flip_is_refused(r, r.save_item(_small_item(), tmp_path / "small.msgpack"))


def test_the_maximize_flip_of_the_issue_is_refused(tmp_path):
    """The attack that started it: `maximize=False` flipped to True in the file."""
    trt, fl = _torch(), _flax()
    for r, name in ((trt.TorchFileRecorder(), "x.pt"), (fl.FlaxMsgpackFileRecorder(), "x.msgpack")):
        path = r.save_item(_small_item(), tmp_path / name)
        data = path.read_bytes()
        at = data.index(b"maximize") + len(b"maximize")
        at += data[at:].index(b"\xc2" if name.endswith("msgpack") else b"\x89")  # False: msgpack / pickle
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
        with pytest.raises(trainrec.ChecksumError, match="file checksum"):
            r.load_item(path)


def test_version_1_adapter_files_are_refused_with_the_reason(tmp_path):
    trt, fl = _torch(), _flax()
    import torch

    pt = trt.TorchFileRecorder().save_item({"a": 1}, tmp_path / "x.pt")
    doc = torch.load(pt, weights_only=True)
    doc["version"] = [1, 0]
    torch.save(doc, pt)
    with pytest.raises(UnsupportedVersionError, match="1.0 is not supported.*no checksum"):
        trt.TorchFileRecorder().load_item(pt)
    f = fl.FlaxMsgpackFileRecorder().save_item({"a": 1}, tmp_path / "x.msgpack")
    doc = msgpack.unpackb(f.read_bytes())
    doc["version"] = [1, 0]
    del doc["crc"]
    f.write_bytes(msgpack.packb(doc))
    with pytest.raises(UnsupportedVersionError, match="1.0 is not supported.*no checksum"):
        fl.FlaxMsgpackFileRecorder().load_item(f)


def test_adapter_files_still_load_in_plain_torch_and_msgpack(tmp_path):
    trt, fl = _torch(), _flax()
    import torch

    pt = trt.TorchFileRecorder().save_item(_small_item(), tmp_path / "x.pt")
    assert torch.load(pt, weights_only=True)["item"]["opt"]["maximize"] is False
    assert zipfile.ZipFile(pt).testzip() is None
    f = fl.FlaxMsgpackFileRecorder().save_item(_small_item(), tmp_path / "x.msgpack")
    doc = msgpack.unpackb(f.read_bytes(), strict_map_key=False)
    assert doc["crc"] == zlib.crc32(f.read_bytes()[:-4]) and doc["item"]["opt"]["lr"] == 0.01


def test_verify_says_what_it_checked(tmp_path, capsys):
    from trainrec.cli.commands import main

    fl = _flax()
    ours = fl.FlaxMsgpackFileRecorder().save_item(_small_item(), tmp_path / "x.msgpack")
    plain = tmp_path / "plain.msgpack"
    plain.write_bytes(msgpack.packb({"params": {"w": 1.0}}))
    assert main(["verify", str(ours)]) == 0
    assert "file checksum over every byte" in capsys.readouterr().out
    assert main(["verify", str(plain)]) == 0
    assert "verified: nothing" in capsys.readouterr().out


# -- the object budget: what saves loads, what a reader refuses a writer refuses ------------


@pytest.mark.parametrize("settings", [NativePrecisionSettings(), FullPrecisionSettings()],
                         ids=["native", "full"])
def test_the_writer_charges_what_the_reader_charges(settings):
    t = TensorData.from_array(np.float32(1.0))
    wide = TensorData.from_array(np.arange(6, dtype=np.float64).reshape(2, 3))  # Full: a "dtype" key
    items = [[t] * 100, {str(i): {"step": t, "m": [1, 200, -5, -100, 1.5, "a" * 40, "b", b"xx", None,
                                                   True, {}, []]} for i in range(50)},
             {}, [[]], {"u": "é" * 20}, [2**63, -(2**63)], [wide] * 20]
    for item in items:
        out = io.BytesIO()
        w = fmt.writer._Writer(out, settings)
        fmt.writer._write(w, item, settings, "Item", fmt.Limits())
        data = out.getvalue()
        p = fmt.parser._Parser(data, "<bytes>", fmt.Limits(), eager=True)
        fmt.reader._read_header(p)
        p.value("", 1)
        p.value("item", 1)
        p.value("", 1)
        p.value("item_crc", 1)
        assert fmt.Limits().object_budget(len(data)) - p.budget == w.cost


def test_an_item_too_heavy_for_its_size_fails_to_save_not_to_load(tmp_path):
    heavy = [{"a": 1}] * 300_000  # 4 bytes each in the file, ~170 bytes each in memory
    with pytest.raises(trainrec.CorruptRecordError, match="object budget"):
        NamedMpkBytesRecorder().save_item(heavy)
    path = tmp_path / "h.mpk"
    with pytest.raises(trainrec.CorruptRecordError, match="object budget"):
        NamedMpkFileRecorder().save_item(heavy, path)
    assert not path.exists()
    light = [{"a": 1}] * 20_000
    assert NamedMpkBytesRecorder().load_item(NamedMpkBytesRecorder().save_item(light)) == light
    many = list(range(1_000_000)) + [0.5] * 100_000  # scalars: budgeted at their real cost
    assert NamedMpkBytesRecorder().load_item(NamedMpkBytesRecorder().save_item(many)) == many


# -- item 2: the attack corpus ----------------------------------------------------------------


def _mpk_with_raw_item(raw_item: bytes) -> bytes:
    out = io.BytesIO()
    fmt.write_document(out, None, NativePrecisionSettings(), "Item")
    base = out.getvalue()
    cut = base.index(b"\xa4item") + 5
    return base[:cut] + raw_item + msgpack.packb("item_crc") + msgpack.packb(zlib.crc32(raw_item))


def _empty_maps(total: int) -> bytes:
    """About `total` bytes of msgpack: lists of 1000 empty maps."""
    n = total // 1003
    return b"\xdd" + n.to_bytes(4, "big") + (b"\xdc\x03\xe8" + b"\x80" * 1000) * n


def _maps_of_empty_maps(total: int) -> bytes:
    """About `total` bytes: maps of 1000 distinct keys, each to an empty map."""
    one = b"\xde\x03\xe8" + b"".join(msgpack.packb(f"k{i:03d}") + b"\x80" for i in range(1000))
    n = total // len(one)
    return b"\xdd" + n.to_bytes(4, "big") + one * n


def _big_dims_tensor() -> bytes:
    return (b"\x85" + msgpack.packb("__tensor__") + msgpack.packb("f32") + msgpack.packb("shape")
            + msgpack.packb([0, 2**63]) + msgpack.packb("pad") + b"\xc4\x00" + msgpack.packb("data")
            + b"\xc6\x00\x00\x00\x00" + msgpack.packb("crc") + msgpack.packb(0))


def _huge_header() -> bytes:
    settings = b"\xdf" + (300_000).to_bytes(4, "big") + b"".join(
        msgpack.packb(f"k{i:06d}") + b"\x00" for i in range(300_000))
    return (b"\x88" + msgpack.packb("format") + msgpack.packb(fmt.FORMAT_NAME) + msgpack.packb("version")
            + msgpack.packb([1, 0]) + msgpack.packb("trainrec") + msgpack.packb("0") + msgpack.packb("settings")
            + settings + msgpack.packb("record") + msgpack.packb("Item"))


def _sparse(path: Path, size: int, prefix: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(size)
    return path


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0)


def _gz_zeros(n: int) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    zero = bytes(16 * MIB)
    return b"".join(c.compress(zero) for _ in range(n // len(zero))) + c.flush()


def _pt_trailer(zip_bytes: bytes) -> bytes:
    """`zip_bytes` with trainrec's file checksum: an attacker can write it as well as we can."""
    assert zip_bytes[-22:-18] == b"PK\x05\x06"
    body = zip_bytes[:-2] + (19).to_bytes(2, "little") + b"trainrec.crc32:"
    return body + zlib.crc32(body).to_bytes(4, "big")


def _pt_doc(item, checksums):
    return {"format": "trainrec.torch", "version": [2, 0], "trainrec": "0.1.0",
            "settings": {"name": "native", "float": None, "int": None}, "record": "Item",
            "item": item, "checksums": checksums}


def _pt(item, checksums) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(_pt_doc(item, checksums), buf)
    return _pt_trailer(buf.getvalue())


def _pt_cases(d: Path) -> dict[str, Path]:
    import torch

    out = {}
    laughs: object = ["lol"] * 10
    for _ in range(30):
        laughs = [laughs] * 10
    out["pt-billion-laughs"] = _pt(laughs, [])
    out["pt-stride-0"] = _pt(torch.zeros(1).expand(2**28), [0])
    out["pt-stride-0-2**62"] = _pt(torch.zeros(1).expand(2**62), [0])
    out["pt-requires-grad"] = _pt(torch.ones(3, requires_grad=True), [0])
    out["pt-shared-storage"] = _pt([torch.ones(4)] * 2, [0, 0])
    # a storage record deflated: 64 MiB of zeros in 64 KiB of file
    buf = io.BytesIO()
    torch.save(_pt_doc(torch.zeros(16 * MIB // 4), [0]), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as z:
        for info in src.infolist():
            deflate = "/data/" in info.filename  # only the storage: the pickle is as torch wrote it
            z.writestr(info.filename, src.read(info.filename),
                       compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    out["pt-deflated-storage"] = _pt_trailer(packed.getvalue())
    paths = {}
    for name, data in out.items():
        paths[name] = d / f"{name}.pt"
        paths[name].write_bytes(data)
    return paths


def _flax_doc(raw_item: bytes) -> bytes:
    """A flax envelope around `raw_item`, file checksum and all."""
    header = {"format": "trainrec.flax", "version": [2, 0], "trainrec": "0.1.0",
              "settings": {"name": "native", "float": None, "int": None}, "record": "Item"}
    body = (b"\x88" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in header.items())
            + msgpack.packb("item") + raw_item + msgpack.packb("checksums") + msgpack.packb([])
            + msgpack.packb("crc") + b"\xce")
    return body + zlib.crc32(body).to_bytes(4, "big")


def _flax_big_dims() -> bytes:
    inner = msgpack.packb([[0, 2**63], "float32", b""], use_bin_type=True)
    return msgpack.packb({"t": msgpack.ExtType(1, inner)}, use_bin_type=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{case id: (recorder, path, mmap)}, and each file's size."""
    d = tmp_path_factory.mktemp("attacks")
    files = {
        "mpk-empty-maps": _mpk_with_raw_item(_empty_maps(4 * MIB)),
        "mpk-maps-of-empty-maps": _mpk_with_raw_item(_maps_of_empty_maps(4 * MIB)),
        "mpk-huge-header": _huge_header(),
        "mpk-zero-size-dim-2**63": _mpk_with_raw_item(_big_dims_tensor()),
    }
    files["gz-empty-maps"] = _gz(files["mpk-empty-maps"])
    files["gz-bomb"] = _gz_zeros(256 * MIB)
    files["flax-empty-maps"] = _flax_doc(_empty_maps(4 * MIB))
    files["flax-maps-of-empty-maps"] = _flax_doc(_maps_of_empty_maps(4 * MIB))
    files["flax-zero-size-dim-2**63"] = _flax_big_dims()
    paths = {}
    for name, data in files.items():
        paths[name] = d / name
        paths[name].write_bytes(data)
    paths["sparse-64g"] = _sparse(d / "sparse-64g", 64 << 30)
    paths["flax-sparse-16g"] = _sparse(d / "flax-sparse-16g", 16 << 30)
    paths["flax-header-then-sparse-16g"] = _sparse(d / "flax-header-then-sparse-16g", 16 << 30,
                                                   _flax_doc(b"\xc0")[:120])
    paths["mpk-header-then-sparse-64g"] = _sparse(d / "mpk-header-then-sparse-64g", 64 << 30,
                                                  _mpk_with_raw_item(b"\xc0")[:120])
    try:
        paths.update(_pt_cases(d))
    except ImportError:
        pass
    cases = []

    def add(id_, recorder, path, **kw):
        cases.append({"id": id_, "kind": "load", "recorder": recorder, "path": str(path), **kw})

    for name in ("mpk-empty-maps", "mpk-maps-of-empty-maps", "mpk-huge-header", "mpk-zero-size-dim-2**63"):
        add(name, "mpk", paths[name])
        add(name + " (mmap)", "mpk", paths[name], mmap=True)
        add(name + " (bytes)", "bytes", paths[name])
    for name in ("gz-empty-maps", "gz-bomb"):
        add(name, "gz", paths[name])
    add("sparse-64g", "mpk", paths["sparse-64g"])
    add("mpk-header-then-sparse-64g", "mpk", paths["mpk-header-then-sparse-64g"])
    add("mpk-header-then-sparse-64g (mmap)", "mpk", paths["mpk-header-then-sparse-64g"], mmap=True)
    have_flax = _importable("jax") and _importable("ml_dtypes")
    if have_flax:
        for name in ("flax-empty-maps", "flax-maps-of-empty-maps", "flax-zero-size-dim-2**63",
                     "flax-sparse-16g"):
            add(name, "flax", paths[name])
            add(name + " (mmap)", "flax", paths[name], mmap=True)
        add("flax-header-then-sparse-16g", "flax", paths["flax-header-then-sparse-16g"])
        add("flax-header-then-sparse-16g (mmap)", "flax", paths["flax-header-then-sparse-16g"], mmap=True)
    for name in [n for n in paths if n.startswith("pt-")]:
        add(name, "torch", paths[name])
        add(name + " (mmap)", "torch", paths[name], mmap=True)
    # every CLI command reads through the same recorders
    cli_files = ["sparse-64g", "mpk-empty-maps", "gz-bomb", "mpk-header-then-sparse-64g"]
    cli_files += ["flax-sparse-16g", "flax-empty-maps", "flax-header-then-sparse-16g"] if have_flax else []
    cli_files += [n for n in ("pt-billion-laughs", "pt-stride-0") if n in paths]
    for name in cli_files:
        for cmd in ("inspect", "verify"):
            cases.append({"id": f"{cmd} {name}", "kind": "cli", "argv": [cmd, str(paths[name])]})
    cases.append({"id": f"diff {cli_files[1]}", "kind": "cli",
                  "argv": ["diff", str(paths[cli_files[1]]), str(paths[cli_files[1]])]})
    cases.append({"id": f"convert {cli_files[1]}", "kind": "cli",
                  "argv": ["convert", str(paths[cli_files[1]]), str(d / "out.mpk"), "--to", "mpk"]})
    sizes = {c["id"]: _case_size(c) for c in cases}
    return cases, sizes, d


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _case_size(case) -> int:
    """The bytes a case's load may hold: its file, or its decompressed gzip content
    (its first chunk when that is not NamedMpk), resident pages not counted for sparse
    files (a hole takes no memory until read)."""
    path = Path(case.get("path") or case["argv"][1])
    st = path.stat()
    size = min(st.st_size, st.st_blocks * 512)
    if path.name.startswith("gz-") and path.name != "gz-bomb":
        size = len(gzip.decompress(path.read_bytes()))
    return size


def _run_corpus(cases, d: Path) -> dict[str, dict]:
    spec = d / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, str(HERE / "bounded_runner.py"), str(spec)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["id"]: r for r in map(json.loads, out.stdout.splitlines())}


def test_every_attack_is_a_recorder_error_within_a_second_and_bounded_memory(corpus):
    cases, sizes, d = corpus
    results = _run_corpus(cases, d)
    # CPU time grows when another process shares the core (the suite runs on every core):
    # a case over CPU_S is measured again, alone; bounded work stays under it, unbounded work
    # (a parse that grows with the attack) does not
    slow = [c for c in cases if results[c["id"]]["cpu_s"] > CPU_S]
    if slow:
        again = _run_corpus(slow, d)
        for case in slow:
            if again[case["id"]]["cpu_s"] < results[case["id"]]["cpu_s"]:
                results[case["id"]] = again[case["id"]]
    bad = []
    for case in cases:
        r = results[case["id"]]
        size_mib = sizes[case["id"]] / MIB
        # the object budget: 16 MiB + 8 bytes per byte of document (Limits.object_budget)
        allowed = size_mib + 16 + 8 * size_mib + SLACK_MIB
        ok_outcome = (r["outcome"].startswith("RecorderError") if case["kind"] == "load"
                      else r["outcome"] in ("exit 1", "exit 3"))
        if not ok_outcome or r["cpu_s"] > CPU_S or r["rss_mib"] > allowed:
            bad.append(f"{case['id']}: {r['outcome'][:120]} cpu {r['cpu_s']:.2f}s "
                       f"rss +{r['rss_mib']:.0f} MiB (allowed {allowed:.0f})")
    assert not bad, "\n".join(bad)


# -- the seeded fuzzer: a fixed budget per recorder ------------------------------------------


def _fuzz_recorders():
    out = {"mpk": NamedMpkFileRecorder(NativePrecisionSettings()),
           "gz": NamedMpkGzFileRecorder(NativePrecisionSettings()),
           "bytes": NamedMpkBytesRecorder(NativePrecisionSettings())}
    if _importable("torch"):
        from trainrec.adapters.torch import TorchFileRecorder

        out["torch"] = TorchFileRecorder(NativePrecisionSettings())
    if _importable("jax"):
        from trainrec.adapters.jax.recorder import FlaxMsgpackFileRecorder

        out["flax"] = FlaxMsgpackFileRecorder(NativePrecisionSettings())
    return out


FUZZ = _fuzz_recorders()
FUZZ_CASES = {"mpk": 400, "gz": 300, "bytes": 400, "torch": 250, "flax": 400}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        if not b:
            break
        i = rng.randrange(len(b))
        op = rng.choice(("flip", "flip", "set", "cut", "insert", "delete", "swap", "len"))
        if op == "flip":
            b[i] ^= 1 << rng.randrange(8)
        elif op == "set":
            b[i] = rng.choice((0, 0x7F, 0x80, 0x90, 0xC0, 0xC4, 0xCE, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF,
                               rng.randrange(256)))
        elif op == "cut":
            del b[i:]
        elif op == "insert":
            b[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == "delete":
            del b[i : i + rng.randrange(1, 9)]
        elif op == "swap":
            j = rng.randrange(len(b))
            b[i], b[j] = b[j], b[i]
        else:  # a length field made huge
            b[i : i + 4] = rng.choice((b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x01\x00\x00"))
    return bytes(b)


@pytest.mark.parametrize("name", list(FUZZ))
def test_fuzzed_files_never_load_changed_and_fail_only_with_recorder_errors(name, tmp_path):
    import time

    r = FUZZ[name]
    item = _small_item()
    item["m"] = TensorData.from_array(np.arange(12, dtype=np.int16).reshape(3, 4))
    valid = r.save_item(item, None) if name == "bytes" else r.save_item(item, tmp_path / f"v.{name}").read_bytes()
    original = r.load_item(valid if name == "bytes" else tmp_path / f"v.{name}")
    rng = random.Random(f"trainrec-fuzz-{name}")
    changed, slow, other = [], [], []
    path = tmp_path / f"case.{name}"
    for n in range(FUZZ_CASES[name]):
        data = _mutate(rng, valid)
        if name != "bytes":
            path.write_bytes(data)
        t0 = time.process_time()
        try:
            got = r.load_item(data if name == "bytes" else path)
        except RecorderError:
            got = None
        except Exception as e:  # noqa: BLE001 - collected and reported
            other.append(f"case {n}: {type(e).__name__}: {e}")
            continue
        if time.process_time() - t0 > CPU_S:
            slow.append(n)
        if got is not None and not same(got, original):
            changed.append(n)
    assert (changed, other, slow) == ([], [], [])


def test_the_zero_size_dims_and_budgets_name_the_problem():
    with pytest.raises(trainrec.CorruptRecordError, match="larger than any array"):
        NamedMpkBytesRecorder().load_item(_mpk_with_raw_item(_big_dims_tensor()))
    with pytest.raises(trainrec.CorruptRecordError, match="object budget"):
        NamedMpkBytesRecorder().load_item(_mpk_with_raw_item(_empty_maps(4 * MIB)))
    with pytest.raises(trainrec.CorruptRecordError, match="header larger than"):
        NamedMpkBytesRecorder().load_item(_huge_header())
    assert math.prod([0, 2**63]) == 0  # the dimension alone is the problem
