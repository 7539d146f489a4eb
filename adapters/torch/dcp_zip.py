"""`_read_in_place`: a DCP tensor entry read straight from the zip `torch.save` wrote into
its live tensor, when the entry's bytes are exactly the tensor's (one whole contiguous
tensor, stored uncompressed, in this machine's byte order); else nothing is read and DCP
reads the entry its own way.
"""

from __future__ import annotations

import io
import sys
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view

from trainrec import CorruptRecordError

from .dcp_unpickle import _Layout, _LayoutUnpickler


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _read_in_place(f: Any, where: Any, item: ReadItem, planner: LoadPlanner) -> bool:
    """Read the tensor entry `item`, stored at `where` in the open file `f`, straight into
    its live target and return True, when the entry's bytes are exactly the target's: one
    whole tensor saved by `torch.save` (no DCP transform), contiguous, in this machine's
    byte order, of the target's dtype and shape, the target a contiguous plain CPU tensor.
    Else return False, having read nothing into it: DCP reads that entry its own way (and
    raises what is wrong with it)."""
    if getattr(where, "transform_descriptors", None) or any(item.storage_offsets):
        return False
    target = planner.resolve_tensor(item).detach()
    if (type(target) is not torch.Tensor or target.device.type != "cpu"
            or target.layout != torch.strided or not target.is_contiguous() or target.is_conj()
            or target.is_neg() or target.is_quantized or target.is_inference()
            or tuple(item.lengths) != tuple(target.shape)):
        return False
    begin, length = int(where.offset), int(where.length)
    try:
        zipped = torch._C.PyTorchFileReader(cast(Any, _create_file_view(f, begin, length)))  # torch.load's
        if zipped.get_record("byteorder") != sys.byteorder.encode():
            return False  # torch.load swaps such bytes
        layout = _LayoutUnpickler(io.BytesIO(zipped.get_record("data.pkl"))).load()
        record = f"data/{layout.key}"
        start = cast(Any, zipped).get_record_offset(record)  # as torch.load(mmap=True) finds it
        size = zipped.get_record_size(record)
        header = cast(Any, zipped).get_record_header_offset(record)
        f.seek(begin + header)
        local = f.read(_LOCAL_HEADER)
    except Exception:  # noqa: BLE001 - not one plain tensor as torch.save writes it
        return False
    if not _stored_at(local, header, start):
        return False  # torch.load inflates a compressed record; this would read it raw
    nbytes = target.numel() * target.element_size()
    if (not isinstance(layout, _Layout) or layout.dtype != target.dtype
            or layout.shape != tuple(target.shape) or layout.offset != 0
            or layout.stride != _contiguous_strides(layout.shape) or layout.nbytes != nbytes
            or size != nbytes
            or type(start) is not int or start < 0 or start + nbytes > length):
        return False
    f.seek(begin + start)
    into = target.reshape(-1).view(torch.uint8).numpy().data  # the target's own bytes
    done = 0
    while done < nbytes:
        n = f.readinto(into[done:])
        if not n:
            raise CorruptRecordError(f"ends {nbytes - done} bytes before the end of the tensor "
                                     f"entry {item.dest_index.fqn!r}", source=str(f.name))
        done += n
    torch.autograd.graph.increment_version(target)  # as `copy_` does: a saved graph sees it
    planner.commit_tensor(item, target)
    return True


_LOCAL_HEADER = 30
"""The bytes of a zip local file header before its name and extra field."""


def _stored_at(local: bytes, header: int, start: int) -> bool:
    """Whether `local`, the zip local file header at `header`, is one of a record stored
    as it is (not compressed, not encrypted) whose bytes begin at `start`."""
    if type(header) is not int or len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        return False
    flags, method = int.from_bytes(local[6:8], "little"), int.from_bytes(local[8:10], "little")
    name, extra = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    return not flags & 1 and method == 0 and header + _LOCAL_HEADER + name + extra == start
