"""The registry of record file formats: how `read_file`, the CLI and the recorders tell
files apart, read them with core alone, and find a recorder to write them.

A `Format` is found by its name (the format string its files' header declares, e.g.
`"trainrec.torch"`), by the first bytes of a file (`sniff`) and by a file name's
extension. Resolution order of `known_formats()`:

1. formats given to `register_format(...)`, most recent first;
2. formats declared in the entry-point group `trainrec.formats` (entry-point name = the
   format's name, value = `"module:attr"` naming a `Format`), by name; an entry point
   that fails to load, or names something else, is skipped with a warning;
3. core's own formats: NamedMpk (`.mpk`), gzip NamedMpk (`.mpk.gz`), flax msgpack
   (`.msgpack`) and Burn's files (Burnpack `.bpk`, NamedMpk, gzip NamedMpk, Bin), which
   `trainrec.recorders.builtin_formats` gives (`set_builtin_formats`) as the package is
   imported: this module imports none of the modules that read them.

The bundled adapters' formats (torch `.pt`, read by core's `trainrec.recorders.ptfile`;
DDP and DCP directories; Orbax checkpoint directories) come through step 2 like any
adapter's: trainrec's own pyproject declares them, and core names no adapter module.
The entry points are read once and cached (`_clear_entry_point_cache` forgets them).

The first format of a name wins. A file is read by the first format, in that order, whose
`sniff` accepts its first bytes; the extension only decides between several that do, and
names the format whose reader explains a file no sniff accepts. A file whose content is
one format and whose name another's is refused, naming both. Registration is explicit:
importing a module registers nothing.

A format whose checkpoints are directories names a `marker`, the path of a file inside
one: a directory is read by the first such format whose `sniff` accepts the first bytes
of its marker file, and a file is never sniffed by one (nor a directory by a file format).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import (
    HINT_BYTES,
    CorruptRecordError,
    RecorderError,
)
from ..storage.files import kind_of, open_regular

if TYPE_CHECKING:
    from ..format.header import Header
    from ..items.tree import Item
    from ..training.protocols import PrecisionSettings, Recorder

__all__ = [
    "ENTRY_POINT_GROUP",
    "SNIFF_BYTES",
    "Format",
    "register_format",
    "known_formats",
    "format_named",
    "format_for_name",
    "sniff_format",
    "resolve_format",
    "resolve_directory_format",
    "recorder_for",
    "set_builtin_formats",
]

ENTRY_POINT_GROUP = "trainrec.formats"
SNIFF_BYTES = HINT_BYTES
"""How many leading bytes of a file `Format.sniff` is given (fewer for a shorter file)."""

Reader = Callable[[Path, bool], "tuple[Header, Item]"]


@dataclass(frozen=True)
class Format:
    """A file format trainrec reads (and writes).

    - `name`: the format string its files' header declares (`"trainrec.torch"`);
    - `extensions`: file name endings, most usual first (`(".pt",)`);
    - `sniff(head) -> bool`: whether a file starting with `head` (its first
      `SNIFF_BYTES` bytes) is of this format; cheap, never raises;
    - `reader(path, mmap) -> (Header, Item)`: reads a file with no framework installed,
      raising a `RecorderError` subclass for anything it cannot read;
    - `recorder`: `"module:attr"` of the recorder class that writes it (constructed with
      precision settings; imported only when asked for, and may need a framework);
    - `description`: what a file of this format is and what reads it, a phrase for
      error messages (`"a .pt zip file: TorchFileRecorder reads it"`);
    - `verified`: what a successful read has checked (printed by `trainrec verify`);
    - `marker`: for a format whose checkpoints are directories, the path inside one of
      the file whose first bytes `sniff` is given (`"trainrec/metadata"`); `""` (the
      default) for a format of files;
    - `entries`: for a format whose reader checks entries that are not tensors of its item
      (a DCP directory's shard entries), `entries(item) -> (what, count, bytes)` says how
      many it checked (`trainrec verify` prints them); None (the default) otherwise.
    - `partial`: for a format whose `reader` gives a view of a checkpoint rather than the
      whole record, what it gives (`"rank 0's part"`); `trainrec convert` refuses such a
      source, saying so. `""` (the default): the reader gives the whole record.
    """

    name: str
    extensions: tuple[str, ...]
    sniff: Callable[[bytes], bool]
    reader: Reader
    recorder: str
    description: str = ""
    verified: str = "nothing: this format carries no checksums (parsed only)"
    marker: str = ""
    entries: Callable[[Item], tuple[str, int, int]] | None = None
    partial: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError("Format.name must be a non-empty str")
        if isinstance(self.extensions, str) or not all(
                isinstance(e, str) and e.startswith(".") for e in self.extensions):
            raise TypeError("Format.extensions must be a tuple of endings such as '.pt'")
        if not callable(self.sniff) or not callable(self.reader):
            raise TypeError("Format.sniff and Format.reader must be callables")
        module, sep, attr = self.recorder.partition(":") if isinstance(self.recorder, str) else ("", "", "")
        if not (module and sep and attr):
            raise TypeError(f"Format.recorder must be 'module:attr', got {self.recorder!r}")
        if not isinstance(self.marker, str) or self.marker.startswith("/") or ".." in self.marker.split("/"):
            raise TypeError(f"Format.marker must be a relative path inside a checkpoint "
                            f"directory (or ''), got {self.marker!r}")

    def new_recorder(self, settings: PrecisionSettings | None = None) -> Recorder:
        """A recorder that writes this format. Raises `RecorderError` naming the module
        when it cannot be imported (a framework that is not installed)."""
        module, _, attr = self.recorder.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise RecorderError(f"writing {self.name} files needs {module} ({e})") from e
        except AttributeError as e:
            raise RecorderError(f"{self.recorder} does not exist ({e})") from e
        recorder: Recorder = cls(settings)
        return recorder


_registered: list[Format] = []
_from_entry_points: list[Format] | None = None


def register_format(fmt: Format) -> None:
    """Make `fmt` known to `read_file`, the CLI and `recorder_for`, ahead of every format
    registered before it, declared by entry points or built in (a format of the same
    name among them is then hidden)."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format takes a trainrec.recorders.formats.Format, got {type(fmt).__name__}")
    _registered.insert(0, fmt)


