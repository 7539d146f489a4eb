"""The torch adapter's record file formats, `trainrec check --recorder` names and fork check,
declared in trainrec's entry points (`trainrec.formats`, `trainrec.check_recorders`,
`trainrec.fork_prepare`) as any adapter's are. Importing this module imports no torch: each reader and recorder is
imported when first used (a `.pt` file is read by core's torch-free reader)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainrec import Format, RecorderError
from trainrec.adapter_kit import Header, Item, PrecisionSettings, ptfile

__all__ = ["TORCH", "DISTRIBUTED", "DCP", "file_recorder", "ddp_recorder", "dcp_recorder",
           "fork_prepare"]


def _sniff_torch(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def _read_torch(path: Path, mmap: bool) -> tuple[Header, Item]:
    return ptfile.read_pt(path, mmap)


def _sniff_manifest(name: str) -> Callable[[bytes], bool]:
    """A distributed checkpoint's `manifest.json` (keys sorted) names its format at once."""
    want = f'"format": "{name}"'.encode()
    return lambda head: head.lstrip().startswith(b"{") and want in head


def _torch_reader(fmt: str, module: str, name: str) -> Callable[[Path, bool], tuple[Header, Item]]:
    """The reader `name` of this adapter's `module`, imported when first used
    (`RecorderError` naming the extra without torch)."""
    def read(path: Path, mmap: bool) -> tuple[Header, Item]:
        try:
            reader = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise RecorderError(f"reading a {fmt} checkpoint needs torch ({e}): "
                                "pip install 'trainrec[torch]'", source=str(path)) from e
        result: tuple[Header, Item] = reader(path, mmap)
        return result
    return read


def _dcp_entries(item: Item) -> tuple[str, int, int]:
    """How many DCP entries (and bytes) `read_dcp` checked."""
    checked = item.get("checked") if isinstance(item, dict) else None
    entries = checked.get("entries") if isinstance(checked, dict) else None
    nbytes = checked.get("bytes") if isinstance(checked, dict) else None
    if not (isinstance(entries, int) and isinstance(nbytes, int)):
        return "DCP entries", 0, 0
    return "DCP entries", entries, nbytes


TORCH = Format(
    "trainrec.torch", (".pt",), _sniff_torch, _read_torch,
    "trainrec.adapters.torch.recorder:TorchFileRecorder",
    "a .pt zip file: trainrec.adapters.torch.TorchFileRecorder reads it",
    "the file checksum over every byte (header, structure, tensors, zip framing)")

DISTRIBUTED = Format(
    "trainrec.distributed", (), _sniff_manifest("trainrec.distributed"),
    _torch_reader("trainrec.distributed", "trainrec.adapters.torch.distributed", "read_distributed"),
    "trainrec.adapters.torch.distributed:DistributedRecorder",
    "a DDP checkpoint directory: trainrec.adapters.torch.DistributedRecorder reads it "
    "(shown: rank 0's view)",
    "the manifest, and every rank's part: its checksums, rank and save id",
    marker="manifest.json",
    partial="rank 0's part only (the other ranks' pending gradients and state are left out)")

DCP = Format(
    "trainrec.dcp", (), _sniff_manifest("trainrec.dcp"),
    _torch_reader("trainrec.dcp", "trainrec.adapters.torch.dcp", "read_dcp"),
    "trainrec.adapters.torch.dcp:DCPRecorder",
    "a sharded (FSDP2) checkpoint directory of torch.distributed.checkpoint: "
    "trainrec.adapters.torch.DCPRecorder loads it (shown: its entries' dtypes and "
    "shapes, every rank's scheduler and caller state)",
    "the manifest, every rank's part (checksums, rank, save id), DCP's .metadata (its "
    "CRC-32, and that its chunks tile every tensor), and every DCP entry's bytes "
    "against the CRC-32 the save recorded in the manifest",
    marker="manifest.json", entries=_dcp_entries,
    partial="what each entry is (dtype and shape), not its values")


def file_recorder(native: PrecisionSettings) -> Any:
    """`trainrec check --recorder torch`: a `.pt` file at native precision."""
    from .recorder import TorchFileRecorder

    return TorchFileRecorder(native)


def ddp_recorder(native: PrecisionSettings) -> Any:
    """`trainrec check --recorder ddp`: one DDP checkpoint directory for all ranks."""
    from .distributed import DistributedRecorder

    return DistributedRecorder()


def dcp_recorder(native: PrecisionSettings) -> Any:
    """`trainrec check --recorder dcp`: one sharded DCP directory for all ranks."""
    from .dcp import DCPRecorder

    return DCPRecorder()


def fork_prepare() -> str | None:
    """`trainrec.check.zygote`'s fork check for a process that imported torch: a CUDA
    context cannot be used in a forked process (the reason, then); otherwise import what
    building an optimizer imports (`torch._dynamo`, about 1.5 s of CPU), once for every run."""
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA is initialized in it (a forked process cannot use CUDA)"
    import torch._dynamo  # noqa: F401 - torch.optim.Optimizer's __init__ imports it

    return None
