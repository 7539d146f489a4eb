"""Eager loads check tensor checksums after the one read, on several threads for large
documents: a corrupted tensor is still named (the first in document order), small
documents take the sequential path, and a forked child loads with its own threads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import trainrec.format as fmt
from trainrec import ChecksumError, NamedMpkFileRecorder, NativePrecisionSettings, TensorData

N = 1 << 19  # 2 MiB of f32 per tensor: 8 tensors pass the parallel threshold


def _item() -> dict[str, object]:
    rng = np.random.default_rng(3)
    return {f"t{i}": TensorData.from_array(rng.standard_normal(N).astype(np.float32)) for i in range(8)}


def _payload_offset(data: bytes, t: TensorData) -> int:
    at = data.find(t.read().tobytes()[:64])
    assert at > 0
    return at


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_the_first_corrupted_tensor_in_document_order_is_named(tmp_path, monkeypatch):
    item = _item()
    rec = NamedMpkFileRecorder(NativePrecisionSettings())
    path = rec.save_item(item, tmp_path / "a.mpk")
    data = path.read_bytes()
    _flip(path, _payload_offset(data, item["t6"]) + 100)  # type: ignore[arg-type]
    _flip(path, _payload_offset(data, item["t3"]) + 5000)  # type: ignore[arg-type]
    used = []
    real = fmt.checksums._verify_pool
    monkeypatch.setattr(fmt.parser, "_verify_pool", lambda: used.append(1) or real())
    with pytest.raises(ChecksumError, match="tensor checksum mismatch") as e:
        rec.read(path)
    assert e.value.key == "item.t3"
    assert used == ([1] if fmt.checksums._VERIFY_THREADS > 1 else [])
    # a document below the threshold is checked on the calling thread, with the same result
    small = {k: TensorData.from_array(t.read()[:1000]) for k, t in item.items()}  # type: ignore[union-attr]
    path = rec.save_item(small, tmp_path / "s.mpk")
    _flip(path, _payload_offset(path.read_bytes(), small["t5"]) + 8)
    used.clear()
    with pytest.raises(ChecksumError) as e:
        rec.read(path)
    assert e.value.key == "item.t5" and used == []


def test_an_intact_large_document_loads_equal(tmp_path):
    item = _item()
    rec = NamedMpkFileRecorder(NativePrecisionSettings())
    path = rec.save_item(item, tmp_path / "a.mpk")
    for kw in ({}, {"mmap": True, "verify": True}):
        _, back = rec.read(path, **kw)
        assert all(back[k].bitwise_equal(t) and back[k].dtype == t.dtype for k, t in item.items())


_FORKING_PARENT = """
import multiprocessing, sys
from trainrec import NamedMpkFileRecorder, NativePrecisionSettings

def load(path, out):
    out.put(sorted(NamedMpkFileRecorder(NativePrecisionSettings()).read(path)[1]))

if __name__ == "__main__":
    path = sys.argv[1]
    NamedMpkFileRecorder(NativePrecisionSettings()).read(path)  # the parent's verify threads exist from here
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=load, args=(path, out))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        sys.exit("the forked child hung loading (the parent's thread pool was reused)")
    assert child.exitcode == 0, child.exitcode
    print(out.get(timeout=5))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_loads_after_the_parent_did(tmp_path):
    """In a process of its own: the pytest worker has other tests' threads (JAX's, torch's),
    which a fork would copy as held locks; the claim is about trainrec's own."""
    item = _item()
    path = NamedMpkFileRecorder(NativePrecisionSettings()).save_item(item, tmp_path / "a.mpk")
    script = tmp_path / "forking_parent.py"
    script.write_text(_FORKING_PARENT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip() == repr(sorted(item))
