"""Reading a distributed checkpoint's manifest and parts, bounded and checked before
anything is believed: `read_manifest` (format, version, world size, save id, part
names; a directory of another trainrec format is named), the parts' names, and the
checks a part's fields must pass. `DCPRecorder` reads its manifest through it too.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trainrec
from trainrec import CorruptRecordError, FileMissingError, RecorderError, UnsupportedVersionError
from trainrec.adapter_kit import Header, Item

FORMAT = "trainrec.distributed"
VERSION = (1, 0)
MANIFEST = "manifest.json"


def _part_name(rank: int, world: int, suffix: str) -> str:
    return f"rank-{rank:05d}-of-{world:05d}{suffix}"


def _read_manifest(path: Path) -> dict[str, Any]:
    return read_manifest(path, FORMAT, VERSION, "DistributedRecorder", lambda doc: {
        "record": isinstance(doc.get("record"), str),
        "replicated": doc.get("replicated") is None or (
            isinstance(doc.get("replicated"), str) and _safe_name(doc["replicated"])),
    })


_OTHER_FORMATS = {
    "trainrec.distributed": "a DistributedRecorder checkpoint (DDP: whole tensors per rank): load "
                            "it with TrainingRecord.load(trainrec.adapters.torch.DistributedRecorder(), "
                            "path, device, state_type=...)",
    "trainrec.dcp": "a DCPRecorder checkpoint (sharded, torch.distributed.checkpoint): load it "
                    "with trainrec.adapters.torch.DCPRecorder().load(path, model, optimizer, scheduler)",
}


def read_manifest(
    path: Path, fmt: str, version: tuple[int, int], recorder: str,
    fields: Callable[[dict[str, Any]], dict[str, bool]],
) -> dict[str, Any]:
    """The manifest of the checkpoint directory `path` that `recorder` commits (format
    `fmt`), checked: the format and its major version, `world_size`, `save_id`, one safe
    part name per rank, and `fields(doc)` (each recorder's own: name -> well formed).
    `CorruptRecordError` naming the file and the field, or the recorder that reads a
    checkpoint of the other distributed format."""
    file = path / MANIFEST
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a folder above it we may not search
        raise RecorderError(f"cannot read the checkpoint: {type(e).__name__}: {e.strerror or e}",
                            source=str(path)) from e
    if not is_dir:
        raise FileMissingError(f"no committed {recorder} checkpoint here (a save commits its "
                               "directory by renaming it into place)", source=str(path))
    data = _read_json_bytes(file, path, recorder)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise CorruptRecordError(f"unreadable {MANIFEST}: {e}", source=str(file)) from e
    other = doc.get("format") if isinstance(doc, dict) else None
    if other != fmt and other in _OTHER_FORMATS:
        raise CorruptRecordError(f"this is {_OTHER_FORMATS[other]}, not a {recorder} one",
                                 source=str(path))
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CorruptRecordError(f"{MANIFEST} is not a {fmt} manifest", source=str(file))
    got = doc.get("version")
    if not (isinstance(got, list) and len(got) == 2 and all(type(v) is int for v in got)):
        raise CorruptRecordError("malformed version", source=str(file), key="version")
    if got[0] != version[0]:
        older = (" (written by an older trainrec, before the checks of format "
                 f"{version[0]}.0: load it with the trainrec that wrote it and save it again)"
                 if got[0] < version[0] else " (written by a newer trainrec: upgrade trainrec)")
        raise UnsupportedVersionError(f"format version {got[0]}.{got[1]}, this trainrec "
                                      f"reads {version[0]}.x{older}", source=str(file))
    world = doc.get("world_size")
    parts = doc.get("parts")
    checks = {
        "world_size": type(world) is int and world >= 1,
        "save_id": isinstance(doc.get("save_id"), str),
        "parts": isinstance(parts, list) and len(parts) == world and all(
            isinstance(p, str) and _safe_name(p) for p in parts),
        **fields(doc),
    }
    for key, ok in checks.items():
        if not ok:
            raise CorruptRecordError(f"malformed {key}" + (_parts_count(world, parts) if key == "parts" else ""),
                                     source=str(file), key=key)
    return doc


MANIFEST_LIMIT = 64 << 20
"""The largest `manifest.json` read (a DCP manifest holds about 60 bytes a shard entry:
about a million entries; a DDP one a few hundred bytes)."""


def _read_json_bytes(file: Path, path: Path, recorder: str) -> bytes:
    """The bytes of the manifest `file`, bounded: a FIFO or device is refused without
    blocking on it, a file larger than `MANIFEST_LIMIT` unread, and one with more than a
    container (`[`, `{`) in 8 bytes unparsed (each costs about 60 bytes parsed: a manifest
    holds one in about 40). A permission or I/O error is a `RecorderError` (not damage)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptRecordError(f"the directory holds no {MANIFEST}: it is not a checkpoint "
                                 f"{recorder} committed", source=str(path)) from None
    except OSError as e:
        raise RecorderError(f"{MANIFEST} cannot be opened: {type(e).__name__}: "
                            f"{e.strerror or e}", source=str(file)) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO blocked the read; /dev/zero never ended
            raise CorruptRecordError(f"{MANIFEST} is not a regular file", source=str(file))
        if info.st_size > MANIFEST_LIMIT:
            raise CorruptRecordError(f"{MANIFEST} holds {info.st_size} bytes, more than the "
                                     f"{MANIFEST_LIMIT} a manifest is read up to",
                                     source=str(file))
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            data = f.read(MANIFEST_LIMIT + 1)
    except OSError as e:
        raise RecorderError(f"{MANIFEST} cannot be read: {type(e).__name__}: {e.strerror or e}",
                            source=str(file)) from e
    finally:
        os.close(fd)
    if len(data) > MANIFEST_LIMIT:
        raise CorruptRecordError(f"{MANIFEST} holds more than {MANIFEST_LIMIT} bytes",
                                 source=str(file))
    if data.count(b"[") + data.count(b"{") > len(data) // 8 + 64:
        raise CorruptRecordError(f"{MANIFEST} holds more containers than a manifest does: "
                                 "refused unparsed", source=str(file))
    return data


def _parts_count(world: Any, parts: Any) -> str:
    """What is wrong when `parts` does not list one name per rank (else nothing)."""
    if type(world) is int and isinstance(parts, list) and len(parts) != world:
        return f": it lists {len(parts)} part(s), world_size says {world} (the manifest was edited)"
    return ""


def _safe_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _read_part(file: Path, record_type: str, mmap: bool) -> tuple[Header, dict[str, Item]]:
    if not file.is_file():
        raise CorruptRecordError("a part the manifest lists is missing", source=str(file))
    header, item = trainrec.read_file(file, mmap=mmap)
    if header.record_type != record_type or not isinstance(item, dict):
        raise CorruptRecordError(f"holds a {header.record_type}, not a {record_type}",
                                 source=str(file))
    return header, item


def _expect_part(item: dict[str, Item], fields: dict[str, Item], file: Path) -> None:
    for key, want in fields.items():
        if item.get(key) != want:
            raise CorruptRecordError(
                f"{key} is {item.get(key)!r}, the manifest says {want!r} (a part of another "
                "save, or of another rank)", source=str(file), key=key)
