"""`trainrec verify`: a record file's (or a checkpoint directory's committed steps') checks,
and what they could not check.
"""

from __future__ import annotations

import json

from ..errors import CorruptRecordError, RecorderError
from ..storage.location import is_url
from .shared import _message, _regular_file
from .terminal import printable as _printable


def _verify(path: str, as_json: bool) -> int:
    from ..items.tree import iter_tensors
    from ..recorders.read import read_file

    if is_url(path) and (steps := _committed_steps(path)):
        return max(_verify(f"{path.rstrip('/')}/{name}", as_json) for _, name in steps)

    count = total = 0
    try:
        _regular_file(path)
        header, item = read_file(path, mmap=True)
        for _, t in iter_tensors(item):
            t.array  # noqa: B018 - reading checks the checksum
            count += 1
            total += t.nbytes
    except RecorderError as e:
        corrupt = isinstance(e, CorruptRecordError)  # else unreadable: missing, a directory, I/O
        if as_json:
            print(json.dumps({"file": path, "ok": False, "error": str(e)}))
        else:
            print(f"{'CORRUPT' if corrupt else 'UNREADABLE'}: {_message(e)}")
        return 1 if corrupt else 3
    from ..recorders.formats import format_named

    fmt = format_named(header.format)
    checked = fmt.verified if fmt else "nothing: this format carries no checksums (parsed only)"
    # a directory format's own entries (DCP's shard entries), checked beside its tensors
    entries = fmt.entries(item) if fmt is not None and fmt.entries is not None else None
    if as_json:
        extra = {} if entries is None else {"entries": entries[1], "entry_bytes": entries[2]}
        print(json.dumps({"file": path, "ok": True, "tensors": count, "bytes": total, **extra,
                          "verified": checked}))
    else:
        what = "" if entries is None else f"{entries[1]} {entries[0]} ({entries[2]} bytes) and "
        print(_printable(f"OK: {path}: {what}{count} tensors ({total} bytes); verified: {checked}"))
    return 0


def _committed_steps(url: str) -> list[tuple[int, str]]:
    """The committed steps of a manager's folder at `url` (none for an object's URL):
    `verify` checks each."""
    from ..recorders.remote import committed
    from ..storage.location import object_size

    try:
        object_size(url)
        return []
    except RecorderError:
        pass
    try:
        return committed(url)
    except RecorderError:
        return []
