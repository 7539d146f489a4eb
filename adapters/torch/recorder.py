"""`TorchFileRecorder`: records as `.pt` files that `torch.load(weights_only=True)` reads.

The file is `torch.save` of plain containers only:
`{"format": "trainrec.torch", "version": [2, 0], "trainrec": str, "settings": {...},
"record": str, "item": tree, "checksums": [crc32, ...], "dtypes": [code | None, ...]}`
where the tree holds dicts, lists, scalars, str, bytes, None and CPU tensors, the two
tables have one entry per tensor in tree order (`iter_tensors`), `dtypes` the saved dtype
of each tensor the settings stored in another one (else None), and a zip comment
`trainrec.crc32:` + the CRC-32 of every byte before the file's last four holds them
(spec/ADAPTERS.md). Loading checks that checksum and the zip's directory (every entry
stored uncompressed, within the file) before `torch.load`, only ever uses
`weights_only=True`, and refuses torch older than 2.6 (CVE-2025-32434).
"""

from __future__ import annotations

import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainrec import (
    CorruptRecordError,
    DType,
    Header,
    Precision,
    RecorderError,
    TensorData,
)
from trainrec._atomic import atomic_write
from trainrec.envelope import (
    FILE_CRC_BYTES,
    CrcWriter,
    TensorTables,
    check_file_crc,
    file_crc,
    header_fields,
    parse_header,
    path_arg,
    reserve_bytes,
    restore_dtypes,
    verify_checksums,
)
from trainrec.errors import reading
from trainrec.format import check_limits
from trainrec.items import Item, check_item, join_key
from trainrec.precision import store_tensor
from trainrec.recorders import RecorderBase
from trainrec.sniff import HEAD_BYTES, kind_of, reader_of

from .backend import from_torch_dtype, tensor_to_numpy, to_torch_dtype

__all__ = ["TorchFileRecorder", "TorchPrecisionSettings", "BF16PrecisionSettings", "MIN_TORCH"]

FORMAT = "trainrec.torch"
VERSION = (2, 0)
MIN_TORCH = (2, 6)
_COMMENT = b"trainrec.crc32:"
_EOCD = 22
"""Bytes of a zip's end-of-central-directory record without its comment."""
_TRAILER = _EOCD + len(_COMMENT) + FILE_CRC_BYTES


@dataclass(frozen=True)
class BF16PrecisionSettings(Precision):
    """Floats as bf16, ints kept."""

    name: str = "bf16"
    float_dtype: DType | None = DType.BF16
    int_dtype: DType | None = None


def TorchPrecisionSettings(  # noqa: N802 - reads as the settings it builds
    float_dtype: torch.dtype | None = None, int_dtype: torch.dtype | None = None
) -> Precision:
    """Precision settings named in torch dtypes, e.g. `TorchPrecisionSettings(torch.bfloat16)`."""
    f = None if float_dtype is None else from_torch_dtype(float_dtype)
    i = None if int_dtype is None else from_torch_dtype(int_dtype)
    name = f"torch-{f.value if f else 'native'}-{i.value if i else 'native'}"
    return Precision(name, f, i)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _to_torch(t: TensorData) -> torch.Tensor:
    arr = t.array
    if t.dtype is DType.BF16:
        arr = arr.view(np.int16)
    with warnings.catch_warnings():
        # torch.save only reads these views of read-only arrays
        warnings.simplefilter("ignore", UserWarning)
        out = torch.from_numpy(arr)
    return out.view(torch.bfloat16) if t.dtype is DType.BF16 else out


class TorchFileRecorder(RecorderBase):
    """Records in a `.pt` file (args: a path; output: the `Path`). `load(..., mmap=True)`
    passes `mmap=True` to `torch.load`."""

    suffix = ".pt"

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path:
        check_item(item)
        path = path_arg(args)
        # the reader's bounds, at its depths: the item at 0, a tensor one leaf
        check_limits(item, depth=0, tensor_depth=0, source=str(path))
        tables = TensorTables()

        def convert(node: Item, key: str) -> Any:
            if isinstance(node, TensorData):
                t = store_tensor(node, self.settings, key=key, allow_lossy=allow_lossy,
                                 recorder=self.native_name())
                tables.add(node, t)
                return _to_torch(t)
            if isinstance(node, dict):
                return {k: convert(v, join_key(key, k)) for k, v in node.items()}
            if isinstance(node, list):
                return [convert(v, join_key(key, i)) for i, v in enumerate(node)]
            return node

        doc = {**header_fields(FORMAT, VERSION, self.settings, record_type),
               "item": convert(item, ""), "checksums": tables.checksums, "dtypes": tables.dtypes}
        with atomic_write(path, size_hint=reserve_bytes(item, self.settings)) as f:
            sink = CrcWriter(f, hold=_EOCD)
            torch.save(doc, sink)  # type: ignore[arg-type]  # a file-like writer, as torch.save takes
            end = sink.held
            if len(end) != _EOCD or end[:4] != b"PK\x05\x06" or end[-2:] != b"\x00\x00":
                raise RecorderError("torch.save ended its zip file in an unexpected way",
                                    source=str(path))
            comment = len(_COMMENT) + FILE_CRC_BYTES
            sink.release(end[:-2] + comment.to_bytes(2, "little") + _COMMENT)
            f.write(sink.crc.to_bytes(FILE_CRC_BYTES, "big"))
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        if _torch_version() < MIN_TORCH:
            raise RecorderError(
                f"torch {torch.__version__} can execute code from a .pt file even with "
                "weights_only=True (CVE-2025-32434); trainrec loads .pt files only with torch>=2.6"
            )
        path = path_arg(args)
        source = str(path)
        with reading(source):
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
                if kind_of(head) != "torch":
                    raise CorruptRecordError(
                        "not a .pt zip file (wrong magic)" + reader_of(head, not_="torch"),
                        source=source)
                size = os.fstat(f.fileno()).st_size
                verified = _check_file_crc(f, size, source)
                pickle_bytes = _check_zip(f, size, source)
        try:
            doc = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:  # torch raises many types for a bad file; all mean "corrupt"
            raise CorruptRecordError(f"not a loadable .pt file: {type(e).__name__}: {e}",
                                     source=source) from None
        return _parse(doc, source, verified, pickle_bytes)


