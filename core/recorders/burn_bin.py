"""Burn's Bin (`.bin`, bincode 2): the reader, which needs a template (or a registered
layout) for the module's structure, since the file names nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CorruptRecordError, RecordMismatchError, reading
from ..format.header import Header
from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors, join_key
from .burn_names import (
    _BIN_DTYPES,
    _BOOL_STORES,
    _META_KEYS,
    BIN,
    MAX_DIMS,
    MODULE,
    _bool_style,
    _burn_dtype,
    _check_shape,
    _dtype,
    _from_view,
    _header,
    _precision,
    _read_all,
    nest,
)

# -- Bin ------------------------------------------------------------------------------------------


class _Bin:
    """bincode 2 `config::standard()`: varint integers (< 251 in one byte, then 251/252/253
    for a u16/u32/u64 that follows, little-endian), strings and bytes as a varint length
    and their bytes, `Option` as a 0/1 byte, enums by variant index."""

    def __init__(self, buf: Any, source: str) -> None:
        self.buf = buf
        self.mv = memoryview(buf).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.source = source

    def fail(self, message: str, key: str) -> CorruptRecordError:
        return CorruptRecordError(f"{message} (at byte {self.pos})", source=self.source, key=key)

    def take(self, n: int, key: str) -> int:
        if n > self.end - self.pos:
            raise self.fail(f"truncated: {n} bytes declared, {self.end - self.pos} remain", key)
        start = self.pos
        self.pos += n
        return start

    def peek(self) -> int:
        return self.mv[self.pos] if self.pos < self.end else -1

    def varint(self, key: str) -> int:
        b = self.mv[self.take(1, key)]
        if b < 251:
            return int(b)
        if b > 253:
            raise self.fail(f"varint tag {b} (a u128, or invalid)", key)
        n = 1 << (b - 250)
        at = self.take(n, key)
        return int.from_bytes(self.mv[at : at + n], "little")

    def text(self, key: str, limit: int = 1 << 16) -> str:
        n = self.varint(key)
        if n > limit:
            raise self.fail(f"a string of {n} bytes", key)
        at = self.take(n, key)
        try:
            return bytes(self.mv[at : at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8", key) from None

    def fillers(self, allow_some: bool = True, scan: bool = False) -> None:
        """Skip the one-byte records between parameters: `None` and `EmptyRecord` (0), the
        tag of an `Option` that holds something (1); `scan` (no template): any byte below
        10, which also passes over the lengths of short lists (a ParamId has 10 or more
        characters)."""
        while 0 <= self.peek() <= (9 if scan else 1 if allow_some else 0):
            self.pos += 1

    def param(self, key: str, bool_store: bool, scan: bool = False) -> tuple[str, TensorData, Any]:
        self.fillers(scan=scan)
        start = self.pos
        pid = self.text(key, 64)
        if len(pid) < 2 or not re.fullmatch(r"[0-9a-v]+|[0-9a-fA-F-]{36}", pid):
            self.pos = start
            raise self.fail(f"expected a parameter (a ParamId), found {pid[:16]!r}", key)
        n = self.varint(key)
        data = self.take(n, key)
        ndim = self.varint(key)
        if ndim > MAX_DIMS:
            raise self.fail(f"a shape of {ndim} dimensions", key)
        shape = tuple(self.varint(key) for _ in range(ndim))
        _check_shape(list(shape), key, self.source)
        index = self.varint(key)
        if index >= len(_BIN_DTYPES):
            raise self.fail(f"dtype variant {index}", key)
        name: Any = _BIN_DTYPES[index]
        if name == "Bool" and bool_store:
            store = self.varint(key)
            if store >= len(_BOOL_STORES):
                raise self.fail(f"bool store variant {store}", key)
            name = {"Bool": _BOOL_STORES[store]}
        if name == "QFloat":
            raise CorruptRecordError("a quantized (QFloat) tensor: trainrec does not read Burn's "
                                     "quantized layouts", source=self.source, key=key)
        dtype = _dtype(name, key, self.source)
        t = _from_view(self.buf, self.mv[data : data + n], dtype, shape, key, self.source)
        return pid, t, name


def _structure(template: Any) -> Item:
    """The record tree a template gives a Bin file: a Burn NamedMpk or Bin item's `item`, or
    a Burnpack item's tensors nested by their dotted names (numbered segments as lists)."""
    if isinstance(template, (str, os.PathLike)):
        from .read import read_file

        template = read_file(template, mmap=True)
    if isinstance(template, tuple) and len(template) == 2 and isinstance(template[0], Header):
        template = template[1]
    if isinstance(template, dict) and "item" in template and "metadata" in template:
        return template["item"]  # type: ignore[no-any-return]
    if isinstance(template, dict) and isinstance(template.get("tensors"), dict):
        return nest(template["tensors"])
    laid = None
    for layout in _layouts:
        laid = layout(template)
        if laid is not None:
            break  # a record another adapter's form can describe
    if laid is not None:
        return nest(laid["tensors"])  # type: ignore[arg-type]
    raise TypeError("a Bin template is a Burn record (Burnpack, NamedMpk), a path to one, or a "
                    f"record whose parameters a neutral form names; got {type(template).__name__}")


