"""The bounds-checked msgpack parser NamedMpk documents are read with: over a buffer (bytes,
a read buffer or a read-only mmap), every declared length checked against the limits and
the bytes that remain before anything is allocated; tensors become zero-copy numpy views.
One idea in one class (`_Parser`, the grammar of spec/FORMAT.md), so over 300 lines."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    ChecksumError,
    CorruptRecordError,
)
from ..items.checksum import crc32
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import TENSOR_KEY, join_key
from ..precision import (
    restorable,
    restore_tensor,
)
from . import limits as _limits
from .checksums import _PARALLEL_VERIFY_BYTES, _VERIFY_THREADS, _verify_pool
from .limits import (
    _EMPTY_DICT_COST,
    _NUMBER_COST,
    _SHARED_STR_BYTES,
    _VIEW_COST,
    Limits,
    _bytes_cost,
    _dict_cost,
    _list_cost,
    _str_cost,
    _tensor_cost,
)

__all__ = ["decode_msgpack", "Ext"]

@dataclass(frozen=True)
class Ext:
    """A msgpack ext value from `decode_msgpack`: its type code and a view of its payload."""

    code: int
    data: memoryview


def decode_msgpack(buf: Any, source: str, *, limits: Limits | None = None) -> object:
    """The one msgpack value that fills `buf`, read with the NamedMpk reader's bounds
    (`Limits`: every length checked against the bytes that remain, nesting, string size,
    the object budget; str map keys, no duplicates). Bins and ext payloads come back as
    read-only memoryviews of `buf` (ext values as `Ext`), never copied.
    Raises `CorruptRecordError` naming `source`."""
    p = _Parser(memoryview(buf).toreadonly(), source, limits or Limits(), plain=True)
    if not p.end:
        raise p.fail("empty payload", "")
    v = p.value("", 1)
    if p.pos != p.end:
        raise p.fail(f"{p.end - p.pos} bytes of trailing data after the document", "")
    return v


class _Span:
    __slots__ = ("length", "offset")

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length


class _Parser:
    def __init__(
        self, buf: Any, source: str, limits: Limits, eager: bool = False,
        plain: bool = False, owned: bool = False,
    ) -> None:
        self.buf = buf
        self.owned = owned
        """`buf` is the reader's own (see `read_document`): tensors are marked private."""
        self.mv = memoryview(buf).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.source = source
        self.limits = limits
        self.spans: list[_Span] = []
        self.avail = self.end
        self.unverified: list[tuple[list[_Span], int, str]] = []
        """The eager parse's tensors whose checksums `verify_tensors` has still to check."""
        self.eager = eager
        self.budget = limits.object_budget(self.end)
        self.plain = plain
        """Plain msgpack (`decode_msgpack`): no tensor maps; ext values and bins as views."""
        self.strs: dict[bytes, str] = {}
        self.stop = self.end
        """No value may extend past this offset (the header limit while the header is read)."""

    def fail(self, message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(message, source=self.source, key=key)

    def need(self, upto: int, key: str) -> None:
        if upto > self.avail:
            raise self.fail(f"the source ended after {self.avail} of {self.end} bytes", key)

    def charge(self, cost: int, key: str) -> None:
        """Spend `cost` bytes of the object budget; refuse the document once it is spent."""
        self.budget -= cost
        if self.budget < 0:
            raise self.fail(
                f"the document decodes to more objects than its size allows (object budget "
                f"{self.limits.object_budget(self.end)} bytes for {self.end} bytes, see Limits)",
                key,
            )

    def take(self, n: int, key: str) -> int:
        start = self.pos
        if n > self.stop - start:
            if self.stop < self.end:
                raise self.fail(f"header larger than {self.limits.max_header_bytes} bytes", key)
            raise self.fail(
                f"truncated: {n} bytes declared at offset {start}, only {self.end - start} remain",
                key,
            )
        self.need(start + n, key)
        self.pos = start + n
        return start

    def uint(self, n: int, key: str) -> int:
        start = self.take(n, key)
        return int.from_bytes(self.mv[start : start + n], "big")

    def count(self, n: int, per_entry: int, key: str) -> int:
        if n * per_entry > self.end - self.pos:
            raise self.fail(
                f"declared {n} entries at offset {self.pos}, more than the bytes that remain", key
            )
        return n

    def string(self, n: int, key: str) -> str:
        if n > self.limits.max_str_bytes:
            raise self.fail(f"string of {n} bytes exceeds the limit", key)
        start = self.take(n, key)
        raw = bytes(self.mv[start : start + n])
        if n <= _SHARED_STR_BYTES:
            s = self.strs.get(raw)
            if s is not None:
                return s  # keys repeat in every tensor map and state dict: one object each
        self.charge(_str_cost(n), key)
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("string is not valid UTF-8", key) from None
        if n <= _SHARED_STR_BYTES:
            self.strs[raw] = s
        return s

    def value(self, key: str, depth: int, spans: bool = False) -> object:
        """One msgpack value; tensor maps come back as `TensorData`, bins as bytes (as
        `_Span`s, uncopied, when `spans`: tensor payloads)."""
        if depth > self.limits.max_depth:
            raise self.fail(f"nesting deeper than {self.limits.max_depth}", key)
        b = self.mv[self.take(1, key)]
        if b <= 0x7F:
            return b
        if 0xCA <= b <= 0xD3:
            self.charge(_NUMBER_COST, key)  # a float or an int CPython may not cache
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, key, depth)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, key, depth, spans)
        if 0xA0 <= b <= 0xBF:
            return self.string(b & 0x1F, key)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if b in (0xC4, 0xC5, 0xC6):
            n = self.uint(1 << (b - 0xC4), key)
            span = _Span(self.take(n, key), n)
            if spans:
                return span
            if self.plain:
                self.charge(_VIEW_COST, key)
                return self.mv[span.offset : span.offset + n]
            self.charge(_bytes_cost(n), key)
            return self.to_bytes(span)
        if b == 0xCA:
            return float(struct.unpack_from(">f", self.mv, self.take(4, key))[0])
        if b == 0xCB:
            return float(struct.unpack_from(">d", self.mv, self.take(8, key))[0])
        if 0xCC <= b <= 0xCF:
            return self.uint(1 << (b - 0xCC), key)
        if 0xD0 <= b <= 0xD3:
            n = 1 << (b - 0xD0)
            start = self.take(n, key)
            return int.from_bytes(self.mv[start : start + n], "big", signed=True)
        if 0xD9 <= b <= 0xDB:
            return self.string(self.uint(1 << (b - 0xD9), key), key)
        if b in (0xDC, 0xDD):
            return self.array(self.uint(2 if b == 0xDC else 4, key), key, depth, spans)
        if b in (0xDE, 0xDF):
            return self.map(self.uint(2 if b == 0xDE else 4, key), key, depth)
        if self.plain and (0xC7 <= b <= 0xC9 or 0xD4 <= b <= 0xD8):
            n = 1 << (b - 0xD4) if b >= 0xD4 else self.uint(1 << (b - 0xC7), key)
            code = self.uint(1, key)
            start = self.take(n, key)
            self.charge(_VIEW_COST, key)
            return Ext(code - 256 if code > 127 else code, self.mv[start : start + n])
        raise self.fail(f"msgpack type byte 0x{b:02x} is not used by this format", key)

    def array(self, n: int, key: str, depth: int, spans: bool = False) -> list[object]:
        self.count(n, 1, key)
        self.charge(_list_cost(n), key)
        out: list[object] = []
        inline = depth + 1 <= self.limits.max_depth
        if not inline:
            n = min(n, 1)  # the first element fails the depth check
        mv, unpack = self.mv, struct.unpack_from
        ready = min(self.avail, self.stop)
        for i in range(n):
            # the common scalars inline: long lists of numbers are common in caller state
            pos = self.pos
            if inline and pos < ready:
                b = mv[pos]
                if b <= 0x7F:
                    self.pos = pos + 1
                    out.append(b)
                    continue
                if b == 0xCB and pos + 9 <= ready:
                    self.charge(_NUMBER_COST, key)
                    self.pos = pos + 9
                    out.append(unpack(">d", mv, pos + 1)[0])
                    continue
                if b == 0x80:
                    self.budget -= _EMPTY_DICT_COST
                    if self.budget < 0:
                        self.charge(0, key)
                    self.pos = pos + 1
                    out.append({})
                    continue
            out.append(self.value(join_key(key, i), depth + 1, spans))
            if spans and i and isinstance(prev := out[-2], _Span) and prev.length < _limits.MIN_CHUNK_BYTES:
                # writers cut at CHUNK_BYTES: a million empty chunks would cost a Python
                # object each, and a load seconds, for a tensor of no bytes
                raise self.fail(f"a tensor payload chunk of {prev.length} bytes before the last "
                                f"(every chunk but the last holds at least {_limits.MIN_CHUNK_BYTES})", key)
            ready = min(self.avail, self.stop)
        return out

    def map(self, n: int, key: str, depth: int) -> object:
        self.count(n, 2, key)
        self.charge(_dict_cost(n), key)
        out: dict[str, object] = {}
        if not n:
            return out
        mv, strs = self.mv, self.strs
        inline = depth + 1 <= self.limits.max_depth
        ready = min(self.avail, self.stop)
        for i in range(n):
            # inline: a short key already seen, then an int or an empty map (state dicts)
            pos = self.pos
            k: object = None
            if inline and pos < ready and 0xA0 <= mv[pos] <= 0xBF:
                end = pos + 1 + (mv[pos] & 0x1F)
                if end < ready:
                    k = strs.get(bytes(mv[pos + 1 : end]))
                    if k is not None:
                        self.pos = end
            if k is None:
                k = self.value(key, depth + 1)
                ready = min(self.avail, self.stop)
            if not isinstance(k, str):
                raise self.fail("map keys must be strings", key)
            if k in out:
                raise self.fail(f"duplicate map key {k!r}", key)
            if i == 0 and k == TENSOR_KEY and not self.plain:
                return self.tensor(n, key, depth)
            pos = self.pos
            if inline and pos < ready:
                b = mv[pos]
                if b <= 0x7F:
                    self.pos = pos + 1
                    out[k] = b
                    continue
                if b == 0x80:
                    self.budget -= _EMPTY_DICT_COST
                    if self.budget < 0:
                        self.charge(0, key)
                    self.pos = pos + 1
                    out[k] = {}
                    continue
            out[k] = self.value(join_key(key, k), depth + 1)
            ready = min(self.avail, self.stop)
        return out

    def to_bytes(self, span: _Span) -> bytes:
        return bytes(self.mv[span.offset : span.offset + span.length])

    def tensor(self, n: int, key: str, depth: int) -> TensorData:
        fields: dict[str, object] = {TENSOR_KEY: self.value(key, depth + 1)}
        for _ in range(n - 1):
            k = self.value(key, depth + 1)
            if not isinstance(k, str) or k in fields:
                raise self.fail("malformed tensor map", key)
            fields[k] = self.value(key, depth + 1, spans=k == "data")
        try:
            dtype = DType.from_code(fields[TENSOR_KEY])
            saved = DType.from_code(fields.get("dtype", dtype.value))
        except ValueError:
            raise self.fail(f"unknown dtype {fields[TENSOR_KEY]!r} or {fields.get('dtype')!r}",
                            key) from None
        shape = fields.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > self.limits.max_dims
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise self.fail(f"shape {shape!r} is not a list of non-negative ints", key)
        data = fields.get("data")
        chunks = data if isinstance(data, list) else [data]
        if not chunks or not all(isinstance(c, _Span) for c in chunks):
            raise self.fail("tensor data is not bin or an array of bin", key)
        spans: list[_Span] = [c for c in chunks if isinstance(c, _Span)]
        if len(spans) > 1 and spans[-1].length == 0:
            raise self.fail("a chunked tensor payload whose last chunk is empty", key)
        crc = fields.get("crc")
        if not isinstance(crc, int) or isinstance(crc, bool):
            raise self.fail("tensor has no crc", key)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        if sum(s.length for s in spans) != nbytes:
            raise self.fail(
                f"{dtype.value} tensor of shape {tuple(shape)} needs {nbytes} bytes, "
                f"{sum(s.length for s in spans)} are stored",
                key,
            )
        # numpy refuses such a shape even with a zero dimension
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
            raise self.fail(f"shape {shape!r} is larger than any array can be", key)
        self.charge(_tensor_cost(len(shape)), key)
        self.spans.extend(spans)
        verified = False
        if self.eager:  # checked before `read_document` returns (`verify_tensors`)
            self.unverified.append((spans, crc, key))
            verified = True
        t = TensorData(dtype, tuple(shape), self.loader(dtype, tuple(shape), spans, crc, key, verified),
                       private=self.owned)
        if saved is not dtype:  # stored in another dtype by precision settings (since 1.1)
            if not restorable(dtype, saved):
                raise self.fail(f"a {saved.value} tensor is never stored as {dtype.value}", key)
            stored = t
            t = TensorData(saved, stored.shape, lambda: restore_tensor(stored, saved).read(),
                           private=self.owned)
        if self.eager:
            t.array  # noqa: B018 - materialize the (verified) view
        return t

    def verify_tensors(self) -> None:
        """Check the checksums of the tensors an eager parse has read, on up to
        `_VERIFY_THREADS` threads when they hold more than `_PARALLEL_VERIFY_BYTES`
        (crc32 releases the GIL); the first mismatch in document order raises."""
        jobs, self.unverified = self.unverified, []
        total = sum(s.length for spans, _, _ in jobs for s in spans)
        if total < _PARALLEL_VERIFY_BYTES or len(jobs) < 2 or _VERIFY_THREADS < 2:
            for job in jobs:
                self.check_crc(*job)
            return
        sums = list(_verify_pool().map(self.crc_of, [spans for spans, _, _ in jobs]))
        for (spans, crc, key), got in zip(jobs, sums):
            self.check_crc(spans, crc, key, got)

    def crc_of(self, spans: list[_Span]) -> int:
        got = 0
        for s in spans:
            got = crc32(self.mv[s.offset : s.offset + s.length], got)
        return got

    def check_crc(self, spans: list[_Span], crc: int, key: str, got: int | None = None) -> None:
        if got is None:
            got = self.crc_of(spans)
        if got != crc:
            raise ChecksumError(
                f"tensor checksum mismatch (stored {crc:#010x}, computed {got:#010x})",
                source=self.source,
                key=key,
            )

    def loader(
        self, dtype: DType, shape: tuple[int, ...], spans: list[_Span], crc: int, key: str,
        verified: bool,
    ) -> Callable[[], np.ndarray[Any, Any]]:
        buf, mv, source = self.buf, self.mv, self.source
        count = 1
        for d in shape:
            count *= d

        def load() -> np.ndarray[Any, Any]:
            got = crc
            if not verified:
                got = 0
                for s in spans:
                    got = crc32(mv[s.offset : s.offset + s.length], got)
            if got != crc:
                raise ChecksumError(
                    f"tensor checksum mismatch (stored {crc:#010x}, computed {got:#010x})",
                    source=source,
                    key=key,
                )
            if len(spans) == 1:
                arr = np.frombuffer(buf, dtype=dtype.numpy, count=count, offset=spans[0].offset)
            else:
                raw = np.empty(count * dtype.itemsize, np.uint8)
                at = 0
                for s in spans:
                    raw[at : at + s.length] = np.frombuffer(mv, np.uint8, s.length, s.offset)
                    at += s.length
                arr = raw.view(dtype.numpy)
            return arr.reshape(shape)

        return load

    def structure_crc(self, start: int, end: int) -> int:
        crc, at = 0, start
        for s in self.spans:
            crc = crc32(self.mv[at : s.offset], crc)
            at = s.offset + s.length
        return crc32(self.mv[at:end], crc)
