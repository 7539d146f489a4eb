"""CRC-32 (the zlib / ISO-HDLC polynomial) of any contiguous buffer, as fast as this
machine allows.

Every checksum in the NamedMpk format and in the `.pt` and flax envelopes is this CRC-32.
The stdlib's `zlib.crc32` computes it with the table method of zlib 1.2 (about 1.5-3 GB/s
on a laptop core), which is slower than writing a checkpoint into the page cache. Where
the system has libdeflate (Debian's and Fedora's `libdeflate0`, Homebrew's `libdeflate`),
its PCLMULQDQ/ARMv8-CRC implementation computes the same value several times faster; it is
loaded through `ctypes`, which releases the GIL for the call. The value never depends on
the implementation: `spec/FORMAT.md` fixes the polynomial, and the tests compare both.

Resolution: `TRAINREC_CRC32=zlib` in the environment forces the stdlib; otherwise the first
libdeflate `ctypes.util.find_library` finds, then the stdlib.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["crc32", "crc_text", "implementation"]

_SMALL = 1 << 14
"""Below this many bytes the ctypes call costs more than the stdlib's loop."""


def _load_libdeflate() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("deflate")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).libdeflate_crc32
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    probe = b"trainrec crc probe " * 1000
    buf = np.frombuffer(probe, np.uint8)
    if fn(0, buf.ctypes.data, buf.nbytes) != zlib.crc32(probe):
        return None  # a library of that name that computes something else
    return fn


_NATIVE = None if os.environ.get("TRAINREC_CRC32") == "zlib" else _load_libdeflate()


def implementation() -> str:
    """`"libdeflate"` or `"zlib"`: what computes `crc32` in this process."""
    return "zlib" if _NATIVE is None else "libdeflate"


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of the bytes of `data` (any C-contiguous buffer: bytes, memoryview, mmap
    slice, numpy array), continuing from `value` exactly as `zlib.crc32(data, value)`."""
    native = _NATIVE
    if native is None:
        return zlib.crc32(data, value)
    view = memoryview(data)
    if view.nbytes < _SMALL:
        return zlib.crc32(view, value)
    if not view.c_contiguous:
        raise ValueError("crc32 needs a C-contiguous buffer")
    arr = np.frombuffer(view, np.uint8)
    return native(value, arr.ctypes.data, arr.nbytes)


def crc_text(value: object) -> str:
    """A stored checksum as error messages print it: 0x-prefixed hex, 8 digits (what was
    stored is printed as it is when it is not an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:#010x}"
    return repr(value)
