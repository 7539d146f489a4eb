"""Telling Burn's files apart by their first bytes: Burnpack, NamedMpk, NamedMpk.gz, Bin.
"""

from __future__ import annotations

import re
import zlib

from .burn_names import MAGIC

# -- sniffing -------------------------------------------------------------------------------------


def sniff_burnpack(head: bytes) -> bool:
    return head[:4] == MAGIC


def sniff_namedmpk(head: bytes) -> bool:
    """rmp_serde's `write_named` of a BurnRecord: a map whose first key is `metadata`,
    itself a map whose first key is `float`."""
    return (len(head) > 17 and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))
            and head[1:10] == b"\xa8metadata" and head[11:17] == b"\xa5float")


def sniff_bin(head: bytes) -> bool:
    """bincode of a BurnRecord: the metadata's float and int type names (short strings
    such as `f32`, `half::binary16::f16`), then a format naming one of Burn's Bin recorders."""
    at = 0
    for _ in range(2):
        n = head[at] if at < len(head) else 0
        name = head[at + 1 : at + 1 + n]
        if not 1 <= n <= 40 or len(name) < n or not re.fullmatch(rb"[a-z0-9_:]+", name):
            return False
        at += 1 + n
    if at >= len(head) or head[at] >= 251:
        return False
    want = b"burn_core::record::file::Bin"
    got = head[at + 1 : at + 1 + len(want)]
    return len(got) >= 12 and want.startswith(got)


def gz_is_burn(head: bytes) -> bool:
    """Whether decompressed bytes `head` start a Burn NamedMpk document."""
    return sniff_namedmpk(head)


def sniff_namedmpk_gz(head: bytes) -> bool:
    """A gzip stream whose first decompressed bytes (what 64 compressed bytes give, often
    none) start a Burn NamedMpk document; `trainrec.namedmpk.gz`'s reader tells the rest
    apart once it has decompressed enough."""
    if head[:2] != b"\x1f\x8b":
        return False
    try:
        out = zlib.decompressobj(wbits=31).decompress(head, 64)
    except zlib.error:
        return False
    return gz_is_burn(out)
