"""`trainrec.items.checksum.crc32` is zlib's CRC-32 whatever computes it."""

from __future__ import annotations

import ctypes.util
import mmap
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import trainrec
from trainrec.items import checksum

SIZES = [0, 1, 7, 64, (1 << 14) - 1, 1 << 14, (1 << 14) + 1, 1 << 20, (3 << 20) + 5]


@pytest.mark.parametrize("n", SIZES)
def test_matches_zlib_on_bytes_and_views(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n + 3, dtype=np.uint8).tobytes()
    for buf in (data, memoryview(data)[3:], bytearray(data)[1:]):
        assert checksum.crc32(buf) == zlib.crc32(buf)
        assert checksum.crc32(buf, 0xDEADBEEF) == zlib.crc32(buf, 0xDEADBEEF)


def test_chained_pieces_equal_the_whole() -> None:
    data = np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    crc = 0
    for at in range(0, len(data), 1_000_003):
        crc = checksum.crc32(memoryview(data)[at : at + 1_000_003], crc)
    assert crc == zlib.crc32(data)


def test_typed_arrays_and_read_only_mmap(tmp_path: Path) -> None:
    arr = np.random.default_rng(2).standard_normal((256, 300)).astype(np.float32)
    assert checksum.crc32(arr) == zlib.crc32(arr.tobytes())
    assert checksum.crc32(memoryview(arr)) == zlib.crc32(arr.tobytes())
    path = tmp_path / "blob"
    path.write_bytes(arr.tobytes())
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        assert checksum.crc32(view[17:]) == zlib.crc32(arr.tobytes()[17:])
        view.release()


def test_non_contiguous_buffer_is_refused() -> None:
    arr = np.zeros((300, 300), np.float32)[:, ::2]
    if checksum.implementation() == "zlib":
        with pytest.raises((ValueError, BufferError)):
            checksum.crc32(arr)
    else:
        with pytest.raises(ValueError, match="C-contiguous"):
            checksum.crc32(arr)


@pytest.mark.skipif(ctypes.util.find_library("deflate") is None, reason="no libdeflate here")
def test_libdeflate_is_used_where_installed() -> None:
    assert checksum.implementation() == "libdeflate"


def test_files_are_identical_under_either_implementation(tmp_path: Path) -> None:
    """A file written with the stdlib CRC is byte-identical to one written here, and each
    process reads the other's file."""
    script = (
        "import sys, numpy as np, trainrec\n"
        "from trainrec.items import checksum\n"
        "assert checksum.implementation() == 'zlib', checksum.implementation()\n"
        "rng = np.random.default_rng(3)\n"
        "item = {'w': trainrec.TensorData.from_array(rng.standard_normal(300_000).astype(np.float32)),\n"
        "        'step': 7}\n"
        "trainrec.NamedMpkFileRecorder(durable=False).save_item(item, sys.argv[1])\n"
        "trainrec.NamedMpkFileRecorder().load_item(sys.argv[2])\n"
    )
    rng = np.random.default_rng(3)
    item = {"w": trainrec.TensorData.from_array(rng.standard_normal(300_000).astype(np.float32)),
            "step": 7}
    ours = tmp_path / "ours.mpk"
    trainrec.NamedMpkFileRecorder(durable=False).save_item(item, ours)
    env = dict(os.environ, TRAINREC_CRC32="zlib")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "stdlib.mpk"), str(ours)],
                   env=env, check=True)
    assert (tmp_path / "stdlib.mpk").read_bytes() == ours.read_bytes()
    loaded = trainrec.NamedMpkFileRecorder().load_item(tmp_path / "stdlib.mpk")
    assert loaded["step"] == 7
    np.testing.assert_array_equal(loaded["w"].array, item["w"].array)