def _check_file_crc(f: Any, size: int, source: str) -> bool:
    """True when the file ends with our checksum trailer and the checksum matches; False
    when it has no trailer (a 1.x file, or not ours); `ChecksumError` on a mismatch."""
    if size < _TRAILER:
        return False
    f.seek(size - _TRAILER)
    end = f.read(_TRAILER)
    comment = len(_COMMENT) + FILE_CRC_BYTES
    if end[:4] != b"PK\x05\x06" or end[20:22] != comment.to_bytes(2, "little") \
            or end[_EOCD : _EOCD + len(_COMMENT)] != _COMMENT:
        return False
    check_file_crc(*file_crc(f, size, source), source)
    return True


def _check_zip(f: Any, size: int, source: str) -> int:
    """The size of the archive's pickle, after checking that every entry is stored
    uncompressed, within the file: torch then reads no more bytes than the file holds."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except Exception as e:  # zipfile raises many types for a bad file; all mean "corrupt"
        raise CorruptRecordError(f"not a loadable .pt file: {type(e).__name__}: {e}",
                                 source=source) from None
    total, pickle_bytes = 0, 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptRecordError(f"zip entry {info.filename!r} is compressed; trainrec "
                                     ".pt files store every entry as is", source=source)
        total += info.file_size
        if info.filename.endswith("/data.pkl"):
            pickle_bytes = info.file_size
    if total > size:
        raise CorruptRecordError("zip entries claim more bytes than the file holds", source=source)
    return pickle_bytes


def _parse(doc: Any, source: str, verified: bool, pickle_bytes: int) -> tuple[Header, Item]:
    def fail(msg: str, key: str = "") -> CorruptRecordError:
        return CorruptRecordError(msg, source=source, key=key)

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail("not a trainrec .pt record (wrong magic)")
    header = parse_header(doc, FORMAT, VERSION[0], source)
    if not verified:
        raise fail("the file checksum is missing or damaged")
    # each reference in the pickle is at least one byte of it: a tree that visits more
    # nodes shares containers ("billion laughs") and would take forever to walk
    budget = [pickle_bytes + 64]
    storages: set[int] = set()

    def convert(node: Any, key: str, depth: int) -> Item:
        if depth > 64:
            raise fail("nesting deeper than 64", key)
        budget[0] -= 1
        if budget[0] < 0:
            raise fail("the pickle refers to the same objects over and over", key)
        if isinstance(node, torch.Tensor):
            return tensor(node, key)
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise fail("map keys must be strings", key)
            return {k: convert(v, join_key(key, k), depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, join_key(key, i), depth + 1) for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str, bytes)):
            return node
        raise fail(f"{type(node).__name__} is not an item", key)

    def tensor(node: torch.Tensor, key: str) -> TensorData:
        try:
            dtype = from_torch_dtype(node.dtype)
        except TypeError as e:
            raise fail(str(e), key) from None
        if type(node) is not torch.Tensor or node.requires_grad:
            raise fail("not a plain tensor (a subclass, or one that requires grad)", key)
        if node.dtype != to_torch_dtype(dtype) or node.layout != torch.strided:
            raise fail("unsupported tensor layout", key)
        storage = node.untyped_storage()
        nbytes = node.numel() * node.element_size()
        # trainrec writes each tensor as its own whole, contiguous storage: nothing else
        # can make a load hold more than the file (stride 0, views, shared storages)
        if not node.is_contiguous() or node.storage_offset() or storage.nbytes() != nbytes \
                or (nbytes and storage.data_ptr() in storages):
            raise fail("tensor is not the whole of its own contiguous storage", key)
        if nbytes:
            storages.add(storage.data_ptr())
        return TensorData.from_array(tensor_to_numpy(node), copy=False)

    item = convert(doc.get("item"), "item", 0)
    # the file checksum covered every byte, tensors' included
    verify_checksums(item, doc["checksums"], source, recompute=False)
    return header, restore_dtypes(item, doc.get("dtypes"), source)
