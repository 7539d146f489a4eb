"""Commit objects: how a checkpoint made of several objects becomes visible at once on a
store without rename (spec/PROTOCOLS.md, "Checkpoints on object stores").

A save uploads its data objects first, each under a name of its own save (`save` id in
the name, so no other save's upload can replace it), then writes one small commit object,
last, and only if none is there (S3's `If-None-Match: *`). The commit object is a JSON
document naming every object of the checkpoint with its role, size and CRC-32, and its
own CRC-32 over the rest of the document. A checkpoint exists exactly when its commit
object does: readers, `latest` and `trainrec verify` list commit objects only, and read an
object only through its commit, refusing one whose size or CRC differs (`expecting`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptRecordError, FileMissingError, UnsupportedVersionError
from ..items.checksum import crc32
from .files import parse_json
from .location import Written
from .store import Store

__all__ = ["COMMIT_SUFFIX", "Commit", "CommitObject", "encode", "decode", "read_commit",
           "expectations"]

COMMIT_SUFFIX = ".commit"
FORMAT = "trainrec.commit"
VERSION = 1
MAX_BYTES = 1 << 20
"""A commit object is read only up to this size."""


@dataclass(frozen=True)
class CommitObject:
    """One object of a checkpoint: its `role` ("checkpoint", "metrics", ...), its `name`
    in the commit's folder, and what its upload wrote."""

    role: str
    name: str
    size: int
    crc32: int


@dataclass(frozen=True)
class Commit:
    """A committed checkpoint: `step` (None outside a manager), the `save` that wrote it,
    and its objects."""

    step: int | None
    save: str
    objects: tuple[CommitObject, ...]

    def named(self, role: str) -> CommitObject | None:
        return next((o for o in self.objects if o.role == role), None)


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def encode(commit: Commit) -> bytes:
    """The commit object's bytes: the document, with its CRC-32 over the canonical JSON of
    everything else in it."""
    doc: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "step": commit.step, "save": commit.save,
        "objects": [{"role": o.role, "name": o.name, "size": o.size, "crc32": f"{o.crc32:08x}"}
                    for o in commit.objects],
    }
    doc["crc32"] = f"{crc32(_canonical(doc)):08x}"
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def decode(data: bytes, source: str) -> Commit:
    """The commit in `data`; `CorruptRecordError` for anything but an intact commit
    document (bad JSON, a wrong checksum, a malformed field), `UnsupportedVersionError`
    for a newer major version."""
    doc = parse_json(data, max_bytes=MAX_BYTES, max_depth=4, source=source)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptRecordError(f"not a {FORMAT} object", source=source)
    if doc.get("version") != VERSION:
        raise UnsupportedVersionError(f"commit version {doc.get('version')!r}; this trainrec "
                                      f"reads version {VERSION}", source=source)
    stated = doc.pop("crc32", None)
    if not isinstance(stated, str) or stated != f"{crc32(_canonical(doc)):08x}":
        raise CorruptRecordError(f"the commit's CRC-32 does not match ({stated!r}): damaged",
                                 source=source)
    step, save, objects = doc.get("step"), doc.get("save"), doc.get("objects")
    if not (step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 0)):
        raise CorruptRecordError(f"the commit's step is {step!r}", source=source)
    if not isinstance(save, str) or not isinstance(objects, list):
        raise CorruptRecordError("the commit lacks its save id or object list", source=source)
    out = []
    for o in objects:
        try:
            role, name, size, crc = o["role"], o["name"], o["size"], int(o["crc32"], 16)
        except (TypeError, KeyError, ValueError):
            raise CorruptRecordError(f"a malformed object entry {o!r}", source=source) from None
        if (not isinstance(role, str) or not isinstance(name, str) or "/" in name
                or name in ("", ".", "..") or not isinstance(size, int) or size < 0):
            raise CorruptRecordError(f"a malformed object entry {o!r}", source=source)
        out.append(CommitObject(role, name, size, crc))
    return Commit(step, save, tuple(out))


def read_commit(store: Store, name: str) -> Commit:
    """The commit object `name` in `store`, decoded and checked. `FileMissingError` when
    there is none."""
    return decode(store.fetch(name, MAX_BYTES), store.url_of(name))


def expectations(store: Store, commit: Commit) -> dict[str, Written]:
    """The URL of each of the commit's objects and what a read of it must find."""
    return {store.url_of(o.name): Written(o.size, o.crc32) for o in commit.objects}


def checkpoint_url(store: Store, commit: Commit, source: str) -> str:
    """The URL of the commit's checkpoint object."""
    found = commit.named("checkpoint")
    if found is None:
        raise FileMissingError("the commit names no checkpoint object", source=source)
    return store.url_of(found.name)
