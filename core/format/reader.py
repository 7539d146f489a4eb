"""Reading a NamedMpk document: its header checked first (magic, version, header CRC), then
its structure and tensors through the parser."""

from __future__ import annotations

from typing import Any

from ..errors import (
    HINT_BYTES,
    ChecksumError,
    CorruptRecordError,
    UnsupportedVersionError,
    format_hint,
)
from ..items.checksum import crc32, crc_text
from ..items.tree import Item
from ..precision import (
    settings_by_name,
)
from . import header as _header
from .header import FORMAT_NAME, Header
from .limits import Limits
from .parser import _Parser

__all__ = ["read_document", "check_magic"]

def read_document(
    buf: Any, source: str, *, lazy: bool = False, limits: Limits | None = None,
    owned: bool = False,
) -> tuple[Header, Item]:
    """Parse a NamedMpk document held in `buf` (bytes, bytearray, numpy buffer or mmap).

    Checks the magic, version and header checksum before reading the item, then the
    structure checksum; with `lazy=False` also every tensor checksum. Tensors view `buf`.
    `owned=True`: `buf` is writable memory the caller allocated for this read alone and
    will not touch again, so `TensorData.take` may hand its tensors out without copying.
    Raises `CorruptRecordError` (or `ChecksumError`) and `UnsupportedVersionError`.
    """
    p = _Parser(buf, source, limits or Limits(), eager=not lazy, owned=owned)
    header = _read_header(p)
    k = p.value("", 1)
    if k != "item":
        raise p.fail(f"expected key 'item' after the header, found {k!r}", "")
    item_start = p.pos
    item: Item = p.value("item", 1)  # type: ignore[assignment]
    item_end = p.pos
    if p.value("", 1) != "item_crc":
        raise p.fail("expected key 'item_crc' after the item", "")
    stored = p.value("item_crc", 1)
    if p.pos != p.end:
        raise p.fail(f"{p.end - p.pos} bytes of trailing data after the document", "")
    computed = p.structure_crc(item_start, item_end)
    if stored != computed:
        raise ChecksumError(
            f"structure checksum mismatch (stored {crc_text(stored)}, computed {computed:#010x})",
            source=source,
            key="item",
        )
    p.verify_tensors()
    return header, item  # eager: the parser has read (and verified) every tensor


def _read_header(p: _Parser) -> Header:
    if not p.end:
        raise p.fail("empty payload", "")
    p.need(1, "")
    first = p.mv[0]
    if not (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)):
        raise p.fail(_wrong_magic(p), "")
    p.stop = min(p.end, p.limits.max_header_bytes)
    b = p.mv[p.take(1, "")]
    n = b & 0x0F if b <= 0x8F else p.uint(2 if b == 0xDE else 4, "")
    fields: dict[str, object] = {}
    for _ in range(n):
        key_start = p.pos
        k = p.value("", 1)
        if not isinstance(k, str):
            raise p.fail("header keys must be strings", "")
        if not fields and (k != "format"):
            raise p.fail(_wrong_magic(p), "")
        if k == "header_crc":
            stored = p.value(k, 1)
            computed = crc32(p.mv[:key_start])
            if stored != computed:
                raise ChecksumError(
                    f"header checksum mismatch (stored {crc_text(stored)}, computed {computed:#010x})",
                    source=p.source,
                    key="header_crc",
                )
            if n != len(fields) + 3:
                raise p.fail("the top-level map must end with header_crc, item, item_crc", "")
            p.stop = p.end
            return _header_from(fields, p)
        fields[k] = p.value(k, 1)
        if k == "format" and fields[k] != FORMAT_NAME:
            raise p.fail(_wrong_magic(p), "format")
        if k == "version":
            _check_version(fields[k], p)
    raise p.fail("header has no header_crc", "")


def _wrong_magic(p: _Parser) -> str:
    head = bytes(p.mv[: min(p.avail, HINT_BYTES)])
    return "not a trainrec NamedMpk document (wrong magic)" + format_hint(head, not_=FORMAT_NAME)
def check_magic(prefix: Any, source: str) -> None:
    """Raise `CorruptRecordError` unless `prefix` (the first bytes of a payload, at least
    64 of them when the payload has that many) starts a NamedMpk document: lets a reader
    refuse another file before it reads or allocates the rest."""
    p = _Parser(prefix, source, Limits())
    try:
        b = p.mv[p.take(1, "")] if p.end else -1
        if not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF)):
            raise p.fail("not a trainrec NamedMpk document (wrong magic)", "")
        if b > 0x8F:
            p.uint(2 if b == 0xDE else 4, "")
        ok = p.value("", 1) == "format" and p.value("", 1) == FORMAT_NAME
    except CorruptRecordError:
        ok = False
    if not ok:
        head = bytes(memoryview(prefix)[:HINT_BYTES])
        raise CorruptRecordError("not a trainrec NamedMpk document (wrong magic)"
                                 + format_hint(head, not_=FORMAT_NAME), source=source)


def _check_version(v: object, p: _Parser) -> None:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
        raise p.fail(f"malformed version {v!r}", "version")
    if v[0] != _header.FORMAT_VERSION[0]:
        raise UnsupportedVersionError(
            f"format version {v[0]}.{v[1]} is not supported by this trainrec, which reads "
            f"version {_header.FORMAT_VERSION[0]}.x (writes {_header.FORMAT_VERSION[0]}.{_header.FORMAT_VERSION[1]})",
            source=p.source,
            key="version",
        )


def _header_from(fields: dict[str, object], p: _Parser) -> Header:
    version = fields.get("version")
    settings = fields.get("settings")
    record = fields.get("record")
    trainrec_version = fields.get("trainrec")
    if not isinstance(version, list):
        raise p.fail("header has no version", "version")
    if not isinstance(record, str) or not isinstance(trainrec_version, str):
        raise p.fail("header lacks record or trainrec version", "record")
    if not isinstance(settings, dict):
        raise p.fail("header has no settings", "settings")
    try:
        name = settings["name"]
        if not isinstance(name, str):
            raise ValueError(name)
        precision = settings_by_name(name, settings.get("float"), settings.get("int"))
    except (KeyError, ValueError, TypeError) as e:
        raise p.fail(f"malformed precision settings ({e})", "settings") from None
    return Header(FORMAT_NAME, (version[0], version[1]), trainrec_version, precision, record)