def _entry_point_formats() -> list[Format]:
    global _from_entry_points
    if _from_entry_points is None:
        found: list[Format] = []
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            try:
                fmt = ep.load()
            except Exception as e:  # a third party's module: any error while importing it
                warnings.warn(f"trainrec: the format entry point {ep.name} = {ep.value!r} "
                              f"failed to load ({type(e).__name__}: {e}); skipped", stacklevel=3)
                continue
            if not isinstance(fmt, Format) or fmt.name != ep.name:
                warnings.warn(f"trainrec: the format entry point {ep.name} = {ep.value!r} "
                              f"does not name a Format called {ep.name!r}; skipped", stacklevel=3)
                continue
            found.append(fmt)
        _from_entry_points = found
    return _from_entry_points


def known_formats() -> tuple[Format, ...]:
    """Every known format, in resolution order (see the module docstring), one per name."""
    out: list[Format] = []
    names: set[str] = set()
    for fmt in (*_registered, *_entry_point_formats(), *BUILTIN_FORMATS):
        if fmt.name not in names:
            names.add(fmt.name)
            out.append(fmt)
    return tuple(out)


def format_named(name: str) -> Format | None:
    """The format whose files declare `name`, or None."""
    return next((f for f in known_formats() if f.name == name), None)


def format_for_name(path: str | Path) -> Format | None:
    """The format a file name's extension names (the longest ending that matches, case
    ignored), or None."""
    lower = Path(path).name.lower()
    best: tuple[int, Format] | None = None
    for fmt in known_formats():
        for ext in fmt.extensions:
            if lower.endswith(ext.lower()) and (best is None or len(ext) > best[0]):
                best = (len(ext), fmt)
    return None if best is None else best[1]


def sniff_format(head: bytes) -> Format | None:
    """The first format (in resolution order) whose `sniff` accepts `head`, or None."""
    return next(iter(_sniffed(head)), None)


def _sniffed(head: bytes) -> list[Format]:
    head = bytes(head[:SNIFF_BYTES])
    out = []
    for fmt in known_formats():
        if fmt.marker:
            continue  # a directory format: sniffed by `resolve_directory_format`
        try:
            ok = fmt.sniff(head)
        except Exception as e:  # a third party's sniff: it must not raise
            raise RecorderError(f"the sniff of format {fmt.name} failed: {type(e).__name__}: {e}") from e
        if ok:
            out.append(fmt)
    return out


def _known() -> str:
    return ", ".join(f"{f.name} ({', '.join(f.extensions) or 'any name'})" for f in known_formats())


