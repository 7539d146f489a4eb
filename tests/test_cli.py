"""The command line: inspect, verify, diff (exit codes and JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _zygote import Zygote

from trainrec import DefaultRecorder, NamedMpkGzFileRecorder, TensorData

_ZYGOTE: list[Zygote] = []


@pytest.fixture(scope="module", autouse=True)
def _cli_zygote():
    yield
    while _ZYGOTE:
        _ZYGOTE.pop().close()


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m trainrec ARGS` in a process of its own, forked from a zygote that imported
    trainrec's CLI once (tests/_zygote.py): no interpreter start-up per command."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(["trainrec.cli"]))
    (out,) = _ZYGOTE[0].run([{"argv": ["-m", "trainrec", *args]}])
    return out


def _files(tmp_path):
    a = DefaultRecorder().save_item({"w": TensorData.from_array(np.arange(6, dtype=np.float32)),
                                     "step": 3}, tmp_path / "a.mpk", "Item")
    b = DefaultRecorder().save_item({"w": TensorData.from_array(np.arange(6, dtype=np.float32) * 1.5),
                                     "step": 3}, tmp_path / "b.mpk", "Item")
    c = NamedMpkGzFileRecorder().save_item({"w": TensorData.from_array(np.arange(6, dtype=np.float32)),
                                            "step": 3}, tmp_path / "c.mpk.gz", "Item")
    return a, b, c


def test_inspect_prints_the_tree_and_json(tmp_path):
    a, _, c = _files(tmp_path)
    out = cli("inspect", str(a))
    assert out.returncode == 0 and "trainrec.namedmpk" in out.stdout and "w: f32[6] 24 B" in out.stdout
    info = json.loads(cli("inspect", str(c), "--json").stdout)
    assert info["precision"]["name"] == "full" and info["tree"]["w"] == {"dtype": "f32", "shape": [6], "bytes": 24}
    assert cli("inspect", str(tmp_path / "missing")).returncode == 3


def test_verify_exits_1_on_corruption(tmp_path):
    a, _, _ = _files(tmp_path)
    assert cli("verify", str(a)).returncode == 0
    raw = bytearray(a.read_bytes())
    raw[raw.index(np.float32(3).tobytes())] ^= 1
    a.write_bytes(bytes(raw))
    out = cli("verify", str(a), "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["ok"] is False


def test_diff_reports_per_tensor_differences(tmp_path):
    a, b, c = _files(tmp_path)
    same = cli("diff", str(a), str(c))
    assert same.returncode == 0 and "1 of 1 tensors bitwise equal" in same.stdout
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 1
    row = json.loads(out.stdout)["rows"][0]
    assert row["key"] == "w" and row["max_abs"] == 2.5 and row["max_rel"] == 0.5
    assert cli("diff", str(a), str(tmp_path / "missing")).returncode == 3


def test_diff_names_training_record_parts_and_differing_scalars_with_both_values(tmp_path):
    """A TrainingRecord's paths by part (model, optimizer, scheduler, pending, state), not
    by index; each differing scalar named, with its value in a and in b."""
    from trainrec import NamedMpkFileRecorder, TrainingRecord
    from trainrec.adapters.numpy.demo import WORKLOAD
    from trainrec.conformance.harness import run

    paths = []
    for name, micro in (("a", 5), ("b", 8)):  # mid-window (gradients pending), and at a window's end
        parts = WORKLOAD.build(0)
        run(WORKLOAD, parts, micro)
        WORKLOAD.before_capture(parts)
        rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler, parts.accumulator, parts.state)
        paths.append(str(rec.save(NamedMpkFileRecorder(), tmp_path / f"{name}.mpk")))
    out = cli("diff", *paths)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert "pending.layers.0.bias: only in a" in lines
    assert any(ln.startswith("model.layers.0.weight: differs") for ln in lines)
    assert any(ln.startswith("optimizer.state.layers.0.weight.exp_avg: differs") for ln in lines)
    assert "scheduler.count: 1 in a, 2 in b" in lines and "state.micro: 5 in a, 8 in b" in lines
    assert "optimizer.state.layers.0.weight.step: 1.0 in a, 2.0 in b" in lines
    assert not [ln for ln in lines if ln[:2] in ("0.", "1.", "2.", "3.", "4.")], lines
    assert lines[-1].endswith("scalars differ") and "0 of 24 tensors bitwise equal" in lines[-1]
    result = json.loads(cli("diff", *paths, "--json").stdout)
    assert {"key": "scheduler.count", "a": "1", "b": "2"} in result["scalars"] and not result["scalars_equal"]
    same = cli("diff", paths[0], paths[0])
    assert same.returncode == 0 and same.stdout.strip().endswith("scalars equal")


def test_diff_names_scalars_of_any_record(tmp_path):
    a = DefaultRecorder().save_item({"w": TensorData.from_array(np.zeros(2, np.float32)), "step": 3,
                                     "cfg": {"lr": 0.1, "name": "x"}}, tmp_path / "a.mpk", "Item")
    b = DefaultRecorder().save_item({"w": TensorData.from_array(np.zeros(2, np.float32)), "step": 4,
                                     "cfg": {"lr": 0.1}}, tmp_path / "b.mpk", "Item")
    out = cli("diff", str(a), str(b))
    assert out.returncode == 1
    assert "step: 3 in a, 4 in b" in out.stdout and "cfg.name: 'x' in a, absent in b" in out.stdout
    assert "1 of 1 tensors bitwise equal; 2 scalars differ" in out.stdout


# -- safe to point at anything (spec/SECURITY.md section 5) --------------------------------

EVIL_KEYS = ["\x1b[2J\x1b[31mred", "cr\rOK: forged by cr", "nl\nOK: forged by newline", "bidi\u202etxt.exe"]


def _evil_file(tmp_path, monkeypatch, corrupt: bool = False):
    """A record whose keys, record name, version string and file name carry terminal
    control sequences and line breaks."""
    import trainrec.format as fmt

    monkeypatch.setattr(fmt.writer, "__version__", "0.1.0\x1b]0;pwned\x07\nOK: forged version")
    item = {k: TensorData.from_array(np.full(4, i, np.float32)) for i, k in enumerate(EVIL_KEYS)}
    item["\x1b[1mnested"] = {"\rOK: forged": "value\x1b[0m"}
    path = tmp_path / "evil\x1b[0m\nOK: forged name.mpk"
    DefaultRecorder().save_item(item, path, "Item\x1b[8m\r\nOK: forged record")
    monkeypatch.undo()
    if corrupt:
        raw = bytearray(path.read_bytes())
        raw[raw.index(np.float32(3).tobytes())] ^= 1  # a tensor under the newline key
        path.write_bytes(bytes(raw))
    return path


def _assert_inert(out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text and "\u202e" not in text
    assert not [line for line in text.splitlines() if line.lstrip().startswith("OK: forged")]
    assert "Traceback" not in out.stderr


def test_control_characters_from_a_file_are_printed_escaped(tmp_path, monkeypatch):
    path = _evil_file(tmp_path, monkeypatch)
    out = cli("inspect", str(path))
    assert out.returncode == 0
    _assert_inert(out)
    assert "\\x1b[2J\\x1b[31mred: f32[4] 16 B" in out.stdout and "nl\\nOK: forged by newline" in out.stdout
    assert "record: Item\\x1b[8m\\r\\nOK: forged record" in out.stdout
    assert "written_by: 0.1.0\\x1b]0;pwned\\x07\\nOK: forged version" in out.stdout
    assert "bidi\\u202etxt.exe" in out.stdout
    info = json.loads(cli("inspect", str(path), "--json").stdout)  # JSON keeps the exact strings
    assert set(info["tree"]) == {*EVIL_KEYS, "\x1b[1mnested"} and info["record"].startswith("Item\x1b")
    ok = cli("verify", str(path))
    assert ok.returncode == 0 and ok.stdout.count("\n") == 1 and ok.stdout.startswith("OK: ")
    _assert_inert(ok)
    other = DefaultRecorder().save_item({"plain": 1}, tmp_path / "plain.mpk")
    for out in (cli("diff", str(path), str(other)), cli("diff", str(other), str(path))):
        assert out.returncode == 1
        _assert_inert(out)
    out = cli("convert", str(path), str(path) + ".out", "--to", "mpk")
    assert out.returncode == 0
    _assert_inert(out)
    out = cli("convert", str(path), str(tmp_path / "x.pt"), "--to", "torch", "--template", str(path))
    assert out.returncode == 2
    _assert_inert(out)


def test_errors_naming_crafted_keys_and_files_are_printed_escaped(tmp_path, monkeypatch):
    path = _evil_file(tmp_path, monkeypatch, corrupt=True)
    out = cli("verify", str(path))
    assert out.returncode == 1 and out.stdout.startswith("CORRUPT: ") and out.stdout.count("\n") == 1
    _assert_inert(out)
    for args in (("inspect", str(tmp_path / "gone\x1b[2J\nOK: x")), ("verify", str(tmp_path / "gone\r\nOK: x"))):
        out = cli(*args)
        assert out.returncode == 3
        _assert_inert(out)


def test_verify_exits_3_when_the_file_cannot_be_read(tmp_path):
    (tmp_path / "dir").mkdir()
    for target in ("missing", "dir"):
        out = cli("verify", str(tmp_path / target))
        assert out.returncode == 3 and out.stdout.startswith("UNREADABLE: "), out
        out = cli("verify", str(tmp_path / target), "--json")
        assert out.returncode == 3 and json.loads(out.stdout)["ok"] is False
    (tmp_path / "garbage").write_bytes(b"\x00not a record")
    assert cli("verify", str(tmp_path / "garbage")).returncode == 1  # read, and found corrupt


def _bad_inputs(tmp_path):
    import os

    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "garbage").write_bytes(bytes(range(256)) * 3)
    (tmp_path / "gz").write_bytes(b"\x1f\x8b\x08\x00garbage, not deflate")
    (tmp_path / "pk").write_bytes(b"PK\x03\x04garbage, not a zip")
    (tmp_path / "msgpack").write_bytes(b"\x81\xa1a\xc1")
    (tmp_path / "json").write_text('{"rules": 5}')
    return [str(tmp_path / n) for n in ("missing", "dir", "fifo", "empty", "garbage", "gz", "pk", "msgpack",
                                        "json")]


def test_no_command_hangs_or_ends_in_a_traceback_on_bad_files(tmp_path):
    import trainrec
    from trainrec.adapters.numpy import MLP, AdamW, StepLr

    @trainrec.record
    class Step:
        step: int

    good = tmp_path / "good.mpk"
    trainrec.TrainingRecord.capture(MLP([2, 3]), AdamW(), StepLr(0.1, 2), trainrec.GradientsAccumulator(),
                                    Step(1)).save(DefaultRecorder(), good)
    out_file = str(tmp_path / "out.mpk")
    scripts = []
    for bad in _bad_inputs(tmp_path):
        scripts += [
            ("inspect", bad), ("verify", bad), ("diff", str(good), bad), ("diff", bad, str(good)),
            ("convert", bad, out_file, "--to", "mpk"),
            ("convert", str(good), out_file, "--to", "jax", "--template", bad),
            ("convert", str(good), out_file, "--to", "jax", "--template", str(good), "--map", bad),
        ]
        if bad.endswith(("fifo", "empty", "garbage")):  # a workdir that is not a directory
            scripts.append(("demo", "--backend", "numpy", "--workdir", bad))
    # one interpreter runs them all (a fresh one each would take minutes); a FIFO that
    # blocks trips the alarm, and any exception escaping `main` is a traceback
    runner = (
        "import contextlib, io, json, signal, sys\n"
        "from trainrec.cli.commands import main\n"
        "signal.alarm(120)\n"
        "codes = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        codes.append(main(args))\n"
        "print(json.dumps(codes))\n"
    )
    out = subprocess.run([sys.executable, "-c", runner, json.dumps(scripts)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    codes = json.loads(out.stdout)
    for args, code in zip(scripts, codes):
        unreadable = any(a.endswith(("missing", "dir", "fifo")) for a in args[1:])
        if unreadable:
            expected = {3}
        elif args[0] == "demo":
            expected = {3}
        elif args[0] == "verify":
            expected = {1}  # read, and found corrupt
        elif args[0] == "convert":
            expected = {2, 3, 4}  # usage, unreadable or refused, by what the rest of the command meets first
        else:
            expected = {3}
        assert code in expected, (args, code)


def test_a_fifo_is_refused_at_once(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in (("inspect", str(fifo)), ("verify", str(fifo)), ("convert", str(fifo), "x.mpk", "--to", "mpk")):
        out = subprocess.run([sys.executable, "-m", "trainrec", *args], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 3 and "not a regular file" in out.stdout + out.stderr
        assert "Traceback" not in out.stderr


def test_an_undecodable_file_name_prints_escaped(tmp_path):
    import os

    a, _, _ = _files(tmp_path)
    odd = os.path.join(os.fsencode(tmp_path), b"odd\xff\x1b.mpk")
    os.rename(a, odd)
    env = dict(os.environ, PYTHONIOENCODING="utf-8")  # strict: a raw surrogate cannot be printed
    for command in ("inspect", "verify"):
        out = subprocess.run([sys.executable, "-m", "trainrec", command, odd], capture_output=True, text=True,
                             env=env)
        assert out.returncode == 0 and "odd\\udcff\\x1b.mpk" in out.stdout, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("backend", "says"), [
    ("json:HARNESS", "AttributeError: module 'json' has no attribute 'HARNESS'"),  # module, no attribute
    ("json:dumps", "function is not a trainrec Workload"),
    ("json:JSONDecoder", "JSONDecoder is not a trainrec Workload"),
])
def test_demo_with_a_harness_that_does_not_load_exits_2_with_one_line(backend, says):
    out = subprocess.run([sys.executable, "-m", "trainrec", "demo", "--backend", backend],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainrec demo: --backend {backend}: "), out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr and not out.stdout
