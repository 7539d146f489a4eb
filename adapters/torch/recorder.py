"""`TorchFileRecorder`: records as `.pt` files that `torch.load(weights_only=True)` reads.

The file is `torch.save` of plain containers only:
`{"format": "trainrec.torch", "version": [2, 0], "trainrec": str, "settings": {...},
"record": str, "item": tree, "checksums": [crc32, ...], "dtypes": [code | None, ...]}`
where the tree holds dicts, lists, scalars, str, bytes, None and CPU tensors, the two
tables have one entry per tensor in tree order (`iter_tensors`), `dtypes` the saved dtype
of each tensor the settings stored in another one (else None), and a zip comment
`trainrec.crc32:` + the CRC-32 of every byte before the file's last four holds them
(spec/FORMAT.md §8). Loading never calls `torch.load`: core reads the file without torch
(`trainrec.ptfile`, an allow-list interpreter of the pickle, no unpickler), which is also
faster (one read of the file instead of two).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainrec.adapter_kit import (
    FILE_CRC_BYTES,
    BF16PrecisionSettings,
    CrcWriter,
    DType,
    Header,
    Item,
    Precision,
    RecorderBase,
    RecorderError,
    TensorData,
    TensorTables,
    check_item,
    check_limits,
    header_fields,
    location,
    map_leaves,
    output,
    ptfile,
    read_url,
    reserve_bytes,
    store_tensor,
)

from .backend import from_torch_dtype

_COMMENT, _EOCD, FORMAT, VERSION, read_pt = (ptfile.COMMENT, ptfile.EOCD_BYTES, ptfile.FORMAT,
                                             ptfile.VERSION, ptfile.read_pt)

__all__ = ["TorchFileRecorder", "TorchPrecisionSettings", "BF16PrecisionSettings", "MIN_TORCH"]

MIN_TORCH = (2, 6)
"""The oldest torch trainrec supports (older `torch.load(weights_only=True)` could run
code from a file, CVE-2025-32434; trainrec's own reads never call it)."""


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
    ) -> Path | str:
        check_item(item)
        path = location(args)
        # the reader's bounds, at its depths: the item at 0, a tensor one leaf
        check_limits(item, depth=0, tensor_depth=0, source=str(path))
        tables = TensorTables()

        def convert(key: str, node: Any) -> Any:
            if isinstance(node, TensorData):
                t = store_tensor(node, self.settings, key=key, allow_lossy=allow_lossy,
                                 recorder=self.native_name())
                tables.add(node, t)  # in walk order, as the reader checks them
                return _to_torch(t)
            return node

        doc = {**header_fields(FORMAT, VERSION, self.settings, record_type),
               "item": map_leaves(item, convert), "checksums": tables.checksums, "dtypes": tables.dtypes}
        with output(path, size_hint=reserve_bytes(item, self.settings)) as f:
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
        """Header and item, read by core's torch-free reader (`trainrec.ptfile`): the
        pickle is interpreted with an allow-list of names, never unpickled, so reading
        runs no code from the file; `mmap=True` maps the file instead of reading it."""
        path = location(args)
        if isinstance(path, str):  # through a local copy (trainrec.remote)
            return read_url(path, mmap, only="trainrec.torch")
        return read_pt(path, mmap)
