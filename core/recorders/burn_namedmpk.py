"""Burn's NamedMpk (`.mpk`) and NamedMpk.gz: the parser, the bounded gunzip, and the
recorder that writes both.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..errors import CorruptRecordError, reading
from ..format.header import Header
from ..format.limits import Limits
from ..format.parser import Ext, decode_msgpack
from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors, join_key
from ..precision import NativePrecisionSettings
from .burn_names import (
    _META_KEYS,
    MODULE,
    NAMEDMPK,
    NAMEDMPK_GZ,
    _bin_header,
    _bool_style,
    _burn_dtype,
    _check_shape,
    _dtype,
    _from_view,
    _header,
    _precision,
    _read_all,
    _stored,
    is_burn_item,
    module_tensors,
    nest,
    new_param_id,
    param_id_text,
    split_training_item,
)
from .burn_sniff import gz_is_burn, sniff_namedmpk
from .namedmpk import RecorderBase


def _is_tensor_map(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"bytes", "shape", "dtype"} \
        and isinstance(node["bytes"], memoryview)


def parse_namedmpk(buf: Any, source: str, fmt: str = NAMEDMPK) -> tuple[Header, Item]:
    """Header and item of a Burn NamedMpk document held in `buf`."""
    head = bytes(memoryview(buf).cast("B")[:64])
    if not sniff_namedmpk(head):
        raise CorruptRecordError("not a Burn NamedMpk document (a msgpack map starting with "
                                 "`metadata`)", source=source)
    doc = decode_msgpack(buf, source, limits=Limits(max_header_bytes=1 << 20))
    if not isinstance(doc, dict) or not {"metadata", "item"} <= set(doc) or set(doc) - {"metadata", "item", "_b"}:
        raise CorruptRecordError("a Burn record is {metadata, item, _b}", source=source)
    meta = doc["metadata"]
    if not isinstance(meta, dict) or set(meta) != set(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError(f"Burn's metadata is a map of {', '.join(_META_KEYS)} (strings)",
                                 source=source, key="metadata")
    if doc.get("_b", []) != []:
        raise CorruptRecordError("`_b` (Burn's PhantomData) is an empty list", source=source, key="_b")
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}
    style = _bool_style(meta["version"])

    def tensor(node: dict[str, Any], path: str) -> TensorData:
        dtype = _dtype(node["dtype"], path, source)
        if node["dtype"] != _burn_dtype(dtype, style):
            dtypes[path] = node["dtype"]
        return _from_view(buf, node["bytes"], dtype, _check_shape(node["shape"], path, source), path, source)

    def convert(node: Any, path: str) -> Item:
        if isinstance(node, dict):
            if set(node) == {"id", "param"} and _is_tensor_map(node["param"]):
                if not isinstance(node["id"], str):
                    raise CorruptRecordError("a ParamId is a string", source=source, key=path)
                param_ids[path] = node["id"]
                return tensor(node["param"], path)
            if _is_tensor_map(node):
                return tensor(node, path)
            return {k: convert(v, join_key(path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, join_key(path, i)) for i, v in enumerate(node)]
        if isinstance(node, memoryview):
            return node.tobytes()
        if isinstance(node, Ext):
            raise CorruptRecordError("msgpack ext values are not written by Burn", source=source, key=path)
        return node  # type: ignore[no-any-return]

    record = convert(doc["item"], "")
    item: dict[str, Item] = {"metadata": dict(meta), "item": record, "param_ids": param_ids, "dtypes": dtypes}
    settings = _precision(meta["float"], meta["int"], meta["settings"])
    return _header(fmt, (0, 0), meta["version"], settings, MODULE), item


def read_namedmpk(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)
    with reading(source):
        return parse_namedmpk(_read_all(Path(path), source, mmap), source)


_GZ_BYTES = 256 << 20
_GZ_RATIO = 64


def gunzip(path: Path, source: str, check: Callable[[bytes], None] | None = None) -> bytearray:
    """The decompressed content of the gzip file `path`, refused once it grows past 256 MiB
    plus 64 times the compressed size (a decompression bomb costs at most that), and as soon
    as its first 64 bytes fail `check`."""
    d = zlib.decompressobj(wbits=31)
    out = bytearray()
    with open(path, "rb") as f:
        limit = _GZ_BYTES + _GZ_RATIO * os.fstat(f.fileno()).st_size
        checked = check is None
        try:
            while not d.eof:
                chunk = d.unconsumed_tail or f.read(1 << 16)
                if not chunk:
                    raise CorruptRecordError("truncated gzip stream", source=source)
                out += d.decompress(chunk, min(1 << 24 if checked else 64, limit - len(out) + 1))
                if len(out) > limit:
                    raise CorruptRecordError(f"decompresses to more than {limit} bytes", source=source)
                if not checked and len(out) >= 64:
                    assert check is not None
                    check(bytes(out[:64]))
                    checked = True
        except zlib.error as e:
            raise CorruptRecordError(f"not a valid gzip stream: {e}", source=source) from None
        if not checked and check is not None:
            check(bytes(out[:64]))
        if d.unused_data or f.read(1):
            raise CorruptRecordError("trailing data after the gzip stream", source=source)
    return out


def gz_head(path: Path, n: int = 64) -> bytes:
    """The first `n` decompressed bytes of a gzip file (fewer for a shorter or damaged
    stream), reading at most 1 MiB of it."""
    d = zlib.decompressobj(wbits=31)
    out = b""
    with open(path, "rb") as f:
        for _ in range(16):
            chunk = d.unconsumed_tail or f.read(1 << 16)
            if not chunk:
                break
            try:
                out += d.decompress(chunk, n - len(out))
            except zlib.error:
                break
            if len(out) >= n or d.eof:
                break
    return out


def read_namedmpk_gz(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)

    def check(head: bytes) -> None:
        if not gz_is_burn(head):
            raise CorruptRecordError("not a gzip Burn NamedMpk file", source=source)

    with reading(source):
        return parse_namedmpk(gunzip(Path(path), source, check), source, NAMEDMPK_GZ)


class BurnNamedMpkRecorder(RecorderBase):
    """Burn <= 0.21's NamedMpk files (`NamedMpkFileRecorder`; `compress=True`: gzipped, as
    `NamedMpkGzFileRecorder`), byte for byte as rmp_serde's `write_named` writes a record.
    Saves a Burn item of either layout (a Burnpack record is nested by its dotted names;
    a parameter without a ParamId gets a new one, as Burn would give it). Burn's metadata is
    the item's, or for a Burnpack item Burn 0.21's of `FullPrecisionSettings`."""

    suffix = ".mpk"

    def __init__(self, settings: Any = None, *, compress: bool = False) -> None:
        super().__init__(settings or NativePrecisionSettings())  # Burn's dtypes as they are
        self._compress = compress

    def save_item(self, item: Item, args: Any, record_type: str = "Item", *,
                  allow_lossy: bool = False) -> Path | str:
        from ..storage.location import location, output

        path = location(args)  # a store URL too: uploaded as it is written
        if isinstance(item, list) and record_type == "TrainingRecord":
            item = split_training_item(item, str(path))[0]
        meta, record, ids, dtypes = _named_parts(item, str(path))
        style = _bool_style(meta["version"])
        packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        s, name = self.settings, self.native_name()

        def tensor(f: Any, t: TensorData, key: str) -> None:
            stored = _stored(t, s, key, allow_lossy, name)
            given = dtypes.get(key)
            burn = given if given is not None and stored.dtype is t.dtype else _burn_dtype(stored.dtype, style)
            f.write(packer.pack_map_header(3) + packer.pack("bytes") + _bin_header(stored.nbytes))
            f.write(np.ascontiguousarray(stored.read()).reshape(-1).view(np.uint8).data)
            f.write(packer.pack("shape") + packer.pack(list(stored.shape)) + packer.pack("dtype")
                    + packer.pack(burn))

        def write(f: Any, node: Item, key: str) -> None:
            if isinstance(node, TensorData):
                if key in ids:
                    f.write(packer.pack_map_header(2) + packer.pack("id") + packer.pack(ids[key])
                            + packer.pack("param"))
                tensor(f, node, key)
            elif isinstance(node, dict):
                f.write(packer.pack_map_header(len(node)))
                for k, v in node.items():
                    f.write(packer.pack(k))
                    write(f, v, join_key(key, k))
            elif isinstance(node, list):
                f.write(packer.pack_array_header(len(node)))
                for i, v in enumerate(node):
                    write(f, v, join_key(key, i))
            else:
                f.write(packer.pack(node))

        with output(path) as out:
            f: Any = gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) if self._compress else out
            f.write(packer.pack_map_header(3) + packer.pack("metadata") + packer.pack(meta)
                    + packer.pack("item"))
            write(f, record, "")
            f.write(packer.pack("_b") + packer.pack_array_header(0))
            if self._compress:
                f.close()
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        from ..format.envelope import path_arg
        from ..storage.location import is_url

        if is_url(args):  # read from a private local copy (remote.read_staged)
            from .remote import read_staged

            return read_staged(args, lambda local: self.read(local))
        path = path_arg(args)
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        return read_namedmpk_gz(path) if gz else read_namedmpk(path, mmap)


_FULL_META = {"float": "f32", "int": "i32",
              "format": "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::"
                        "FullPrecisionSettings>",
              "version": "0.21.0", "settings": "FullPrecisionSettings"}


def _named_parts(item: Item, source: str) -> tuple[dict[str, str], Item, dict[str, str], dict[str, Any]]:
    if not is_burn_item(item):
        raise CorruptRecordError("not a Burn record item", source=source)
    assert isinstance(item, dict)
    ids_in = item.get("param_ids") or {}
    dtypes = item.get("dtypes") or {}
    if not isinstance(ids_in, dict) or not isinstance(dtypes, dict):
        raise CorruptRecordError("param_ids and dtypes are maps", source=source)
    if "item" in item:
        meta = item["metadata"]
        record = item["item"]
    else:
        meta, record = dict(_FULL_META), nest(module_tensors(item))
    if not isinstance(meta, dict) or set(meta) != set(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError(f"Burn's metadata is a map of {', '.join(_META_KEYS)} (strings)",
                                 source=source, key="metadata")
    ids: dict[str, str] = {}
    for name, _ in iter_tensors(record):
        pid = ids_in.get(name)
        if pid is None and "item" not in item:
            pid = new_param_id()
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = param_id_text(pid)
        if pid is not None:
            if not isinstance(pid, str):
                raise CorruptRecordError(f"a ParamId is a string or a u64, got {pid!r:.40}", source=source, key=name)
            ids[name] = pid
    return {k: str(meta[k]) for k in _META_KEYS}, record, ids, dict(dtypes)
