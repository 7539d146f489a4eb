"""What every `trainrec` command shares: a refusal's message for the terminal, and the
regular file a command names, opened without following a link.
"""

from __future__ import annotations

import os
import stat

from ..errors import FileMissingError, RecorderError
from ..storage.location import is_url
from .terminal import printable as _printable


def _message(e: BaseException, *, lines: bool = False) -> str:
    """An error message for the terminal, escaped to one line; with `lines` (a message
    that lists its reasons one a line) each line escaped and every line after the first
    indented, so no line of it can pass for one of the CLI's own."""
    if not lines:
        return _printable(str(e))
    return "\n    ".join(_printable(line) for line in str(e).split("\n"))


def _regular_file(path: str, *, checkpoint: bool = True) -> None:
    """Refuse, before opening it, anything but a regular file or a directory (or a link to
    one): a FIFO would block the read forever, a device never end. A directory given as a
    `checkpoint` is left to `read_file` (one of a directory format, such as Orbax's, or
    refused there). Raises `FileMissingError` for a missing path or another directory,
    `RecorderError` for the rest. A store URL is left to `read_file` (its store says)."""
    if is_url(path):
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise FileMissingError("no such file", source=path) from e
    except (OSError, ValueError) as e:
        raise RecorderError(f"cannot read: {e}", source=path) from e
    if stat.S_ISDIR(mode):
        if checkpoint:
            return  # a checkpoint of a directory format (Orbax), or refused by read_file
        raise FileMissingError("a directory, not a file", source=path)
    if not stat.S_ISREG(mode):
        raise RecorderError("not a regular file (a FIFO, device or socket): refused", source=path)