def resolve_format(path: str | Path, head: bytes) -> Format:
    """The format to read the file `path`, which starts with `head`: the one its content
    says (its name decides between several); when no format claims the content, the one
    its name says (whose reader then says what is wrong with it).

    Raises `CorruptRecordError` when the content is one format and the name another's,
    or when neither names a known format (the message lists them)."""
    named = format_for_name(path)
    found = _sniffed(head)
    if named is not None and named in found:
        return named
    lower = Path(path).name.lower()
    for fmt in found:  # another format with the same extension (Burn's `.mpk`, trainrec's)
        if any(lower.endswith(ext.lower()) for ext in fmt.extensions):
            return fmt
    if found:
        if named is None:
            return found[0]
        is_ = found[0]
        raise CorruptRecordError(
            f"the name says {named.name} ({', '.join(named.extensions)}), the content says "
            f"otherwise: this is {is_.description or is_.name}; rename it to end in "
            f"{is_.extensions[0] if is_.extensions else 'its own extension'}, or read it "
            f"with that recorder", source=str(path))
    if named is not None:
        return named
    what = "an empty file" if not head else "its first bytes match none of the formats trainrec knows"
    raise CorruptRecordError(f"not a record file: {what} ({_known()})", source=str(path))


def resolve_directory_format(path: str | Path) -> Format:
    """The format to read the directory `path`: the first (in resolution order) with a
    `marker` whose `sniff` accepts the first bytes of that file inside it.

    Raises `FileMissingError` when no format of directories claims it."""
    from ..errors import FileMissingError

    p = Path(path)
    unreadable: OSError | None = None
    for fmt in known_formats():
        if not fmt.marker:
            continue
        marker = p / fmt.marker
        try:
            with open_regular(marker, str(p), follow=False, key=fmt.marker) as f:
                head = f.read(SNIFF_BYTES)
        except RecorderError as e:  # a FIFO (opening it would wait for a writer), a link
            raise RecorderError(f"{fmt.marker} is {_what(marker)}: not a checkpoint of "
                                f"{fmt.name} (nothing read)", source=str(p)) from e
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        except OSError as e:  # a marker there that we may not read: said if none claims it
            unreadable = unreadable or e
            continue
        try:
            ok = fmt.sniff(head)
        except Exception as e:  # a third party's sniff: it must not raise
            raise RecorderError(f"the sniff of format {fmt.name} failed: {type(e).__name__}: {e}") from e
        if ok:
            return fmt
    if unreadable is not None:
        raise RecorderError(f"cannot read {unreadable.filename or 'a marker file'} to tell the "
                            f"directory's format: {type(unreadable).__name__}: "
                            f"{unreadable.strerror or unreadable}", source=str(path)) from unreadable
    known = ", ".join(f"{f.name} ({f.marker})" for f in known_formats() if f.marker)
    raise FileMissingError(f"a directory, not a record file (no format of directories claims "
                           f"it: {known or 'none known'})", source=str(path))


def _what(path: Path) -> str:
    """What `path` is when it is not a regular file ("a FIFO", "a symbolic link")."""
    try:
        return kind_of(os.lstat(path).st_mode)
    except OSError:
        return "unreadable"


def recorder_for(path: str | Path, settings: PrecisionSettings | None = None) -> Recorder:
    """A recorder that writes the format `path`'s extension names (NamedMpk when it names
    none), with `settings` (None: Full)."""
    fmt = format_for_name(path) or format_named("trainrec.namedmpk")
    if fmt is None:
        raise RecorderError("no format of core's own is known: import trainrec.recorders")
    return fmt.new_recorder(settings)


# -- core's own formats -----------------------------------------------------------------------

BUILTIN_FORMATS: tuple[Format, ...] = ()
"""The formats trainrec ships (whose readers `read_file` trusts to return items): given by
`trainrec.recorders.builtin_formats` as the package `trainrec.recorders` is imported."""


def set_builtin_formats(formats: tuple[Format, ...]) -> None:
    """Core's own formats, last in the resolution order (`trainrec.recorders.builtin_formats`
    gives them; the registry imports none of the modules that read them)."""
    global BUILTIN_FORMATS
    BUILTIN_FORMATS = tuple(formats)


def _clear_entry_point_cache() -> None:
    """Forget the formats entry points declared (for tests that change them)."""
    global _from_entry_points
    _from_entry_points = None


def reader_of(head: bytes, not_: str) -> str:
    """Which recorder (or `trainrec.read_file`) reads a file starting with `head`, as a
    sentence to append to a wrong-magic error; "" when it is of format `not_` or of none."""
    fmt = sniff_format(head)
    if fmt is None or fmt.name == not_:
        return ""
    return f"; this is {fmt.description or fmt.name}, and trainrec.read_file reads any of them"


def directory_reader(path: str) -> str:
    """Which recorder reads the checkpoint directory `path`, as a sentence to append to an
    error; "" when no format of directories claims it."""
    try:
        fmt = resolve_directory_format(path)
    except RecorderError:
        return ""
    return f"; this is {fmt.description or fmt.name}, and trainrec.read_file reads any of them"

