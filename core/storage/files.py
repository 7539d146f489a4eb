"""Opening the files a load reads: regular files only, and JSON within bounds.

`open_regular` opens without waiting (`O_NONBLOCK`) and checks what it opened: a FIFO, a
device or a socket is refused before a byte is read (a FIFO would block the reader until
some writer came, a device would never end), so no reader waits on a file. Where a name
must not be followed (`follow=False`), a symbolic link is refused too (`O_NOFOLLOW`).

`read_json` reads a JSON document of at most `max_bytes` bytes (checked before the read, on
the open file), whose values fit the object budget (counted before the parse, see
`JSON_TOKEN_COST`), and whose nesting is at most `max_depth`: a sparse 8 GiB file, a file
of empty lists or a document a thousand levels deep is a `CorruptRecordError`, quickly,
never a `MemoryError` or `RecursionError`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptRecordError, FileMissingError, RecorderError

__all__ = ["open_regular", "regular_fd", "kind_of", "read_json", "json_fits", "JSON_TOKEN_COST"]

if sys.platform != "win32":
    import fcntl

JSON_TOKEN_COST = 64
"""What one JSON value is charged against the object budget: more than CPython spends on
any value a token can start (a container, a float, a short string, and its slot). Values
are counted before the parse, by the bytes that can precede one (`[`, `{`, `,` and `:`,
anywhere in the text: a string holding them only counts more)."""
JSON_BUDGET_BYTES = 16 << 20
JSON_BUDGET_PER_BYTE = 16
"""The object budget of a JSON document of `n` bytes: this many bytes plus this many per
byte of the document, so memory stays proportional to its size."""


def kind_of(mode: int) -> str:
    """What a file of `st_mode` `mode` is, as a phrase ("a FIFO")."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file" if not stat.S_ISREG(mode) else "a regular file"


def regular_fd(path: str | os.PathLike[str], source: str = "", *, follow: bool = True,
               key: str = "") -> int:
    """A file descriptor of `path` open for reading, which is a regular file. Raises
    `RecorderError` ("not a regular file: a FIFO") for anything else, and for a symbolic
    link when `follow=False`; `FileNotFoundError` / `IsADirectoryError` / other `OSError`s
    as `open` raises them (a caller reading inside `errors.reading` turns those into
    `FileMissingError` / `RecorderError`)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    where = source or str(path)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow and os.path.islink(path):
            raise RecorderError("a symbolic link, never followed here: not read",
                                source=where, key=key) from e
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise RecorderError(f"not a regular file ({kind_of(mode)}): not read", source=where,
                                key=key)
        if sys.platform != "win32":
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str], source: str = "", *, follow: bool = True,
                 key: str = "") -> io.BufferedReader:
    """`open(path, "rb")` for a regular file only (see `regular_fd`)."""
    return io.BufferedReader(io.FileIO(regular_fd(path, source, follow=follow, key=key), "rb"))


def json_fits(text: bytes | str, max_bytes: int) -> str:
    """Why a JSON text would be refused by `read_json(max_bytes=...)` ("" when it would
    not): what a writer checks, so that what saves loads."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    if len(data) > max_bytes:
        return f"{len(data)} bytes of JSON, more than the {max_bytes} a load accepts"
    tokens = sum(data.count(c) for c in (b"[", b"{", b",", b":"))
    budget = JSON_BUDGET_BYTES + JSON_BUDGET_PER_BYTE * len(data)
    if tokens * JSON_TOKEN_COST > budget:
        return (f"{tokens} JSON values in {len(data)} bytes, more than its object budget "
                f"({budget} bytes at {JSON_TOKEN_COST} a value) allows")
    return ""


def read_json(path: str | os.PathLike[str], *, max_bytes: int, max_depth: int | None = 64,
              source: str = "", key: str = "", follow: bool = True) -> Any:
    """The JSON document in the regular file `path`, refused with `CorruptRecordError`
    when it is larger than `max_bytes`, holds more values than its object budget allows,
    is nested deeper than `max_depth` (None: as deep as the parser's recursion limit
    lets it, about 1000), or is not JSON (UTF-8). Raises `FileMissingError`
    for a missing file, `RecorderError` for one that is not a regular file (a FIFO), a
    link with `follow=False`, or cannot be read."""
    where = source or str(path)
    with _reading(where, key):
        with open_regular(path, where, follow=follow, key=key) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise CorruptRecordError(f"{size} bytes of JSON, more than the {max_bytes} "
                                         "a load accepts", source=where, key=key)
            data = f.read(max_bytes + 1)
    return parse_json(data, max_bytes=max_bytes, max_depth=max_depth, source=where, key=key)


def parse_json(data: bytes, *, max_bytes: int, max_depth: int | None = 64, source: str = "",
               key: str = "") -> Any:
    """`read_json` for bytes already read."""
    problem = json_fits(data, max_bytes)
    if problem:
        raise CorruptRecordError(problem, source=source, key=key)
    try:
        doc = json.loads(data)
    except RecursionError:
        raise CorruptRecordError("JSON nested too deeply", source=source, key=key) from None
    except ValueError as e:  # UnicodeDecodeError included
        raise CorruptRecordError(f"does not parse as JSON: {e}", source=source, key=key) from None
    if max_depth is not None and _depth(doc, max_depth) > max_depth:
        raise CorruptRecordError(f"JSON nested more than {max_depth} levels deep", source=source,
                                 key=key)
    return doc


def _depth(doc: Any, limit: int) -> int:
    """How deep `doc` nests (a scalar: 0), or `limit + 1` once it is deeper than `limit`."""
    deepest, level = 0, [(doc, 0)]
    while level:
        node, d = level.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        d += 1
        if d > limit:
            return d
        deepest = max(deepest, d)
        level.extend((v, d) for v in node if isinstance(v, (dict, list)))
    return deepest


@contextlib.contextmanager
def _reading(source: str, key: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as e:
        raise FileMissingError("no such file", source=source, key=key) from e
    except OSError as e:
        raise RecorderError(f"cannot read: {e}", source=source, key=key) from e
