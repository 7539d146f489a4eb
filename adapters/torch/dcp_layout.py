"""What a `trainrec.dcp` checkpoint directory holds, and its reading without a process
group: the names (`FORMAT`, `MANIFEST`, `DCP_DIR`, the parts), the manifest's checks, the
parts, DCP's `.metadata` against the manifest (`_checked_metadata`), and `read_dcp`, the
format's reader (`trainrec inspect` / `verify`, `trainrec.read_file`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import trainrec
from trainrec import CorruptRecordError
from trainrec.adapter_kit import Header, Item

from .dcp_checksum import _check_checksums
from .dcp_metadata import check_chunks, open_regular, read_metadata
from .distributed_manifest import _safe_name, read_manifest

FORMAT = "trainrec.dcp"
VERSION = (3, 0)  # 2.0: every shard file's size and CRC-32 in the manifest; 3.0: the
# .metadata's size and CRC-32 and the optimizer's class too
MANIFEST = "manifest.json"
DCP_DIR = "dcp"
_PART = "trainrec.dcp.part"
_META = "trainrec"  # the DCP entry that repeats the manifest's facts


def _shards(manifest: dict[str, Any], path: Path) -> tuple[dict[str, int], dict[str, dict[tuple[int, int], int]]]:
    """The manifest's per-rank shard checksums as ({file: size}, {file: {(offset, length):
    CRC-32}}), each file named by one rank only."""
    sizes: dict[str, int] = {}
    crcs: dict[str, dict[tuple[int, int], int]] = {}
    for part in manifest["shards"]:
        for name, entry in part.items():
            if name in sizes:
                raise CorruptRecordError(f"{MANIFEST} lists shard file {name} twice",
                                         source=str(path), key="shards")
            sizes[name] = entry["size"]
            crcs[name] = {(o, n): c for o, n, c in entry["items"]}
    return sizes, crcs


def _well_formed_shards(doc: dict[str, Any]) -> bool:
    shards = doc.get("shards")
    return isinstance(shards, list) and len(shards) == doc.get("world_size") and all(
        isinstance(part, dict) and all(
            isinstance(name, str) and _safe_name(name) and isinstance(entry, dict)
            and set(entry) == {"size", "items"} and type(entry["size"]) is int
            and isinstance(entry["items"], list) and all(
                isinstance(i, list) and len(i) == 3 and all(type(v) is int and v >= 0 for v in i)
                for i in entry["items"])
            for name, entry in part.items())
        for part in shards)


def read_dcp(path: Path, mmap: bool = False) -> tuple[Header, Item]:
    """The `trainrec.dcp` format's reader (`trainrec inspect` / `verify`, and
    `trainrec.read_file`), in one process without a process group: the manifest, every
    rank's part (scheduler and caller state; their checksums checked), and what DCP's
    `.metadata` says of each entry (dtype and shape, not the values: loading them needs
    `DCPRecorder().load`), after checking `.metadata` and every shard file against the size
    and CRC-32 the save recorded in the manifest (a missing, truncated or changed shard
    file is refused). `checked` says how many entries (and bytes) were checked."""
    del mmap
    path = Path(path)
    manifest = _read_manifest(path)
    parts = [_read_part(path, manifest, r) for r in range(manifest["world_size"])]
    header = dataclasses.replace(trainrec.read_file(path / manifest["parts"][0])[0],
                                 format=FORMAT, version=VERSION, record_type="TrainingRecord")
    metadata, crcs = _checked_metadata(path, manifest)
    where = {(str(w.relative_path), int(w.offset), int(w.length))
             for w in metadata.storage_data.values()}
    _check_checksums(path / manifest["dcp"], where, crcs)
    entries: dict[str, Item] = {}
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            entries[key] = f"{dtype}{list(meta.size)}"
        else:
            entries[key] = "bytes"
    fields = ("world_size", "save_id", "grads", "optimizer_state", "optimizer", "scheduler",
              "state")
    item: dict[str, Item] = {
        "manifest": {k: manifest.get(k) for k in fields},
        "dcp": entries,
        "parts": [{"scheduler": p.get("scheduler"), "state": p.get("state")} for p in parts],
        "checked": {"entries": len(where), "bytes": sum(n for _, _, n in where),
                    "metadata_bytes": manifest["metadata"]["size"]},
    }
    return header, item


def _checked_metadata(path: Path, manifest: dict[str, Any]) -> tuple[Any, dict[str, dict[tuple[int, int], int]]]:
    """DCP's `.metadata` of the checkpoint `path` (`dcp_metadata.read_metadata`: bounded,
    its size and CRC-32 the save's, DCP's classes only, every value of its kind) and the
    manifest's CRC-32 of each shard entry, after checking that the chunks tile every
    tensor, that every shard file it names exists, holds the bytes it points to and is one
    the manifest has the checksum of, of that size, and the reverse (`CorruptRecordError`).
    The bytes themselves are checked as they are read."""
    folder = path / manifest["dcp"]
    sizes, crcs = _shards(manifest, path)
    entries = sum(len(v) for v in crcs.values())
    metadata = read_metadata(folder, manifest["metadata"], manifest["save_id"], entries)
    check_chunks(metadata, folder)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = str(info.relative_path)
        if not (type(info.offset) is int and type(info.length) is int
                and info.offset >= 0 and info.length >= 0):
            # DCP slices the file with them: a float passed every check, then failed
            # DCP's read of the tensors after some live ones had changed
            raise CorruptRecordError(
                f"DCP's .metadata gives the entry in shard file {name!r} offset "
                f"{info.offset!r} and length {info.length!r}, not byte counts",
                source=str(folder))
        if not _safe_name(name):
            raise CorruptRecordError(f"DCP's .metadata names a shard file {name!r} outside "
                                     "the checkpoint", source=str(folder))
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        if name not in sizes:
            raise CorruptRecordError(f"shard file {name} has no checksum in {MANIFEST}",
                                     source=str(folder / name))
        fd = open_regular(folder / name, f"shard file {name}")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < end:
            raise CorruptRecordError(f"shard file {name} holds {size} bytes, DCP's .metadata "
                                     f"points to {end}", source=str(folder / name))
        if size != sizes[name]:
            raise CorruptRecordError(f"shard file {name} holds {size} bytes, the save wrote "
                                     f"{sizes[name]}", source=str(folder / name))
    unread = sorted(set(sizes) - set(ends))
    if unread:
        raise CorruptRecordError(f"{MANIFEST} lists shard file {unread[0]}, which DCP's "
                                 ".metadata does not name", source=str(folder))
    return metadata, crcs


def _part_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.mpk"


def _read_manifest(path: Path) -> dict[str, Any]:
    doc = read_manifest(path, FORMAT, VERSION, "DCPRecorder", lambda doc: {
        "dcp": isinstance(doc.get("dcp"), str) and _safe_name(doc["dcp"]),
        "grads": isinstance(doc.get("grads"), list) and all(isinstance(g, str) for g in doc["grads"]),
        "optimizer_state": isinstance(doc.get("optimizer_state"), bool),
        "shards": _well_formed_shards(doc),
        "metadata": isinstance(doc.get("metadata"), dict) and set(doc["metadata"]) == {
            "size", "crc32"} and all(type(v) is int and v >= 0 for v in doc["metadata"].values()),
        "optimizer": isinstance(doc.get("optimizer"), str),
    })
    return doc


def _read_part(path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    file = path / manifest["parts"][rank]
    if not file.is_file():
        raise CorruptRecordError("a part the manifest lists is missing", source=str(file))
    header, item = trainrec.read_file(file)
    if header.record_type != _PART or not isinstance(item, dict):
        raise CorruptRecordError(f"holds a {header.record_type}, not a {_PART}", source=str(file))
    want = {"rank": rank, "world_size": manifest["world_size"], "save_id": manifest["save_id"]}
    for key, value in want.items():
        if item.get(key) != value:
            raise CorruptRecordError(
                f"{key} is {item.get(key)!r}, the manifest says {value!r} (a part of another "
                "save, or of another rank)", source=str(file), key=key)
    return item
