"""`read_file`: the header and item of a record file of any registered format, told by its
first bytes (the format registry, `formats`), local or at a store URL (`remote`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CorruptRecordError, RecorderError, reading
from ..format.envelope import path_arg
from ..format.header import Header
from ..items.tree import Item, check_item
from ..storage.files import open_regular
from ..storage.location import is_url
from .sniff import HEAD_BYTES

__all__ = ["read_file"]


def read_file(path: str | os.PathLike[str], *, mmap: bool = False, template: Any = None) -> tuple[Header, Item]:
    """Header and item of any record file of a registered format (`trainrec.recorders.formats`),
    with only core installed: NamedMpk (plain or gzip), `.pt` (`TorchFileRecorder`'s, read
    without torch), flax msgpack, and any format a third party registers; and an Orbax
    checkpoint directory of `OrbaxRecorder`'s (which needs orbax-checkpoint).

    The format is the one the file's first bytes say; its extension only decides between
    formats that both accept them. `mmap=True` maps the file where the format can. Burn's
    own files read too (`trainrec.recorders.burn`: Burnpack, NamedMpk, NamedMpk.gz, Bin); `template`
    is for a Burn Bin file, which holds no names: a Burn record of the same module (or a
    path to one, or a record whose parameters a neutral form names) gives the structure,
    so its tensors are keyed by module path (without one: in file order, 0, 1, ...).

    Raises:
        FileMissingError: no such file, or a directory no format of directories claims.
        CorruptRecordError: damaged, of no known format (the message lists the known
            ones), or of one format but named as another's.
        UnsupportedVersionError: written by a format version this trainrec cannot read.
    """
    from .formats import BUILTIN_FORMATS, resolve_directory_format, resolve_format

    if is_url(path):
        from .remote import read_url

        return read_url(str(path), mmap)
    p = path_arg(path)
    fmt = resolve_directory_format(p) if p.is_dir() else resolve_format(p, _head(p))
    if template is not None:
        if fmt.name != "burn.bin":
            raise TypeError(f"template is for Burn Bin files; {p} is {fmt.description or fmt.name}")
        # core's own Bin reader (`builtin_formats`), which takes the template, whatever
        # format of that name resolved the file
        burn_bin: Any = next(f.reader for f in BUILTIN_FORMATS if f.name == "burn.bin")
        return burn_bin(p, mmap, template=template)  # type: ignore[no-any-return]
    try:
        got = fmt.reader(p, mmap)
    except (RecorderError, OSError):
        raise
    except Exception as e:  # a registered (third party's) reader must raise RecorderErrors
        raise CorruptRecordError(f"the reader of format {fmt.name} failed: {type(e).__name__}: {e}",
                                 source=str(p)) from e
    if fmt in BUILTIN_FORMATS:
        return got
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], Header)):
        raise CorruptRecordError(f"the reader of format {fmt.name} returned {type(got).__name__}, "
                                 "not (Header, Item)", source=str(p))
    return got[0], check_item(got[1], source=str(p))


def _head(path: Path) -> bytes:
    """The first bytes of a checkpoint file (for the formats' sniffs)."""
    with reading(str(path)):
        with open_regular(path) as f:
            return f.read(HEAD_BYTES)
