"""Burnpack (`.bpk`, Burn >= 0.22): its parser, its writer (the byte layout) and its recorder.
"""

from __future__ import annotations

import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CorruptRecordError, UnsupportedVersionError, reading
from ..format import cbor
from ..format.header import Header
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item
from ..precision import NativePrecisionSettings
from .burn_names import (
    _RANK,
    ALIGNMENT,
    BURNPACK,
    BURNPACK_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_DIMS,
    MAX_METADATA,
    MAX_TENSORS,
    MODULE,
    OPTIMIZER,
    SCHEDULER,
    _burn_dtype,
    _check_shape,
    _dtype,
    _read_all,
    _scalar,
    _stored,
    _tensor,
    is_burn_item,
    module_tensors,
    optimizer_path,
    param_id_value,
    split_training_item,
)
from .namedmpk import RecorderBase


def _kind(tensors: dict[str, Any], scalars: dict[str, Any]) -> str:
    """Optimizer records name tensors and scalars `{param_id}.{field}`; scheduler records hold
    scalars only."""
    if not tensors and scalars:
        return SCHEDULER
    names = list(tensors) + list(scalars)
    if names and all(re.match(r"\d+\.", n) for n in names) and any(n.endswith("." + _RANK) for n in scalars):
        return OPTIMIZER
    return MODULE


