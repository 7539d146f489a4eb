"""The `trainrec` JSON item of an Orbax checkpoint: the item tree with each tensor,
bytes value and non-finite float replaced by a `{"__tensor__": ...}` reference and back
(`_encode` / `_decode`), the CRC-32 that guards every other field (`_doc_crc`), and the
tensor table it lists (`_Row`, `_table`).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

from trainrec import CorruptRecordError, TensorData
from trainrec.adapter_kit import TENSOR_KEY, DType, Item, check_item, crc32, map_leaves


def _encode(item: Item) -> Any:
    counter = iter(range(1 << 62))

    def leaf(_: str, v: Any) -> Any:
        if isinstance(v, TensorData):
            return {TENSOR_KEY: next(counter)}
        if isinstance(v, bytes):
            return {TENSOR_KEY: {"bytes": base64.b64encode(v).decode("ascii")}}
        if isinstance(v, float) and not math.isfinite(v):
            return {TENSOR_KEY: {"f64": struct.pack(">d", v).hex()}}
        return v

    return map_leaves(item, leaf)


def _doc_crc(doc: dict[str, Any]) -> int:
    body = {k: v for k, v in doc.items() if k != "crc"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return crc32(text.encode("ascii"))


_Row = tuple[str, tuple[int, ...], DType, "str | None"]


def _table(doc: dict[str, Any], source: str) -> list[_Row]:
    rows = doc.get("tensors")
    if not isinstance(rows, list):
        raise CorruptRecordError("the tensor table is missing", source=source, key="tensors")
    out: list[_Row] = []
    for i, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
              and isinstance(row[1], list) and len(row[1]) <= 64
              and all(type(d) is int and d >= 0 for d in row[1])
              and (row[3] is None or row[3] == f"{i:06d}"))
        try:
            dtype = DType.from_code(row[2]) if ok else None
        except ValueError:
            dtype = None
        if dtype is None:
            raise CorruptRecordError(f"malformed tensor table entry {i}", source=source,
                                     key="tensors")
        shape = tuple(row[1])
        if (row[3] is None) != (math.prod(shape) == 0):
            raise CorruptRecordError(f"tensor table entry {i} names an array for a tensor without "
                                     "elements, or none for one with", source=source, key="tensors")
        out.append((row[0], shape, dtype, row[3]))
    return out


def _decode(node: Any, tensors: list[TensorData], source: str) -> Item:
    seen: set[int] = set()

    def go(n: Any, key: str, depth: int) -> Item:
        if depth > 256:
            raise CorruptRecordError("nesting deeper than 256", source=source, key=key)
        if isinstance(n, dict):
            if TENSOR_KEY in n:
                return special(n, key)
            return {k: go(v, f"{key}.{k}" if key else k, depth + 1) for k, v in n.items()}
        if isinstance(n, list):
            return [go(v, f"{key}.{i}" if key else str(i), depth + 1) for i, v in enumerate(n)]
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        raise CorruptRecordError(f"{type(n).__name__} is not an item", source=source, key=key)

    def special(n: dict[str, Any], key: str) -> Item:
        v = n[TENSOR_KEY]
        if len(n) == 1 and type(v) is int and 0 <= v < len(tensors) and v not in seen:
            seen.add(v)
            return tensors[v]
        if len(n) == 1 and isinstance(v, dict) and len(v) == 1:
            try:
                if isinstance(v.get("bytes"), str):
                    return base64.b64decode(v["bytes"], validate=True)
                if isinstance(v.get("f64"), str) and len(v["f64"]) == 16:
                    value: float = struct.unpack(">d", bytes.fromhex(v["f64"]))[0]
                    return value
            except ValueError:
                pass
        raise CorruptRecordError("a malformed tensor, bytes or float reference", source=source,
                                 key=f"item.{key}" if key else "item")

    out = go(node, "", 0)
    return check_item(out, source=source)
