"""The NamedMpk document's name, version and header fields (spec/FORMAT.md, section 3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..precision import (
    Precision,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "Header"]

FORMAT_NAME = "trainrec.namedmpk"
FORMAT_VERSION = (1, 1)


@dataclass(frozen=True)
class Header:
    """What a NamedMpk file says about itself, checked before the item is read."""

    format: str
    version: tuple[int, int]
    trainrec_version: str
    settings: Precision
    record_type: str
