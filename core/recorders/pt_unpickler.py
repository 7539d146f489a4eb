"""The restricted unpickler of a `.pt` file's `data.pkl`: a pickle machine that knows only
the opcodes and the allow-listed globals (tensor rebuilds, storages, dtypes) a state dict
needs, and never imports or calls anything else. One idea (some 400 lines, most of them the machine).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptRecordError
from ..format.limits import Limits
from ..items.dtypes import DType
from ..items.tensor import TensorData
from .pt_zip import _Entry

# -- the pickle interpreter ------------------------------------------------------------------


class _Global:
    """A name the allow-list resolves: a callable of trainrec's own (`kind`), a storage
    type or a torch dtype (`dtype`; None: an untyped storage)."""

    __slots__ = ("dtype", "kind", "name")

    def __init__(self, name: str, kind: str, dtype: DType | None = None) -> None:
        self.name, self.kind, self.dtype = name, kind, dtype

    def __repr__(self) -> str:
        return self.name


class _Hooks:
    """The empty `OrderedDict()` of backward hooks `torch.save` writes with each tensor."""

    __slots__ = ()


@dataclass(frozen=True)
class _Storage:
    dtype: DType | None  # None: an untyped storage (its element type comes with the tensor)
    key: str
    start: int
    nbytes: int


_STORAGE_TYPES = {
    "DoubleStorage": DType.F64, "FloatStorage": DType.F32, "HalfStorage": DType.F16,
    "BFloat16Storage": DType.BF16, "LongStorage": DType.I64, "IntStorage": DType.I32,
    "ShortStorage": DType.I16, "CharStorage": DType.I8, "ByteStorage": DType.U8,
    "BoolStorage": DType.BOOL,
}
_TORCH_DTYPES = {
    "float64": DType.F64, "float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16,
    "int64": DType.I64, "int32": DType.I32, "int16": DType.I16, "int8": DType.I8,
    "uint8": DType.U8, "uint16": DType.U16, "uint32": DType.U32, "uint64": DType.U64,
    "bool": DType.BOOL,
}


def _allow_list() -> dict[tuple[str, str], _Global]:
    out = {
        ("torch._utils", "_rebuild_tensor_v2"): _Global("torch._utils._rebuild_tensor_v2", "tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"): _Global("torch._utils._rebuild_tensor_v3", "tensor_v3"),
        ("collections", "OrderedDict"): _Global("collections.OrderedDict", "hooks"),
        ("_codecs", "encode"): _Global("_codecs.encode", "encode"),
        ("__builtin__", "bytes"): _Global("bytes", "bytes"),
        ("builtins", "bytes"): _Global("bytes", "bytes"),
        ("torch.storage", "UntypedStorage"): _Global("torch.storage.UntypedStorage", "storage"),
        ("torch", "UntypedStorage"): _Global("torch.UntypedStorage", "storage"),
    }
    for name, dtype in _STORAGE_TYPES.items():
        out[("torch", name)] = _Global(f"torch.{name}", "storage", dtype)
    for name, dtype in _TORCH_DTYPES.items():
        out[("torch", name)] = _Global(f"torch.{name}", "dtype", dtype)
    return out


_ALLOWED = _allow_list()

_SMALL_INTS = range(-5, 257)  # CPython's cached ints cost nothing
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1
_MAX_LINE = 256


class _Machine:
    """Runs the pickle in `data` (a memoryview) and returns the object it builds."""

    def __init__(self, data: memoryview, buf: Any, entries: dict[str, _Entry], prefix: str,
                 source: str, owned: bool, limits: Limits) -> None:
        self.data, self.buf, self.entries, self.prefix = data, buf, entries, prefix
        self.source, self.owned, self.limits = source, owned, limits
        self.budget = limits.object_budget(len(data))
        self.used_storages: set[str] = set()
        self.pos = 0

    def fail(self, message: str) -> CorruptRecordError:
        return CorruptRecordError(f"{message} (pickle byte {self.pos})", source=self.source,
                                  key="data.pkl")

    def charge(self, cost: int) -> None:
        self.budget -= cost
        if self.budget < 0:
            raise self.fail("the pickle builds more objects than its size allows "
                            f"(Limits.object_bytes + {self.limits.object_bytes_per_byte} per byte)")

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail("truncated pickle")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def text(self, n: int) -> str:
        if n > self.limits.max_str_bytes:
            raise self.fail(f"string of {n} bytes is longer than Limits.max_str_bytes")
        raw = self.take(n)
        try:
            s = str(raw, "utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.fail("string is not UTF-8") from None
        self.charge(0 if n <= 1 else 49 + n)
        return s

    def line(self) -> str:
        end = bytes(self.data[self.pos : self.pos + _MAX_LINE]).find(b"\n")
        if end < 0:
            raise self.fail("truncated or overlong GLOBAL name")
        raw = bytes(self.take(end + 1)[:-1])
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise self.fail("GLOBAL name is not ASCII") from None

    def number(self, v: int) -> int:
        if v not in _SMALL_INTS:
            self.charge(28)
        return v

    def run(self) -> Any:
        stack: list[Any] = []
        marks: list[int] = []
        memo: list[Any] = []
        data = self.data
        end = len(data)

        def pop_mark() -> list[Any]:
            if not marks:
                raise self.fail("no MARK to close")
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            return items

        def pop() -> Any:
            if len(stack) <= (marks[-1] if marks else 0):
                raise self.fail("stack underflow")
            return stack.pop()

        def put(i: int) -> None:
            if len(stack) <= (marks[-1] if marks else 0):
                raise self.fail("memoizing nothing")
            if i == len(memo):
                self.charge(8)
                memo.append(stack[-1])
            elif i < len(memo):
                memo[i] = stack[-1]
            else:
                raise self.fail(f"memo index {i} out of order")

        def get(i: int) -> None:
            if i >= len(memo):
                raise self.fail(f"memo index {i} was never set")
            self.charge(8)
            stack.append(memo[i])

        def tup(items: list[Any]) -> tuple[Any, ...]:
            self.charge(56 + 8 * len(items))
            return tuple(items)

        while True:
            if self.pos >= end:
                raise self.fail("truncated pickle (no STOP)")
            op = data[self.pos]
            self.pos += 1
            if op == 0x80:  # PROTO
                if self.uint(1) > 5:
                    raise self.fail("unknown pickle protocol")
            elif op == 0x95:  # FRAME
                self.take(8)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise self.fail("malformed pickle (STOP with a stack of other than one object)")
                if self.pos != end:
                    raise self.fail("trailing bytes after the pickle")
                return stack[0]
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x7D:  # EMPTY_DICT
                self.charge(64)
                stack.append({})
            elif op == 0x5D:  # EMPTY_LIST
                self.charge(56)
                stack.append([])
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x58:  # BINUNICODE
                stack.append(self.text(self.uint(4)))
            elif op == 0x8C:  # SHORT_BINUNICODE
                stack.append(self.text(self.uint(1)))
            elif op == 0x8D:  # BINUNICODE8
                stack.append(self.text(self.uint(8)))
            elif op in (0x42, 0x43):  # BINBYTES, SHORT_BINBYTES
                n = self.uint(4 if op == 0x42 else 1)
                if n > self.limits.max_str_bytes:
                    raise self.fail(f"bytes of {n} are longer than Limits.max_str_bytes")
                self.charge(33 + n)
                stack.append(bytes(self.take(n)))
            elif op == 0x4A:  # BININT
                stack.append(self.number(int.from_bytes(self.take(4), "little", signed=True)))
            elif op == 0x4B:  # BININT1
                stack.append(self.uint(1))
            elif op == 0x4D:  # BININT2
                stack.append(self.number(self.uint(2)))
            elif op == 0x8A:  # LONG1
                raw = self.take(self.uint(1))
                stack.append(self.number(int.from_bytes(raw, "little", signed=True)))
            elif op == 0x47:  # BINFLOAT
                self.charge(28)
                stack.append(struct.unpack(">d", self.take(8))[0])
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x63:  # GLOBAL
                module = self.line()
                stack.append(self.resolve(module, self.line()))
            elif op == 0x93:  # STACK_GLOBAL
                name, module = pop(), pop()
                if not (isinstance(module, str) and isinstance(name, str)):
                    raise self.fail("STACK_GLOBAL of non-strings")
                stack.append(self.resolve(module, name))
            elif op == 0x51:  # BINPERSID
                stack.append(self.storage(pop()))
            elif op == 0x74:  # TUPLE
                stack.append(tup(pop_mark()))
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                n = op - 0x84
                items = [pop() for _ in range(n)][::-1]
                stack.append(tup(items))
            elif op == 0x52:  # REDUCE
                args = pop()
                stack.append(self.call(pop(), args))
            elif op == 0x62:  # BUILD
                raise self.fail("object state (BUILD) is not part of a trainrec .pt file")
            elif op == 0x73:  # SETITEM
                value = pop()
                key = pop()
                stack.append(self.setitems(pop(), [key, value]))
            elif op == 0x75:  # SETITEMS
                items = pop_mark()
                stack.append(self.setitems(pop(), items))
            elif op == 0x61:  # APPEND
                value = pop()
                stack.append(self.appends(pop(), [value]))
            elif op == 0x65:  # APPENDS
                items = pop_mark()
                stack.append(self.appends(pop(), items))
            elif op == 0x71:  # BINPUT
                put(self.uint(1))
            elif op == 0x72:  # LONG_BINPUT
                put(self.uint(4))
            elif op == 0x94:  # MEMOIZE
                put(len(memo))
            elif op == 0x68:  # BINGET
                get(self.uint(1))
            elif op == 0x6A:  # LONG_BINGET
                get(self.uint(4))
            else:
                self.pos -= 1
                raise self.fail(f"pickle opcode {op:#04x} is not one torch.save writes for a "
                                "trainrec record")

    def setitems(self, target: Any, items: list[Any]) -> dict[str, Any]:
        if type(target) is not dict:
            raise self.fail(f"SETITEM on {type(target).__name__}, not a dict")
        if len(items) % 2:
            raise self.fail("SETITEMS with an odd number of entries")
        self.charge(40 * (len(items) // 2))
        for k, v in zip(items[::2], items[1::2]):
            if not isinstance(k, str):
                raise self.fail(f"map keys must be strings, not {type(k).__name__}")
            if k in target:
                raise self.fail(f"duplicate map key {k!r}")
            target[k] = v
        return target

    def appends(self, target: Any, items: list[Any]) -> list[Any]:
        if type(target) is not list:
            raise self.fail(f"APPEND to {type(target).__name__}, not a list")
        self.charge(8 * len(items))
        target.extend(items)
        return target

    def resolve(self, module: str, name: str) -> _Global:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise self.fail(f"the pickle names the global {module}.{name}, which a trainrec "
                            ".pt file never holds: refused (nothing is imported or called)")
        return found

    def call(self, fn: Any, args: Any) -> Any:
        if not isinstance(fn, _Global) or fn.kind in ("storage", "dtype"):
            raise self.fail(f"REDUCE calls {fn!r}, which is not callable here")
        if not isinstance(args, tuple):
            raise self.fail("REDUCE arguments are not a tuple")
        if fn.kind == "hooks":
            if args:
                raise self.fail("backward hooks must be an empty OrderedDict")
            return _Hooks()
        if fn.kind == "bytes":
            if args:
                raise self.fail("bytes() takes no arguments here")
            return b""
        if fn.kind == "encode":
            if len(args) != 2 or not isinstance(args[0], str) or args[1] != "latin1":
                raise self.fail("_codecs.encode is only used as encode(str, 'latin1')")
            try:
                out = args[0].encode("latin1")
            except UnicodeEncodeError:
                raise self.fail("bytes that are not latin-1") from None
            self.charge(33 + len(out))
            return out
        return self.tensor(fn.kind, args)

    def storage(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self.fail("malformed persistent id (a storage reference)")
        _, kind, key, location, numel = pid
        if not (isinstance(kind, _Global) and kind.kind == "storage" and isinstance(key, str)
                and isinstance(location, str) and type(numel) is int and numel >= 0):
            raise self.fail("malformed storage reference")
        entry = self.entries.get(f"{self.prefix}/data/{key}")
        if entry is None:
            raise self.fail(f"storage {key!r} is not in the archive")
        if key in self.used_storages:
            raise self.fail(f"storage {key!r} is shared by two tensors")
        self.used_storages.add(key)
        itemsize = 1 if kind.dtype is None else kind.dtype.itemsize
        if numel * itemsize != entry.size:
            raise self.fail(f"storage {key!r} claims {numel * itemsize} bytes, the archive holds "
                            f"{entry.size}")
        return _Storage(kind.dtype, key, entry.start, entry.size)

    def tensor(self, kind: str, args: tuple[Any, ...]) -> TensorData:
        v3 = kind == "tensor_v3"
        base = 7 if v3 else 6
        if len(args) not in (base, base + 1):
            raise self.fail("malformed tensor (wrong number of rebuild arguments)")
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        metadata = args[base] if len(args) > base else None
        if not isinstance(storage, _Storage):
            raise self.fail("a tensor without a storage")
        if v3:
            dt = args[6]
            if not (isinstance(dt, _Global) and dt.kind == "dtype") or storage.dtype is not None:
                raise self.fail("malformed tensor (dtype)")
            dtype = dt.dtype
        else:
            dtype = storage.dtype
        if dtype is None:
            raise self.fail("an untyped storage needs _rebuild_tensor_v3")
        if requires_grad is not False or not isinstance(hooks, _Hooks) or metadata not in (None, {}):
            raise self.fail("not a plain tensor (requires grad, hooks or metadata)")
        if not (_ints(size) and _ints(stride) and len(size) == len(stride)
                and len(size) <= self.limits.max_dims):
            raise self.fail("malformed tensor shape or strides")
        numel = math.prod(size)
        if type(offset) is not int or offset or not _contiguous(size, stride) \
                or numel * dtype.itemsize != storage.nbytes:
            raise self.fail("tensor is not the whole of its own contiguous storage")
        self.charge(256 + 8 * len(size))
        shape = tuple(size)
        if not numel:
            return TensorData.from_array(np.empty(shape, dtype.numpy), copy=False)
        if self.owned:
            arr = self.buf[storage.start : storage.start + storage.nbytes].view(dtype.numpy).reshape(shape)
            return TensorData(dtype, shape, lambda: arr, private=True)
        arr = np.frombuffer(self.buf, dtype.numpy, count=numel, offset=storage.start).reshape(shape)
        return TensorData.from_array(arr, copy=False)


def _ints(v: Any) -> bool:
    return isinstance(v, tuple) and all(type(d) is int and d >= 0 for d in v)


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """torch's `is_contiguous`: C order, ignoring dimensions of size 1; any empty tensor."""
    if 0 in size:
        return True
    expected = 1
    for d, s in zip(reversed(size), reversed(stride)):
        if d != 1:
            if s != expected:
                return False
            expected *= d
    return True
