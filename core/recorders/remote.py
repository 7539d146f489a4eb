"""Reading record files at store URLs (`read_file`, `trainrec inspect/verify`): one object
of any registered format, a commit object's checkpoint (`commit.py`), or a manager's
folder (its committed steps).

A NamedMpk object streams into one buffer (`storage.read_into`); an object of another
format is copied, as it streams in, into a private temporary file and read there by its
format's reader (those readers work on local files), every error then naming the URL. A
folder checkpoint (`storage.folder`: `DistributedRecorder`'s, `DCPRecorder`'s,
`OrbaxRecorder`'s, committed by `X/.trainrec-commit`) is downloaded into a private
temporary folder, each object checked against its commit, and read there by the reader of
its directory format.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import CorruptRecordError, FileMissingError, RecorderError, reading
from ..format.header import Header
from ..items.tree import Item, iter_tensors
from ..storage.commit import COMMIT_SUFFIX, checkpoint_url, expectations, read_commit
from ..storage.folder import FOLDER_COMMIT, read_folder_commit, read_staged_folder
from ..storage.location import download, expecting, filesystem, object_size
from ..storage.store import Store
from .sniff import HEAD_BYTES

__all__ = ["read_url", "read_staged", "committed", "split_url"]

T = TypeVar("T")

_STEP_COMMIT = re.compile(r"step-(\d{8,})" + re.escape(COMMIT_SUFFIX))


def split_url(url: str) -> tuple[str, str]:
    """The folder and the name of an object's URL."""
    folder, _, name = url.rstrip("/").rpartition("/")
    return folder, name


def committed(folder: str) -> list[tuple[int, str]]:
    """The committed steps in a manager's folder, ascending: (step, commit object name)."""
    store = Store(folder)
    steps = []
    for name in store.list():
        m = _STEP_COMMIT.fullmatch(name)
        if m is not None:
            steps.append((int(m.group(1)), name))
    return sorted(steps)


def read_url(url: str, mmap: bool = False, *, only: str | None = None) -> tuple[Header, Item]:
    """Header and item of the record at `url`: an object, a commit object (`.commit`: its
    checkpoint, checked against the commit's sizes and CRCs) or a manager's folder (its
    latest committed step) or a folder checkpoint (its `.trainrec-commit`, or the folder).
    `only`: refuse any format but the one of this name (a recorder's own). Raises as
    `read_file` does; a folder with objects but no commit, `FileMissingError` saying it is
    not committed."""
    folder, name = split_url(url)
    if name == FOLDER_COMMIT:
        return _read_folder(folder, only)
    if name.endswith(COMMIT_SUFFIX):
        store = Store(folder)
        commit = read_commit(store, name)
        with expecting(expectations(store, commit)):
            return _read_object(checkpoint_url(store, commit, url), mmap, only)
    try:
        return _read_object(url, mmap, only)
    except FileMissingError:
        store = Store(url)
        names = store.list()
        if FOLDER_COMMIT in names:
            return _read_folder(url, only)
        steps = committed(url)
        if not steps:
            if names:  # objects, no commit: a folder checkpoint's save that never finished
                read_folder_commit(url)
            raise
    return read_url(f"{url.rstrip('/')}/{steps[-1][1]}", mmap, only=only)


def _read_folder(url: str, only: str | None) -> tuple[Header, Item]:
    """The folder checkpoint at `url`, read by its directory format's reader from a
    checked local copy; every tensor read (checked) before the copy is deleted."""
    from .formats import resolve_directory_format

    def read(root: Path) -> tuple[Header, Item]:
        fmt = resolve_directory_format(root)
        if only is not None and fmt.name != only:
            raise CorruptRecordError(f"a {fmt.name} checkpoint, not a {only} one", source=str(root))
        header, item = fmt.reader(root, False)
        for _, t in iter_tensors(item):
            t.array  # noqa: B018 - read (and checked) while the copy is there
        return header, item

    return read_staged_folder(url, read)


def _read_object(url: str, mmap: bool, only: str | None) -> tuple[Header, Item]:
    from .formats import resolve_format

    fmt = resolve_format(url, _head(url))
    if only is not None and fmt.name != only:
        raise CorruptRecordError(f"a {fmt.name} object, not a {only} one", source=url)
    if fmt.name == "trainrec.namedmpk":
        from ..precision import NativePrecisionSettings
        from .namedmpk import NamedMpkFileRecorder

        return NamedMpkFileRecorder(NativePrecisionSettings()).read(url, mmap=mmap)
    return read_staged(url, lambda local: fmt.reader(local, False))


def read_staged(url: str, read: Callable[[Path], T]) -> T:
    """`read` of a private local copy of the object `url` (streamed into a temporary file
    in chunks, checked against `expecting`, deleted after): for readers of local files.
    An error naming the copy names `url` instead."""
    suffix = "".join(Path(split_url(url)[1]).suffixes)
    with tempfile.TemporaryDirectory(prefix="trainrec-") as tmp:
        local = Path(tmp) / f"object{suffix}"
        with open(local, "wb") as out:
            download(url, out)
        try:
            return read(local)
        except RecorderError as e:
            if e.source == str(local):
                raise type(e)(_reason(e), source=url, key=e.key) from e
            raise


def _head(url: str) -> bytes:
    """The object's first bytes (only: one ranged read)."""
    fs, path = filesystem(url)
    with reading(url):
        size = object_size(url)
        return bytes(fs.cat_file(path, start=0, end=min(size, HEAD_BYTES))) if size else b""


def _reason(e: RecorderError) -> str:
    """The message of `e` without the "(file ...)" its constructor appended."""
    text = str(e.args[0]) if e.args else str(e)
    where = f" (file {e.source}" if e.source else ""
    cut = text.rfind(where) if where else -1
    return text[:cut] if cut > 0 else text

