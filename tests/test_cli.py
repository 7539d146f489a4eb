"""The command line: inspect, verify, diff (exit codes and JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from trainrec import DefaultRecorder, NamedMpkGzFileRecorder, TensorData


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainrec", *args], capture_output=True, text=True)


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
