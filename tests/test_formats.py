"""The format registry (`trainrec.recorders.formats`) and reading every trainrec file with only core:
`.pt` without torch (`trainrec.recorders.ptfile`), flax msgpack without jax (`trainrec.recorders.flaxmsgpack`)."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import trainrec
import trainrec.recorders.formats as formats_mod
from trainrec import (
    BF16PrecisionSettings,
    ChecksumError,
    CorruptRecordError,
    FlaxMsgpackFileRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
)
from trainrec.cli.commands import main
from trainrec.items.tree import iter_tensors
from trainrec.recorders.ptfile import read_pt

NATIVE = NativePrecisionSettings()
BLOCKED = ("torch", "jax", "jaxlib", "flax", "optax")


def _every_dtype() -> dict[str, TensorData]:
    out = {}
    for d in trainrec.DType:
        arr = (np.arange(6) % 2 == 1) if d is trainrec.DType.BOOL else np.arange(6) - (3 if d.is_signed_int or d.is_float else 0)
        out[d.value] = TensorData.from_array(np.asarray(arr).astype(d.numpy).reshape(2, 3))
    return out


def _item() -> dict:
    return {
        **_every_dtype(),
        "zero_d": TensorData.from_array(np.array(2.5, np.float64)),
        "empty": TensorData.from_array(np.zeros((0, 3), np.int64)),
        "ones": TensorData.from_array(np.ones((1, 1, 5), ml_dtypes.bfloat16)),
        "meta": {"n": [1, 2.5, "s\u202e", None, True, b"\x00\xff", -(2**63), 2**64 - 1],
                 "deep": [{"x": TensorData.from_array(np.arange(4, dtype=np.int32))}]},
    }


def _digest(item) -> list:
    """Every tensor's key, dtype, shape and bytes, and the scalars, comparable across processes."""
    def scalars(node):
        if isinstance(node, TensorData):
            return None
        if isinstance(node, dict):
            return {k: scalars(v) for k, v in node.items()}
        if isinstance(node, list):
            return [scalars(v) for v in node]
        return repr(node)

    return [[k, t.dtype.value, list(t.shape), t.to_bytes().hex()] for k, t in iter_tensors(item)] + [scalars(item)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One file of each built-in format, written with the frameworks where they are installed."""
    d = tmp_path_factory.mktemp("formats")
    out = {
        "mpk": NamedMpkFileRecorder(NATIVE).save_item(_item(), d / "a.mpk"),
        "gz": NamedMpkGzFileRecorder(NATIVE).save_item(_item(), d / "a.mpk.gz"),
        "flax": FlaxMsgpackFileRecorder(NATIVE).save_item(_item(), d / "a.msgpack"),
    }
    try:
        import trainrec.adapters.torch as trt
    except ImportError:
        return out
    out["pt"] = trt.TorchFileRecorder(NATIVE).save_item(_item(), d / "a.pt")
    other = _item()
    other["f32"] = TensorData.from_array(np.full((2, 3), 7, np.float32))
    out["pt-other"] = trt.TorchFileRecorder(NATIVE).save_item(other, d / "b.pt")
    data = bytearray(out["pt"].read_bytes())
    at = bytes(data).index(np.arange(-3, 3, dtype=np.float64).tobytes())
    data[at] ^= 0x10
    out["pt-flipped"] = d / "flipped.pt"
    out["pt-flipped"].write_bytes(bytes(data))
    return out


_BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = {blocked!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: only core is installed")
            return None
    sys.meta_path.insert(0, Block())
""").format(blocked=BLOCKED)


def _run_core_only(script: str, *args: str) -> subprocess.CompletedProcess:
    code = _BLOCKER + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


# -- only core installed ---------------------------------------------------------------------


def test_the_blocker_blocks():
    out = _run_core_only("import torch")
    assert out.returncode != 0 and "only core is installed" in out.stderr


