"""A small, bounded CBOR (RFC 8949) decoder and encoder: the subset Burnpack's metadata uses.

Burn's Burnpack files (`trainrec.recorders.burn`) describe their tensors in CBOR written by Rust's
`ciborium`: maps, text strings, unsigned and negative integers, arrays, booleans, null
and floats, all of definite length. `decode` reads that subset from a buffer with the
bounds every trainrec reader keeps (spec/SECURITY.md): each declared length is checked
against the bytes that remain before anything is allocated, nesting is bounded, and the
decoded objects may cost at most a budget proportional to the input's size, so a hostile
blob of `n` bytes costs O(n) time and memory. Indefinite lengths, tags, byte strings and
simple values other than false/true/null are refused (ciborium writes none of them for
Burn's metadata). `encode` writes what `ciborium::ser::into_writer` writes for the same
values: the shortest head for every integer and length, floats in the shortest of
f16/f32/f64 that keeps their bits.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from ..errors import CorruptRecordError

__all__ = ["decode", "encode", "MAX_DEPTH"]

MAX_DEPTH = 128
"""Burn's own limit (`burn_pack::MAX_CBOR_RECURSION_DEPTH`)."""

_ITEM_COST = 64
"""What one decoded value is charged (about a small CPython object)."""


class _Decoder:
    def __init__(self, buf: Any, source: str, max_depth: int, budget: int) -> None:
        self.mv = memoryview(buf).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.source = source
        self.max_depth = max_depth
        self.budget = budget

    def fail(self, message: str, key: str = "") -> CorruptRecordError:
        return CorruptRecordError(f"CBOR metadata: {message} (at byte {self.pos})",
                                  source=self.source, key=key)

    def take(self, n: int, key: str) -> int:
        start = self.pos
        if n > self.end - start:
            raise self.fail(f"truncated: {n} bytes declared, {self.end - start} remain", key)
        self.pos = start + n
        return start

    def charge(self, cost: int, key: str) -> None:
        self.budget -= cost
        if self.budget < 0:
            raise self.fail("decodes to more objects than its size allows", key)

    def head(self, key: str) -> tuple[int, int, int]:
        """(major type, additional info, argument)."""
        b = self.mv[self.take(1, key)]
        major, info = b >> 5, b & 0x1F
        if info < 24:
            return major, info, info
        if info <= 27:
            n = 1 << (info - 24)
            start = self.take(n, key)
            return major, info, int.from_bytes(self.mv[start : start + n], "big")
        if info == 31:
            raise self.fail("indefinite lengths are not used by Burnpack", key)
        raise self.fail(f"reserved additional information {info}", key)

    def value(self, key: str, depth: int) -> Any:
        if depth > self.max_depth:
            raise self.fail(f"nesting deeper than {self.max_depth}", key)
        major, info, arg = self.head(key)
        self.charge(_ITEM_COST, key)
        if major == 0:
            return arg
        if major == 1:
            return -1 - arg
        if major == 2:
            raise self.fail("byte strings are not used by Burnpack's metadata", key)
        if major == 3:
            start = self.take(arg, key)
            self.charge(arg, key)
            try:
                return bytes(self.mv[start : start + arg]).decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail("text string is not valid UTF-8", key) from None
        if major == 4:
            if arg > self.end - self.pos:
                raise self.fail(f"an array of {arg} items declared, {self.end - self.pos} bytes remain", key)
            self.charge(8 * arg, key)
            return [self.value(f"{key}[{i}]", depth + 1) for i in range(arg)]
        if major == 5:
            if 2 * arg > self.end - self.pos:
                raise self.fail(f"a map of {arg} entries declared, {self.end - self.pos} bytes remain", key)
            self.charge(48 * arg, key)
            out: dict[str, Any] = {}
            for _ in range(arg):
                k = self.value(key, depth + 1)
                if not isinstance(k, str):
                    raise self.fail(f"map key {k!r:.40} is not a text string", key)
                if k in out:
                    raise self.fail(f"duplicate map key {k!r:.60}", key)
                out[k] = self.value(f"{key}.{k}" if key else k, depth + 1)
            return out
        if major == 6:
            raise self.fail("tags are not used by Burnpack", key)
        # major 7: simple values and floats
        if info == 20:
            return False
        if info == 21:
            return True
        if info == 22:
            return None
        if info == 25:
            return float(struct.unpack(">e", arg.to_bytes(2, "big"))[0])
        if info == 26:
            return float(struct.unpack(">f", arg.to_bytes(4, "big"))[0])
        if info == 27:
            return float(struct.unpack(">d", arg.to_bytes(8, "big"))[0])
        raise self.fail(f"simple value {arg} is not used by Burnpack", key)


def decode(buf: Any, source: str, *, max_depth: int = MAX_DEPTH, budget: int | None = None) -> Any:
    """The one CBOR value that fills `buf`; `CorruptRecordError` naming `source` for
    anything else (truncated, trailing bytes, outside the subset, too deep, or more objects
    than `budget`, by default 1 MiB plus 64 per byte of `buf`)."""
    d = _Decoder(buf, source, max_depth, (1 << 20) + 64 * len(memoryview(buf).cast("B"))
                 if budget is None else budget)
    if not d.end:
        raise d.fail("empty")
    v = d.value("", 0)
    if d.pos != d.end:
        raise d.fail(f"{d.end - d.pos} bytes of trailing data")
    return v


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def _float(x: float) -> bytes:
    bits = struct.pack(">d", x)
    if not math.isnan(x):
        try:
            half = struct.pack(">e", x)
            if struct.pack(">d", struct.unpack(">e", half)[0]) == bits:
                return b"\xf9" + half
        except OverflowError:
            pass
        try:
            single = struct.pack(">f", x)
            if struct.pack(">d", struct.unpack(">f", single)[0]) == bits:
                return b"\xfa" + single
        except OverflowError:
            pass
    return b"\xfb" + bits


def encode(value: Any) -> bytes:
    """`value` (None, bool, int, float, str, list, dict with str keys, in its order) as CBOR."""
    out = bytearray()

    def put(v: Any) -> None:
        if v is None:
            out.append(0xF6)
        elif v is True:
            out.append(0xF5)
        elif v is False:
            out.append(0xF4)
        elif isinstance(v, int):
            out.extend(_head(0, v) if v >= 0 else _head(1, -1 - v))
        elif isinstance(v, float):
            out.extend(_float(v))
        elif isinstance(v, str):
            raw = v.encode("utf-8")
            out.extend(_head(3, len(raw)))
            out.extend(raw)
        elif isinstance(v, (list, tuple)):
            out.extend(_head(4, len(v)))
            for x in v:
                put(x)
        elif isinstance(v, dict):
            out.extend(_head(5, len(v)))
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TypeError(f"CBOR map keys here are text strings, got {type(k).__name__}")
                put(k)
                put(x)
        else:
            raise TypeError(f"{type(v).__name__} is not encoded here")

    put(value)
    return bytes(out)
