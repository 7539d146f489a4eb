"""The CRC-32 of every entry DCP writes, which DCP keeps none of: `_Writer` remembers where
each entry went, `_checksums` computes what goes into the manifest, `_check_checksums`
refuses an entry whose bytes are not those the save wrote.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from trainrec import ChecksumError, CorruptRecordError, RecorderError
from trainrec.adapter_kit import crc32

_CHUNK = 8 << 20


class _Writer(FileSystemWriter):
    """DCP's file writer, remembering where it wrote each entry (file, offset, length):
    their checksums go into the manifest. DCP's `.metadata` names the save (`save_id`,
    DCP's own a random uuid): a `dcp/` folder of another save is told by it."""

    def __init__(self, folder: Path, save_id: str) -> None:
        super().__init__(str(folder))
        self.items: list[tuple[str, int, int]] = []
        self._save_id = save_id

    def storage_meta(self) -> Any:
        meta = super().storage_meta()
        if meta is not None:
            meta.save_id = self._save_id
        return meta

    def write_data(self, plan: Any, planner: Any) -> Any:
        done = super().write_data(plan, planner)
        done.wait()  # FileSystemWriter writes before it returns; this raises what failed
        self.items = sorted({(str(r.storage_data.relative_path), int(r.storage_data.offset),
                              int(r.storage_data.length)) for r in done.value()})
        return done


def _range_crc(f: Any, offset: int, length: int, buffer: memoryview) -> int:
    """CRC-32 of `length` bytes of the open file `f` from `offset`, read through `buffer`
    (`CorruptRecordError` when the file ends before)."""
    f.seek(offset)
    crc, left = 0, length
    while left:
        n = f.readinto(buffer[:min(left, len(buffer))])
        if not n:
            raise CorruptRecordError(f"ends {left} bytes before the entry at offset {offset} "
                                     f"of {length} bytes", source=str(f.name))
        crc = crc32(buffer[:n], crc)
        left -= n
    return crc


def _checksums(folder: Path, items: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """{file: {"size": bytes, "items": [[offset, length, CRC-32], ...]}} of the entries
    `items` (file, offset, length) this rank wrote into `folder`."""
    buffer = memoryview(bytearray(_CHUNK))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in sorted(set(items)):
        by_file.setdefault(name, []).append((offset, length))
    out: dict[str, Any] = {}
    for name, entries in by_file.items():
        with open(folder / name, "rb", buffering=0) as f:  # once a file, not once an entry
            out[name] = {"size": os.fstat(f.fileno()).st_size,
                         "items": [[o, n, _range_crc(f, o, n, buffer)] for o, n in entries]}
    return out


def _check_checksums(folder: Path, items: Iterable[tuple[str, int, int]],
                     shards: dict[str, dict[tuple[int, int], int]]) -> None:
    """`CorruptRecordError` for the first entry of `items` (file, offset, length) whose
    bytes are not those the save wrote (the manifest's CRC-32 of that entry)."""
    buffer = memoryview(bytearray(_CHUNK))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in set(items):
        by_file.setdefault(name, []).append((offset, length))
    for name in sorted(by_file):
        try:
            with open(folder / name, "rb", buffering=0) as f:
                for offset, length in sorted(by_file[name]):
                    want = shards.get(name, {}).get((offset, length))
                    if want is None:
                        raise CorruptRecordError(
                            f"DCP's .metadata points to {length} bytes at offset {offset} of "
                            f"shard file {name}, an entry the save did not write",
                            source=str(folder / name))
                    crc = _range_crc(f, offset, length, buffer)
                    if crc != want:
                        raise ChecksumError(
                            f"shard file {name} is damaged: the {length} bytes at offset "
                            f"{offset} have CRC-32 {crc:08x}, the save wrote {want:08x}",
                            source=str(folder / name))
        except FileNotFoundError as e:
            raise CorruptRecordError(f"shard file {name} is missing", source=str(folder / name)) from e
        except OSError as e:  # permissions, I/O: the file is not known to be damaged
            raise RecorderError(f"shard file {name} cannot be read: {type(e).__name__}: {e}",
                                source=str(folder / name)) from e
