"""Which format a file is, told from its first bytes by the format registry
(`trainrec.recorders.formats`), so a recorder given another recorder's file can say which one reads
it (and `read_file` can pick it)."""

from __future__ import annotations

from ..errors import format_hint
from .formats import SNIFF_BYTES, sniff_format

__all__ = ["HEAD_BYTES", "format_of", "reader_of"]

HEAD_BYTES = SNIFF_BYTES
"""How many leading bytes `format_of` looks at."""


def format_of(head: bytes) -> str | None:
    """The name of the first registered format whose sniff accepts `head` (e.g.
    "trainrec.namedmpk", "trainrec.torch"), or None: unknown, or a NamedMpk header whose
    format name is damaged."""
    fmt = sniff_format(head)
    return None if fmt is None else fmt.name


def reader_of(head: bytes, *, not_: str) -> str:
    """A sentence to append to a wrong-magic error: which recorder (or
    `trainrec.read_file`) reads a file starting with `head`; "" when it is of format
    `not_` or of no format trainrec knows."""
    return format_hint(head, not_=not_)