def parse_burnpack(buf: Any, source: str) -> tuple[Header, Item]:
    """Header and item of the Burnpack file held in `buf` (tensors view it)."""
    mv = memoryview(buf).cast("B")
    size = len(mv)
    if size < HEADER_SIZE:
        raise CorruptRecordError(f"a Burnpack header is {HEADER_SIZE} bytes, the file has {size}",
                                 source=source)
    if bytes(mv[:4]) != MAGIC:
        raise CorruptRecordError("not a Burnpack file (wrong magic)", source=source)
    version, meta_size = struct.unpack_from("<HI", mv, 4)
    if version > BURNPACK_VERSION:
        raise UnsupportedVersionError(f"Burnpack version {version}: this trainrec reads version "
                                      f"{BURNPACK_VERSION}", source=source)
    if meta_size > MAX_METADATA:
        raise CorruptRecordError(f"metadata of {meta_size} bytes declared, more than Burn's limit "
                                 f"of {MAX_METADATA}", source=source)
    if HEADER_SIZE + meta_size > size:
        raise CorruptRecordError(f"truncated: {meta_size} bytes of metadata declared, "
                                 f"{size - HEADER_SIZE} remain", source=source)
    doc = cbor.decode(mv[HEADER_SIZE : HEADER_SIZE + meta_size], source)
    if not isinstance(doc, dict) or "tensors" not in doc or not isinstance(doc["tensors"], dict):
        raise CorruptRecordError("the metadata is not a map with `tensors`", source=source)
    unknown = set(doc) - {"tensors", "metadata", "scalars"}
    if unknown:
        raise CorruptRecordError(f"the metadata holds keys this trainrec does not know "
                                 f"({sorted(unknown)!r:.120}): a newer Burnpack?", source=source)
    meta, scalars_in = doc.get("metadata", {}), doc.get("scalars", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError("metadata.metadata is not a map of strings", source=source, key="metadata")
    if not isinstance(scalars_in, dict):
        raise CorruptRecordError("metadata.scalars is not a map", source=source, key="scalars")
    scalars = {k: _scalar(v, f"scalars.{k}", source) for k, v in scalars_in.items()}
    entries = doc["tensors"]
    if len(entries) > MAX_TENSORS:
        raise CorruptRecordError(f"{len(entries)} tensors, more than Burn's limit of {MAX_TENSORS}",
                                 source=source)
    start = -(-(HEADER_SIZE + meta_size) // ALIGNMENT) * ALIGNMENT
    found: list[tuple[int, int, str, DType, tuple[int, ...], Any, Any]] = []
    for name, desc in entries.items():
        key = f"tensors.{name}"
        if not isinstance(desc, dict) or not {"dtype", "shape", "data_offsets"} <= set(desc) \
                or set(desc) - {"dtype", "shape", "data_offsets", "param_id"}:
            raise CorruptRecordError("a tensor descriptor is {dtype, shape, data_offsets, param_id?}",
                                     source=source, key=key)
        dtype = _dtype(desc["dtype"], key, source)
        shape = _check_shape(desc["shape"], key, source)
        offsets = desc["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CorruptRecordError(f"data_offsets {offsets!r:.80} is not [start, end)", source=source, key=key)
        lo, hi = offsets
        need = math.prod(shape) * dtype.itemsize
        if hi - lo != need:
            raise CorruptRecordError(f"{dtype.value} tensor of shape {list(shape)} needs {need} bytes, "
                                     f"its data_offsets hold {hi - lo}", source=source, key=key)
        if start + hi > size:
            raise CorruptRecordError(f"truncated: the tensor ends at byte {start + hi}, the file has {size}",
                                     source=source, key=key)
        pid = desc.get("param_id")
        if pid is not None and not (isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**64):
            raise CorruptRecordError(f"param_id {pid!r:.40} is not a u64", source=source, key=key)
        plain = desc["dtype"] == _burn_dtype(dtype, {"Bool": "Native"})
        found.append((lo, hi, name, dtype, shape, pid, None if plain else desc["dtype"]))
    found.sort(key=lambda e: (e[0], e[1], e[2]))
    for a, b in zip(found, found[1:]):
        if b[0] < a[1] and b[1] > b[0]:
            raise CorruptRecordError(f"tensors {a[2]!r} and {b[2]!r} overlap in the data section (Burn's "
                                     "writer never overlaps them)", source=source, key=f"tensors.{b[2]}")
    tensors: dict[str, Item] = {}
    param_ids: dict[str, Item] = {}
    dtypes: dict[str, Item] = {}
    for lo, _, name, dtype, shape, pid, burn_dtype in found:
        tensors[name] = _tensor(buf, start + lo, dtype, shape)
        if pid is not None:
            param_ids[name] = pid
        if burn_dtype is not None:
            dtypes[name] = burn_dtype
    item: dict[str, Item] = {"tensors": tensors, "param_ids": param_ids, "metadata": dict(meta),
                             "scalars": scalars, "dtypes": dtypes}  # type: ignore[dict-item]
    written = " ".join(filter(None, (meta.get("producer", ""), meta.get("version", ""))))
    header = Header(BURNPACK, (version, 0), written or "burn (version not recorded)",
                    NativePrecisionSettings(), _kind(tensors, scalars))
    return header, item


def read_burnpack(path: str | os.PathLike[str], mmap: bool = False) -> tuple[Header, Item]:
    source = str(path)
    with reading(source):
        return parse_burnpack(_read_all(Path(path), source, mmap), source)


def _flat(item: Item, source: str) -> tuple[list[tuple[str, TensorData, int | None]], dict[str, str],
                                            dict[str, Any], dict[str, Any]]:
    """(name, tensor, param id) in order, metadata, scalars and Burn dtypes of a Burn item."""
    if not is_burn_item(item):
        raise CorruptRecordError("not a Burn record item (a Burnpack {tensors, param_ids, ...} or a "
                                 "NamedMpk {metadata, item, param_ids})", source=source)
    assert isinstance(item, dict)
    ids = item.get("param_ids") or {}
    dtypes = item.get("dtypes") or {}
    if not isinstance(ids, dict) or not isinstance(dtypes, dict):
        raise CorruptRecordError("param_ids and dtypes are maps", source=source)
    out: list[tuple[str, TensorData, int | None]] = []
    for name, t in module_tensors(item).items():
        pid = ids.get(name)
        if isinstance(pid, str):
            value = param_id_value(pid)
            if value is None:
                raise CorruptRecordError(f"ParamId {pid!r:.40} is not Burn's base32 (a legacy UUID id, "
                                         "which Burn hashes): it has no u64 to write", source=source, key=name)
            pid = value
        if pid is not None and not (isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**64):
            raise CorruptRecordError(f"param_id {pid!r:.40} is not a u64", source=source, key=name)
        out.append((name, t, pid))
    if isinstance(item.get("tensors"), dict):
        meta = item.get("metadata") or {}
        scalars = item.get("scalars") or {}
    else:
        meta = {"format": "burnpack", "producer": "trainrec", "version": __version__}
        scalars = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptRecordError("metadata is a map of strings", source=source, key="metadata")
    if not isinstance(scalars, dict):
        raise CorruptRecordError("scalars is a map", source=source, key="scalars")
    return (out, {str(k): str(v) for k, v in meta.items()},
            {k: _scalar(v, f"scalars.{k}", source) for k, v in scalars.items()}, dict(dtypes))


class BurnpackRecorder(RecorderBase):
    """Burnpack files (`.bpk`) as Burn >= 0.22 writes them. Saves a Burn item (either layout:
    a NamedMpk record becomes a Burnpack of the same tensors and ParamIds), or a
    TrainingRecord whose model is a Burn module record (`trainrec.conversion.burn_neutral`): the module
    at the path and, when its optimizer holds state, the optimizer record beside it at
    `<name>.optim.bpk` (Burn keeps them in separate files). Args: a path; output: the `Path`.
    """

    suffix = ".bpk"

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings or NativePrecisionSettings())  # Burn's dtypes as they are

    def save_item(self, item: Item, args: Any, record_type: str = "Item", *,
                  allow_lossy: bool = False) -> Path | str:
        from ..storage.location import location

        path = location(args)  # a store URL too: uploaded as it is written
        if isinstance(item, list) and record_type == "TrainingRecord":
            model, optimizer = split_training_item(item, str(path))
            if optimizer is not None:
                self.save_item(optimizer, optimizer_path(path), OPTIMIZER, allow_lossy=allow_lossy)
            item = model
        write_burnpack(path, item, self.settings, allow_lossy=allow_lossy, recorder=self.native_name())
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        from ..format.envelope import path_arg
        from ..storage.location import is_url

        if is_url(args):  # read from a private local copy (remote.read_staged)
            from .remote import read_staged

            return read_staged(args, lambda local: read_burnpack(local, False))
        return read_burnpack(path_arg(args), mmap)


def burnpack_layout(item: Item, settings: Any = None, *, allow_lossy: bool = False,
                    recorder: str = "BurnpackRecorder", source: str = "") -> tuple[bytes, list[tuple[int, TensorData]], int]:
    """(header and metadata bytes, (offset, stored tensor) in write order, total size) of
    the Burnpack file of `item`."""
    tensors, meta, scalars, dtypes = _flat(item, source)
    if len(tensors) > MAX_TENSORS:
        raise CorruptRecordError(f"{len(tensors)} tensors, more than Burn reads ({MAX_TENSORS})", source=source)
    s = settings or NativePrecisionSettings()
    placed: list[tuple[int, TensorData]] = []
    descs: dict[str, Any] = {}
    at = 0
    for name, t, pid in tensors:
        stored = _stored(t, s, name, allow_lossy, recorder)
        if len(stored.shape) > MAX_DIMS:
            raise CorruptRecordError(f"a tensor of {len(stored.shape)} dimensions", source=source, key=name)
        at = -(-at // ALIGNMENT) * ALIGNMENT
        given = dtypes.get(name)
        burn = given if given is not None and stored.dtype is t.dtype else _burn_dtype(stored.dtype, {"Bool": "Native"})
        desc: dict[str, Any] = {"dtype": burn, "shape": list(stored.shape), "data_offsets": [at, at + stored.nbytes]}
        if pid is not None:
            desc["param_id"] = pid
        descs[name] = desc
        placed.append((at, stored))
        at += stored.nbytes
    doc: dict[str, Any] = {"tensors": {k: descs[k] for k in sorted(descs)}}
    if meta:
        doc["metadata"] = {k: meta[k] for k in sorted(meta)}
    if scalars:
        doc["scalars"] = {k: scalars[k] for k in sorted(scalars)}
    blob = cbor.encode(doc)
    if len(blob) > MAX_METADATA:
        raise CorruptRecordError(f"metadata of {len(blob)} bytes, more than Burn reads", source=source)
    head = MAGIC + struct.pack("<HI", BURNPACK_VERSION, len(blob)) + blob
    start = -(-len(head) // ALIGNMENT) * ALIGNMENT
    return head + bytes(start - len(head)), placed, start + at


def write_burnpack(path: Path | str, item: Item, settings: Any = None, *, allow_lossy: bool = False,
                   recorder: str = "BurnpackRecorder") -> None:
    """Write `item` as a Burnpack file at `path` (atomically: an existing file survives a
    failed write), or upload it to the store URL `path` as it is written."""
    from ..storage.location import output

    head, placed, total = burnpack_layout(item, settings, allow_lossy=allow_lossy, recorder=recorder,
                                          source=str(path))
    with output(path, size_hint=total) as f:
        f.write(head)
        at = 0
        for offset, t in placed:
            if offset > at:
                f.write(bytes(offset - at))
            f.write(np.ascontiguousarray(t.read()).reshape(-1).view(np.uint8).data)
            at = offset + t.nbytes
