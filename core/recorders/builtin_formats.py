"""Core's own record file formats, as `trainrec.recorders.formats` resolves them (last, after
the registered ones and the entry points'): NamedMpk (`.mpk`), gzip NamedMpk (`.mpk.gz`),
flax msgpack (`.msgpack`) and Burn's files (Burnpack `.bpk`, NamedMpk, gzip NamedMpk, Bin).

Each reader imports its recorder module when first used. The package `trainrec.recorders`
imports this module, which gives the formats to the registry (`set_builtin_formats`): the
registry itself imports none of the modules that read them, which ask it for the hint that
names a file's real format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import reading
from .formats import Format, set_builtin_formats

if TYPE_CHECKING:
    from ..format.header import Header
    from ..items.tree import Item

__all__ = ["BUILTIN"]


def _is_map(head: bytes) -> bool:
    return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def _sniff_namedmpk(head: bytes) -> bool:
    return _is_map(head) and b"trainrec.namedmpk" in head


def _sniff_gz(head: bytes) -> bool:
    return head[:2] == b"\x1f\x8b"


def _sniff_flax(head: bytes) -> bool:
    """Ours, or any msgpack map that is not NamedMpk (a plain flax state dict); not a
    map whose first bytes look like a damaged NamedMpk header."""
    if not _is_map(head):
        return False
    if b"trainrec.flax" in head:
        return True
    from .burn import sniff_namedmpk

    return b"trainrec" not in head and b"namedmpk" not in head and not sniff_namedmpk(head)


def _read_namedmpk(path: Path, mmap: bool) -> tuple[Header, Item]:
    from ..precision import NativePrecisionSettings
    from .namedmpk import NamedMpkFileRecorder

    return NamedMpkFileRecorder(NativePrecisionSettings()).read(path, mmap=mmap)


def _read_gz(path: Path, mmap: bool) -> tuple[Header, Item]:
    from ..precision import NativePrecisionSettings
    from . import burn

    with reading(str(path)):
        if burn.gz_is_burn(burn.gz_head(path)):  # Burn's NamedMpkGzFileRecorder, by content
            return burn.read_namedmpk_gz(path, mmap)
    from .namedmpk import NamedMpkGzFileRecorder

    return NamedMpkGzFileRecorder(NativePrecisionSettings()).read(path)


def _read_flax(path: Path, mmap: bool) -> tuple[Header, Item]:
    from ..precision import NativePrecisionSettings
    from .flaxmsgpack import FlaxMsgpackFileRecorder

    return FlaxMsgpackFileRecorder(NativePrecisionSettings()).read(path, mmap=mmap)


_BUILTIN: tuple[Format, ...] = (
    Format("trainrec.namedmpk", (".mpk",), _sniff_namedmpk, _read_namedmpk,
           "trainrec.recorders.namedmpk:NamedMpkFileRecorder",
           "a NamedMpk file: NamedMpkFileRecorder (DefaultRecorder, CompactRecorder) reads it",
           "header, structure and every tensor checksum"),
    Format("trainrec.namedmpk.gz", (".mpk.gz",), _sniff_gz, _read_gz,
           "trainrec.recorders.namedmpk:NamedMpkGzFileRecorder",
           "a gzip NamedMpk file: NamedMpkGzFileRecorder reads it",
           "header, structure and every tensor checksum"),
    Format("trainrec.flax", (".msgpack",), _sniff_flax, _read_flax,
           "trainrec.recorders.flaxmsgpack:FlaxMsgpackFileRecorder",
           "a msgpack map without a NamedMpk header, as flax writes: "
           "trainrec.FlaxMsgpackFileRecorder reads it",
           "the file checksum over every byte (header, structure, tensors)"),
)


def _burn(name: str) -> Callable[..., tuple[Header, Item]]:
    """The Burn reader `name` of `trainrec.recorders.burn`, imported when first used; a
    `template` (`read_file(path, template=...)`, Bin files only) is passed on."""
    def read(path: Path, mmap: bool, template: Any = None) -> tuple[Header, Item]:
        from . import burn

        reader = getattr(burn, name)
        result: tuple[Header, Item] = reader(path, mmap) if template is None else reader(path, mmap, template)
        return result
    return read


def _burn_sniff(name: str) -> Callable[[bytes], bool]:
    def sniff(head: bytes) -> bool:
        from . import burn

        return bool(getattr(burn, name)(head))
    return sniff


_BURN_UNCHECKED = ("Burn keeps no checksum: a flipped bit inside a tensor's bytes, or a changed "
                   "value of the same size, cannot be told")
_BUILTIN = _BUILTIN + (  # after trainrec's own: `.mpk` names trainrec's NamedMpk first
    Format("burn.burnpack", (".bpk",), _burn_sniff("sniff_burnpack"), _burn("read_burnpack"),
           "trainrec.recorders.burn:BurnpackRecorder",
           "a Burnpack file (Burn >= 0.22): trainrec.recorders.burn.BurnpackRecorder reads it",
           "the header, the CBOR metadata, and every tensor's dtype, shape and byte range "
           f"against the file (in it, no overlaps); not the tensors' values: {_BURN_UNCHECKED}"),
    Format("burn.namedmpk", (".mpk",), _burn_sniff("sniff_namedmpk"), _burn("read_namedmpk"),
           "trainrec.recorders.burn:BurnNamedMpkRecorder",
           "a Burn NamedMpk file (NamedMpkFileRecorder, Burn <= 0.21): "
           "trainrec.burn.BurnNamedMpkRecorder reads it",
           "the msgpack structure, Burn's metadata, and every tensor's dtype, shape and byte "
           f"count; not the tensors' values: {_BURN_UNCHECKED}"),
    Format("burn.namedmpk.gz", (".mpk.gz",), _burn_sniff("sniff_namedmpk_gz"), _burn("read_namedmpk_gz"),
           "trainrec.recorders.burn:BurnNamedMpkRecorder",
           "a gzip Burn NamedMpk file (NamedMpkGzFileRecorder, Burn <= 0.21): read_file reads it",
           "the gzip stream's CRC-32 (gzip's own), the msgpack structure, Burn's metadata, and every "
           "tensor's dtype, shape and byte count (gzip's CRC covers the bytes as compressed, not "
           "what Burn serialized)"),
    # no extension: `.bin` names many formats; a Bin file is told by its first bytes alone
    Format("burn.bin", (), _burn_sniff("sniff_bin"), _burn("read_bin"),
           "trainrec.recorders.burn:BurnpackRecorder",
           "a Burn Bin file (BinFileRecorder, Burn <= 0.21): read_file(path, template=...) reads "
           "it with its tensors' module paths",
           "Burn's metadata and every parameter's ParamId, dtype, shape and byte count, in the "
           "order the template gives, and that nothing follows them (without a template: in file "
           "order, and not how many there are: a file cut after a parameter reads); not the "
           f"tensors' values: {_BURN_UNCHECKED}"),
)

BUILTIN = _BUILTIN
set_builtin_formats(BUILTIN)