def test_read_file_inspect_verify_and_diff_need_only_core(files):
    if "pt" not in files:
        pytest.skip("torch is not installed to write the .pt files")
    names = ["mpk", "gz", "flax", "pt"]
    script = """
        import contextlib, io, json, sys
        import trainrec
        from trainrec.cli.commands import main
        from test_formats import _digest
        paths = json.loads(sys.argv[1])
        out = {}
        for name, path in paths.items():
            result = {"digest": _digest(trainrec.read_file(path)[1]),
                      "mmap": _digest(trainrec.read_file(path, mmap=True)[1])}
            for argv in (["inspect", path], ["inspect", "--json", path], ["verify", path],
                         ["diff", path, paths["mpk"]]):
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    code = main(argv)
                result[argv[0] + ("-json" if "--json" in argv else "")] = [code, buf.getvalue()]
            out[name] = result
        for argv in (["verify", sys.argv[2]], ["diff", paths["pt"], sys.argv[3]]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                out[" ".join(argv[:1])] = [main(argv), buf.getvalue()]
        import os
        for src in ("pt", "flax"):  # convert reads its source through the registry too
            dst = os.path.join(os.path.dirname(paths["mpk"]), f"from-{src}.mpk")
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(["convert", paths[src], dst, "--to", "mpk"])
            out["convert " + src] = [code, _digest(trainrec.read_file(dst)[1])]
        out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "flax", "optax"))
        print(json.dumps(out))
    """
    paths = {n: str(files[n]) for n in names}
    env_script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n" + textwrap.dedent(script)
    proc = _run_core_only(env_script, json.dumps(paths), str(files["pt-flipped"]), str(files["pt-other"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["loaded"] == []
    expected = _digest(_item())
    for name in names:
        r = out[name]
        assert r["digest"] == expected and r["mmap"] == expected, name
        assert r["inspect"][0] == 0 and "tree:" in r["inspect"][1], name
        info = json.loads(r["inspect-json"][1])
        assert info["tree"]["bf16"] == {"dtype": "bf16", "shape": [2, 3], "bytes": 12}
        assert r["verify"][0] == 0 and r["verify"][1].startswith("OK:"), name
        assert r["diff"][0] == 0 and "bitwise equal; scalars equal" in r["diff"][1], name
    assert "file checksum over every byte" in out["pt"]["verify"][1]
    assert "every tensor checksum" in out["mpk"]["verify"][1]
    assert out["verify"][0] == 1 and "CORRUPT" in out["verify"][1] and "file checksum mismatch" in out["verify"][1]
    assert out["diff"][0] == 1 and "f32: differs" in out["diff"][1]
    assert out["convert pt"] == [0, expected] and out["convert flax"] == [0, expected]


def test_flax_msgpack_writes_and_reads_without_jax(tmp_path):
    script = """
        import sys, numpy as np, ml_dtypes, trainrec
        sys.path.insert(0, sys.argv[2])
        from test_formats import _item, _digest
        from trainrec import FlaxMsgpackFileRecorder, BF16PrecisionSettings, NativePrecisionSettings
        r = FlaxMsgpackFileRecorder(NativePrecisionSettings())
        path = r.save_item(_item(), sys.argv[1] + "/n.msgpack")
        assert _digest(r.load_item(path)) == _digest(_item())
        assert _digest(trainrec.read_file(path)[1]) == _digest(_item())
        b = FlaxMsgpackFileRecorder(BF16PrecisionSettings())
        w = {"w": trainrec.TensorData.from_array(np.array([1.5, -2.0], np.float32))}
        header, back = trainrec.read_file(b.save_item(w, sys.argv[1] + "/b.msgpack"))
        assert header.settings.float_dtype is trainrec.DType.BF16
        assert back["w"].dtype is trainrec.DType.F32 and back["w"].bitwise_equal(w["w"])
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "torch")))
    """
    proc = _run_core_only(script, str(tmp_path), str(Path(__file__).parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok []"


def test_flax_bf16_settings_store_bf16_and_the_adapters_keep_their_names(tmp_path):
    w = {"w": TensorData.from_array(np.array([1.5, -2.0], np.float32)),
         "b": TensorData.from_array(np.array([1, 2], ml_dtypes.bfloat16))}
    path = FlaxMsgpackFileRecorder(BF16PrecisionSettings()).save_item(w, tmp_path / "b.msgpack")
    assert b"bfloat16" in path.read_bytes() and b"float32" not in path.read_bytes()
    back = FlaxMsgpackFileRecorder().load_item(path)
    assert all(back[k].bitwise_equal(w[k]) for k in w)
    jax_adapter = pytest.importorskip("trainrec.adapters.jax")
    assert jax_adapter.FlaxMsgpackFileRecorder is FlaxMsgpackFileRecorder
    trt = pytest.importorskip("trainrec.adapters.torch")
    assert trt.BF16PrecisionSettings is BF16PrecisionSettings


# -- the .pt reader against torch's ----------------------------------------------------------


def test_pt_reader_equals_torch_load(files, tmp_path):
    torch = pytest.importorskip("torch")
    from trainrec.adapters.torch.backend import tensor_to_numpy

    doc = torch.load(files["pt"], weights_only=True)
    for mmap in (False, True):
        header, item = read_pt(files["pt"], mmap)
        assert header.format == "trainrec.torch" and header.settings == NATIVE
        theirs = dict(iter_tensors(_torch_tree(doc["item"], tensor_to_numpy)))
        ours = dict(iter_tensors(item))
        assert list(ours) == list(theirs)
        for key, t in ours.items():
            assert t.bitwise_equal(theirs[key]), key
        assert _digest(item) == _digest(_item())


def _torch_tree(node, to_numpy):
    import torch

    if isinstance(node, torch.Tensor):
        return TensorData.from_array(to_numpy(node))
    if isinstance(node, dict):
        return {k: _torch_tree(v, to_numpy) for k, v in node.items()}
    if isinstance(node, list):
        return [_torch_tree(v, to_numpy) for v in node]
    return node


def test_pt_reader_restores_the_saved_dtypes(tmp_path):
    trt = pytest.importorskip("trainrec.adapters.torch")
    for settings in (trainrec.FullPrecisionSettings(), BF16PrecisionSettings()):
        path = trt.TorchFileRecorder(settings).save_item(_every_dtype(), tmp_path / "s.pt", allow_lossy=True)
        header, item = trainrec.read_file(path)
        assert header.settings.float_dtype is settings.float_dtype
        for key, t in _every_dtype().items():
            assert item[key].dtype is t.dtype, key
        assert item["i64"].bitwise_equal(_every_dtype()["i64"])


# -- hostile and damaged .pt files -----------------------------------------------------------


def _pt_archive(pickle_bytes: bytes, storages: dict[str, bytes] | None = None, *, signed: bool = True) -> bytes:
    """A `.pt`-shaped zip (stored entries) around hand-written pickle bytes, with
    trainrec's file checksum: an attacker can write it as well as we can."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", b"little")
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)
    data = buf.getvalue()
    if not signed:
        return data
    body = data[:-2] + (19).to_bytes(2, "little") + b"trainrec.crc32:"
    return body + zlib.crc32(body).to_bytes(4, "big")


def _no_pickle(monkeypatch) -> None:
    import _pickle
    import pickle

    def refuse(*a, **kw):
        raise AssertionError("pickle used on a load path")

    for mod in (pickle, _pickle):
        for attr in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(mod, attr, refuse)


@pytest.mark.parametrize("module, name", [("os", "system"), ("builtins", "eval"), ("posix", "system"),
                                          ("torch", "load"), ("subprocess", "Popen")])
def test_pt_reader_refuses_globals_off_the_allow_list(module, name, tmp_path, monkeypatch):
    _no_pickle(monkeypatch)
    called = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a))
    pkl = (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"q\x00X\x04\x00\x00\x00echoq\x01\x85q\x02Rq\x03.")
    path = tmp_path / "evil.pt"
    path.write_bytes(_pt_archive(pkl))
    for read in (lambda: read_pt(path), lambda: trainrec.read_file(path, mmap=True)):
        with pytest.raises(CorruptRecordError, match=rf"global {module}\.{name}, which a trainrec .pt file never holds"):
            read()
    assert called == []
    assert main(["verify", str(path)]) == 1


@pytest.mark.parametrize("pkl, message", [
    (b"\x80\x02ctorch\nFloatStorage\n)R.", "not callable here"),
    (b"\x80\x02ccollections\nOrderedDict\nK\x01\x85R.", "empty OrderedDict"),
    (b"\x80\x02]" + b"}a" * 2_000_000 + b".", "builds more objects than its size allows"),
    (b"\x80\x02]q\x00h\x00a.", "wrong magic"),  # a list holding itself, not a record
    (b"\x80\x02}q\x00(X\x01\x00\x00\x00aK\x01X\x01\x00\x00\x00aK\x02u.", "duplicate map key"),
    (b"\x80\x02}K\x01K\x02s.", "map keys must be strings"),
    (b"\x80\x02r\xff\xff\xff\x7f.", "memo"),
    (b"\x80\x02\x01.", "opcode 0x01"),
    (b"\x80\x02N}b.", "BUILD"),
    (b"\x80\x02N", "truncated pickle"),
])
def test_pt_reader_refuses_malformed_pickles(pkl, message, tmp_path, monkeypatch):
    _no_pickle(monkeypatch)
    path = tmp_path / "bad.pt"
    path.write_bytes(_pt_archive(pkl))
    with pytest.raises(CorruptRecordError, match=message):
        read_pt(path)


def _storage_pickle(numel: int, size: tuple, stride: tuple, offset: int = 0, key: str = "0") -> bytes:
    def tup(vals):
        return b"(" + b"".join(b"K" + bytes([v]) for v in vals) + b"t"

    return (b"\x80\x02}(X\x06\x00\x00\x00formatX\x0e\x00\x00\x00trainrec.torchX\x04\x00\x00\x00item"
            b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
            + b"X" + len(key).to_bytes(4, "little") + key.encode() + b"X\x03\x00\x00\x00cpuK" + bytes([numel])
            + b"tQK" + bytes([offset]) + tup(size) + tup(stride)
            + b"\x89ccollections\nOrderedDict\n)RtRu.")


@pytest.mark.parametrize("numel, size, stride, offset, held, why", [
    (1, (8,), (0,), 0, 4, "whole of its own contiguous storage"),   # stride 0
    (4, (2,), (1,), 1, 16, "whole of its own contiguous storage"),  # an offset
    (4, (2,), (1,), 0, 16, "whole of its own contiguous storage"),  # part of the storage
    (4, (2, 2), (1, 2), 0, 16, "whole of its own contiguous storage"),  # transposed
    (5, (5,), (1,), 0, 16, "claims 20 bytes"),                      # more than the archive holds
    (4, (2, 2), (2, 1), 0, 16, "malformed version"),  # a well-formed tensor passes: the header is next
])
def test_pt_reader_checks_tensors_against_their_storage(numel, size, stride, offset, held, why, tmp_path):
    path = tmp_path / "t.pt"
    path.write_bytes(_pt_archive(_storage_pickle(numel, size, stride, offset), {"0": bytes(held)}))
    with pytest.raises(CorruptRecordError, match=why):
        read_pt(path)


def test_pt_reader_refuses_a_storage_missing_from_the_archive(tmp_path):
    path = tmp_path / "t.pt"
    path.write_bytes(_pt_archive(_storage_pickle(4, (4,), (1,), key="7"), {"0": bytes(16)}))
    with pytest.raises(CorruptRecordError, match="storage '7' is not in the archive"):
        read_pt(path)


def test_pt_reader_refuses_every_truncation_and_never_unpickles(files, tmp_path, monkeypatch):
    trt = pytest.importorskip("trainrec.adapters.torch")
    _no_pickle(monkeypatch)
    path = trt.TorchFileRecorder(NATIVE).save_item(
        {"a": 1, "w": TensorData.from_array(np.arange(3, dtype=np.float32))}, tmp_path / "small.pt")
    data = path.read_bytes()
    case = tmp_path / "cut.pt"
    loaded = []
    for n in range(len(data)):
        case.write_bytes(data[:n])
        try:
            trainrec.read_file(case)
            loaded.append(n)
        except RecorderError:
            pass
    assert loaded == []
    assert trainrec.read_file(path)[1]["w"].bitwise_equal(TensorData.from_array(np.arange(3, dtype=np.float32)))


def test_the_pt_reader_imports_no_deserializer():
    tree = ast.parse(Path(trainrec.recorders.ptfile.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "_pickle", "pickletools", "copyreg", "torch", "marshal"}


def test_a_pt_file_without_the_file_checksum_is_refused_after_its_header(tmp_path):
    torch = pytest.importorskip("torch")
    doc = {"format": "trainrec.torch", "version": [2, 0], "trainrec": "0.1.0",
           "settings": {"name": "native", "float": None, "int": None}, "record": "Item",
           "item": {"w": torch.ones(2)}, "checksums": [0], "dtypes": [None]}
    torch.save(doc, tmp_path / "plain.pt")
    with pytest.raises(CorruptRecordError, match="file checksum is missing"):
        trainrec.read_file(tmp_path / "plain.pt")
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(CorruptRecordError, match="wrong magic"):
        trainrec.read_file(tmp_path / "other.pt")


def test_empty_bytes_round_trip_through_pt(tmp_path):
    """torch's own weights_only loader refuses the `bytes()` global `b""` is pickled as."""
    trt = pytest.importorskip("trainrec.adapters.torch")
    path = trt.TorchFileRecorder().save_item({"b": b"", "c": b"\x00"}, tmp_path / "e.pt")
    assert trt.TorchFileRecorder().load_item(path) == {"b": b"", "c": b"\x00"}


# -- the registry ----------------------------------------------------------------------------

ACME = textwrap.dedent('''
    """A third party's format: `ACME1\\n` then JSON {"record": str, "w": [floats]}."""
    import json
    from pathlib import Path

    import numpy as np

    import trainrec
    from trainrec.recorders.formats import Format
    from trainrec.recorders.namedmpk import RecorderBase


    def read(path, mmap):
        data = Path(path).read_bytes()
        if not data.startswith(b"ACME1\\n"):
            raise trainrec.CorruptRecordError("not an acme file", source=str(path))
        doc = json.loads(data[6:])
        header = trainrec.Header("acme.json", (1, 0), "", trainrec.NativePrecisionSettings(), doc["record"])
        return header, {"w": trainrec.TensorData.from_array(np.array(doc["w"], np.float64))}


    class AcmeRecorder(RecorderBase):
        def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
            w = [float(x) for x in item["w"].array]
            Path(args).write_bytes(b"ACME1\\n" + json.dumps({"record": record_type, "w": w}).encode())
            return Path(args)

        def read(self, args, *, mmap=False):
            return read(args, mmap)


    ACME = Format("acme.json", (".acme",), lambda head: head.startswith(b"ACME1\\n"), read,
                  "acme_format:AcmeRecorder", "an acme file: acme_format.AcmeRecorder reads it",
                  "nothing: acme files carry no checksums")
''')


@pytest.fixture
def acme(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_format.py").write_text(ACME)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(formats_mod, "_registered", [])
    (tmp_path / "x.acme").write_bytes(b'ACME1\n{"record": "Item", "w": [1.0, 2.5]}')
    return site


def test_a_format_registered_in_code_is_read_and_written_by_read_file_and_the_cli(acme, tmp_path, capsys):
    import acme_format

    path = tmp_path / "x.acme"
    with pytest.raises(CorruptRecordError, match="match none of the formats"):
        trainrec.read_file(path)
    trainrec.register_format(acme_format.ACME)
    header, item = trainrec.read_file(path)
    assert header.format == "acme.json" and item["w"].array.tolist() == [1.0, 2.5]
    assert main(["inspect", str(path)]) == 0 and "format: acme.json" in capsys.readouterr().out
    assert main(["verify", str(path)]) == 0 and "acme files carry no checksums" in capsys.readouterr().out
    assert main(["convert", str(path), str(tmp_path / "y.mpk"), "--to", "mpk"]) == 0
    assert main(["convert", str(tmp_path / "y.mpk"), str(tmp_path / "z.acme"), "--to", "mpk"]) == 0
    assert trainrec.read_file(tmp_path / "z.acme")[1]["w"].array.tolist() == [1.0, 2.5]
    assert main(["diff", str(path), str(tmp_path / "y.mpk")]) == 0
    assert formats_mod.known_formats()[0] is acme_format.ACME


def test_a_format_declared_by_an_entry_point_is_found(acme, tmp_path):
    dist = acme / "acme_format-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-format\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[trainrec.formats]\nacme.json = acme_format:ACME\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(acme), os.environ.get("PYTHONPATH", "")])}
    script = ("import sys, trainrec; h, item = trainrec.read_file(sys.argv[1]); "
              "print(h.format, item['w'].array.tolist())")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.acme")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "acme.json [1.0, 2.5]"
    cli = subprocess.run([sys.executable, "-m", "trainrec", "inspect", "--json", str(tmp_path / "x.acme")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["format"] == "acme.json"


def test_an_entry_point_that_names_no_format_is_skipped_with_a_warning(monkeypatch):
    class EP:
        name, value = "broken", "nowhere:THING"

        def load(self):
            raise ImportError("no module named nowhere")

    monkeypatch.setattr(formats_mod.metadata, "entry_points", lambda group: [EP()])
    monkeypatch.setattr(formats_mod, "_from_entry_points", None)
    with pytest.warns(UserWarning, match="broken.*failed to load"):
        names = [f.name for f in formats_mod.known_formats()]
    # core's own formats only: the bundled adapters' come through the (failing) entry points too
    assert names == ["trainrec.namedmpk", "trainrec.namedmpk.gz", "trainrec.flax", "burn.burnpack",
                     "burn.namedmpk", "burn.namedmpk.gz", "burn.bin"]
    monkeypatch.setattr(formats_mod, "_from_entry_points", None)


def test_format_fields_are_checked():
    with pytest.raises(TypeError, match="module:attr"):
        formats_mod.Format("x", (".x",), bool, lambda p, m: None, "no-colon")
    with pytest.raises(TypeError, match="extensions"):
        formats_mod.Format("x", ".x", bool, lambda p, m: None, "a:b")
    with pytest.raises(TypeError, match="Format"):
        trainrec.register_format("x")  # type: ignore[arg-type]


def test_an_unknown_file_lists_the_known_formats(tmp_path, capsys):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(CorruptRecordError) as e:
        trainrec.read_file(path)
    msg = str(e.value)
    assert "match none of the formats" in msg and str(path) in msg
    for name, ext in [("trainrec.namedmpk", ".mpk"), ("trainrec.namedmpk.gz", ".mpk.gz"),
                      ("trainrec.flax", ".msgpack"), ("trainrec.torch", ".pt")]:
        assert f"{name} ({ext})" in msg
    assert main(["inspect", str(path)]) == 3 and "match none of the formats" in capsys.readouterr().err
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CorruptRecordError, match="an empty file"):
        trainrec.read_file(tmp_path / "empty")


@pytest.mark.parametrize("content, name, says", [
    ("mpk", "x.pt", "NamedMpkFileRecorder"),
    ("flax", "x.mpk", "FlaxMsgpackFileRecorder"),
    ("gz", "x.msgpack", "NamedMpkGzFileRecorder"),
    ("pt", "x.mpk.gz", "TorchFileRecorder"),
])
def test_content_that_contradicts_the_extension_is_refused_naming_both(files, content, name, says, tmp_path,
                                                                      capsys):
    if content not in files:
        pytest.skip("torch is not installed")
    path = tmp_path / name
    path.write_bytes(files[content].read_bytes())
    with pytest.raises(CorruptRecordError) as e:
        trainrec.read_file(path)
    named = formats_mod.format_for_name(name)
    assert named is not None
    msg = str(e.value)
    assert f"the name says {named.name}" in msg and says in msg and str(path) in msg
    assert main(["verify", str(path)]) == 1 and says in capsys.readouterr().out


def test_a_file_with_an_unknown_name_is_read_by_its_content(files, tmp_path):
    for kind, f in files.items():
        if kind in ("pt-flipped",):
            continue
        path = tmp_path / f"checkpoint-{kind}"
        path.write_bytes(f.read_bytes())
        assert trainrec.read_file(path)[1]["i8"].bitwise_equal(_every_dtype()["i8"]), kind


def test_recorder_for_names_the_writer_by_extension(tmp_path):
    assert type(formats_mod.recorder_for("a.msgpack")) is FlaxMsgpackFileRecorder
    assert type(formats_mod.recorder_for("a.mpk.gz")) is NamedMpkGzFileRecorder
    assert type(formats_mod.recorder_for("a.ckpt")) is NamedMpkFileRecorder


def test_checksums_are_verified_without_torch(files):
    if "pt-flipped" not in files:
        pytest.skip("torch is not installed")
    with pytest.raises(ChecksumError, match="file checksum mismatch"):
        read_pt(files["pt-flipped"])