_layouts: list[Callable[[Any], dict[str, Item] | None]] = []


def register_template_layout(layout: Callable[[Any], dict[str, Item] | None]) -> None:
    """Let a Bin template be any record `layout` lays out in Burn's names (a Burnpack-layout
    module item, None for a record it does not describe). The conversion layer, above this
    one, registers its neutral forms' (`trainrec.conversion.burn_neutral.burn_layout`):
    `trainrec/__init__.py` wires it."""
    _layouts.append(layout)


def parse_bin(buf: Any, source: str, template: Any = None) -> tuple[Header, Item]:
    p = _Bin(buf, source)
    meta = {k: p.text(f"metadata.{k}") for k in _META_KEYS}
    if "Bin" not in meta["format"]:
        raise CorruptRecordError(f"not a Burn Bin record (its format is {meta['format']!r:.100})", source=source)
    bool_store = _bool_style(meta["version"]) != "Bool"
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}

    def one(path: str, scan: bool = False) -> TensorData:
        pid, t, name = p.param(path, bool_store, scan)
        param_ids[path] = pid
        if name != _burn_dtype(t.dtype, _bool_style(meta["version"])):
            dtypes[path] = name
        return t

    if template is None:
        found: list[Item] = []
        while True:
            p.fillers(scan=True)
            if p.pos >= p.end:
                break
            found.append(one(str(len(found)), scan=True))
        record: Item = found
    else:
        shape_of = _structure(template)

        def walk(node: Any, path: str) -> Item:
            if isinstance(node, TensorData):
                t = one(path)
                if t.shape != node.shape:
                    raise RecordMismatchError(f"the file's tensor has shape {list(t.shape)}, the template's "
                                              f"{list(node.shape)}: the template is of another module",
                                              source=source, key=path)
                return t
            if isinstance(node, dict):
                return {k: walk(v, join_key(path, k)) for k, v in node.items()}
            if isinstance(node, list):
                if not any(True for _ in iter_tensors(node)):
                    return [walk(v, join_key(path, i)) for i, v in enumerate(node)]
                p.fillers(allow_some=len(node) != 1)
                n = p.varint(path)
                if n != len(node):
                    raise RecordMismatchError(f"a list of {n} entries where the template has {len(node)}",
                                              source=source, key=path)
                return [walk(v, join_key(path, i)) for i, v in enumerate(node)]
            return node  # type: ignore[no-any-return]  # a constant: its filler byte is skipped

        record = walk(shape_of, "")
        p.fillers()
        if p.pos != p.end:
            raise CorruptRecordError(f"{p.end - p.pos} bytes after the last parameter the template "
                                     "names: the template is of another module", source=source)
    item: dict[str, Item] = {"metadata": meta, "item": record, "param_ids": param_ids,  # type: ignore[dict-item]
                             "dtypes": dtypes}
    return _header(BIN, (0, 0), meta["version"], _precision(meta["float"], meta["int"], meta["settings"]),
                   MODULE), item


def read_bin(path: str | os.PathLike[str], mmap: bool = False, template: Any = None) -> tuple[Header, Item]:
    """A Burn Bin file. `template` (a Burn record, a path to one, or a record whose parameters
    a neutral form names) supplies the module's structure: tensors keyed by module path;
    without one the tensors come in file order, keyed 0, 1, ... (their module paths are not
    in the file)."""
    source = str(path)
    with reading(source):
        return parse_bin(_read_all(Path(path), source, mmap), source, template)
