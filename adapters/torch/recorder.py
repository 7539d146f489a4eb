"""`TorchFileRecorder`: records as `.pt` files that `torch.load(weights_only=True)` reads.

The file is `torch.save` of plain containers only:
`{"format": "trainrec.torch", "version": [1, 1], "trainrec": str, "settings": {...},
"record": str, "item": tree, "checksums": {key path: crc32}, "dtypes": {key path: code}}`
where the tree holds dicts, lists, scalars, str, bytes, None and CPU tensors, and `dtypes`
names the saved dtype of each tensor the settings stored in another one (absent in 1.0). Loading only ever uses
`weights_only=True` and refuses torch older than 2.6 (CVE-2025-32434).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainrec import (
    CorruptRecordError,
    DType,
    FileMissingError,
    Header,
    Precision,
    RecorderError,
    TensorData,
)
from trainrec._atomic import atomic_write
from trainrec.envelope import (
    crc_of,
    header_fields,
    parse_header,
    path_arg,
    reserve_bytes,
    restore_dtypes,
    verify_checksums,
)
from trainrec.format import check_limits
from trainrec.items import Item, check_item, join_key
from trainrec.precision import store_tensor
from trainrec.recorders import RecorderBase
from trainrec.sniff import HEAD_BYTES, kind_of, reader_of

from .backend import from_torch_dtype, tensor_to_numpy, to_torch_dtype

__all__ = ["TorchFileRecorder", "TorchPrecisionSettings", "BF16PrecisionSettings", "MIN_TORCH"]

FORMAT = "trainrec.torch"
VERSION = (1, 1)
MIN_TORCH = (2, 6)


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

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path:
        check_item(item)
        path = path_arg(args)
        # the reader's bounds, at its depths: the item at 0, a tensor one leaf
        check_limits(item, depth=0, tensor_depth=0, source=str(path))
        checksums: dict[str, int] = {}
        dtypes: dict[str, str] = {}

        def convert(node: Item, key: str) -> Any:
            if isinstance(node, TensorData):
                t = store_tensor(node, self.settings, key=key, allow_lossy=allow_lossy,
                                 recorder=self.native_name())
                if t.dtype is not node.dtype:
                    dtypes[key] = node.dtype.value
                checksums[key] = crc_of(t)
                return _to_torch(t)
            if isinstance(node, dict):
                return {k: convert(v, join_key(key, k)) for k, v in node.items()}
            if isinstance(node, list):
                return [convert(v, join_key(key, i)) for i, v in enumerate(node)]
            return node

        doc = {**header_fields(FORMAT, VERSION, self.settings, record_type),
               "item": convert(item, ""), "checksums": checksums, "dtypes": dtypes}
        with atomic_write(path, size_hint=reserve_bytes(item, self.settings)) as f:
            torch.save(doc, f)
        return path

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        if _torch_version() < MIN_TORCH:
            raise RecorderError(
                f"torch {torch.__version__} can execute code from a .pt file even with "
                "weights_only=True (CVE-2025-32434); trainrec loads .pt files only with torch>=2.6"
            )
        path = path_arg(args)
        source = str(path)
        if not path.exists():
            raise FileMissingError("no such checkpoint", source=source)
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
        if kind_of(head) != "torch":
            raise CorruptRecordError("not a .pt zip file (wrong magic)" + reader_of(head, not_="torch"),
                                     source=source)
        try:
            doc = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:  # torch raises many types for a bad file; all mean "corrupt"
            raise CorruptRecordError(f"not a loadable .pt file: {type(e).__name__}: {e}",
                                     source=source) from None
        return _parse(doc, source)


def _parse(doc: Any, source: str) -> tuple[Header, Item]:
    def fail(msg: str, key: str = "") -> CorruptRecordError:
        return CorruptRecordError(msg, source=source, key=key)

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail("not a trainrec .pt record (wrong magic)")
    header = parse_header(doc, FORMAT, VERSION[0], source)

    def convert(node: Any, key: str, depth: int) -> Item:
        if depth > 64:
            raise fail("nesting deeper than 64", key)
        if isinstance(node, torch.Tensor):
            try:
                dtype = from_torch_dtype(node.dtype)
            except TypeError as e:
                raise fail(str(e), key) from None
            if node.dtype != to_torch_dtype(dtype) or node.layout != torch.strided:
                raise fail("unsupported tensor layout", key)
            return TensorData.from_array(tensor_to_numpy(node.contiguous()), copy=False)
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise fail("map keys must be strings", key)
            return {k: convert(v, join_key(key, k), depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, join_key(key, i), depth + 1) for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str, bytes)):
            return node
        raise fail(f"{type(node).__name__} is not an item", key)

    item = convert(doc.get("item"), "item", 0)
    verify_checksums(item, doc["checksums"], source)
    return header, restore_dtypes(item, doc.get("dtypes"), source)
