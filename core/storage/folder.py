"""Folder checkpoints at store URLs: a checkpoint that is a folder of files
(`DistributedRecorder`'s, `DCPRecorder`'s, `OrbaxRecorder`'s) saved to the URL `X`
(spec/PROTOCOLS.md, "Checkpoints on object stores").

A save stages the folder's files on local disk (each rank its own, in a private temporary
folder), uploads each file as a data object `X/{save}.r{rank:05d}.{index:04d}.{file name}`
(`save`: 24 random hex digits of this save, so no other save's upload can replace it),
then writes one commit object `X/.trainrec-commit`, last and only if absent: a
`trainrec.commit` document (`commit.py`) naming every object with its size and CRC-32,
its `role` the file's path inside the folder. `X` holds a checkpoint exactly when that
object is there; a save to an `X` that has one is refused and writes nothing.

A load reads the commit object, downloads every object it names (or those a reader
wants) into a private temporary folder, each checked against its size and CRC-32 as it
streams in, and the folder's own reader reads there; its errors name the URLs.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from ..errors import CorruptRecordError, FileMissingError, RecorderError
from .commit import Commit, CommitObject, encode, read_commit
from .location import READ_BYTES, Written, download, expecting, upload, uploads
from .store import Store

__all__ = ["FOLDER_COMMIT", "Store", "CommitObject", "new_save_id", "object_name", "upload_files", "upload_bytes",
           "commit_folder", "committed_by", "refuse_committed", "discard", "read_folder_commit",
           "staged", "read_staged_folder", "save_folder", "renamed"]

FOLDER_COMMIT = ".trainrec-commit"
"""The commit object of a folder checkpoint, inside its URL."""

T = TypeVar("T")

_SAVE = re.compile(r"[0-9a-f]{24}")


def new_save_id() -> str:
    """A fresh save id: 24 random hex digits."""
    return secrets.token_hex(12)


def object_name(save: str, rank: int, index: int, relative: str) -> str:
    """The data object of the `index`-th file of `rank` in save `save`."""
    return f"{save}.r{rank:05d}.{index:04d}.{relative.rsplit('/', 1)[-1]}"


def _open_store(url: str) -> Store:
    return Store(url)


def refuse_committed(store: Store) -> None:
    """`RecorderError` when `store` holds a committed folder checkpoint (a save never
    replaces one), `FileMissingError` when its bucket is not there."""
    if not store.exists_folder():
        raise FileMissingError("cannot save: no such bucket", source=store.url)
    try:
        read_commit(store, FOLDER_COMMIT)
    except FileMissingError:
        return
    except RecorderError:
        pass  # a damaged commit object is still one: never written over
    raise RecorderError(f"a checkpoint is committed here already ({FOLDER_COMMIT}) and is never "
                        "replaced: save under a new URL (a new step)", source=store.url)


def upload_files(store: Store, local: Path, save: str, rank: int,
                 into: list[CommitObject]) -> list[CommitObject]:
    """Upload every regular file below `local` as a data object of save `save`, appending
    each one's entry (role: its path in the folder) to `into` as it completes (so a caller
    can discard what got uploaded when a later one fails); `into`."""
    files: list[Path] = []
    for root, dirs, names in os.walk(local):
        dirs.sort()
        files.extend(Path(root) / n for n in sorted(names))
    start = len(into)
    for i, path in enumerate(files):
        if path.is_symlink() or not path.is_file():
            raise RecorderError("a staged checkpoint holds something other than a regular "
                                "file: not uploaded", source=str(path))
        rel = path.relative_to(local).as_posix()
        name = object_name(save, rank, start + i, rel)
        url = store.url_of(name)
        with uploads() as log, open(path, "rb") as f, upload(url) as out:
            while chunk := f.read(READ_BYTES):
                out.write(chunk)
        into.append(CommitObject(rel, name, log[url].size, log[url].crc32))
    return into


def upload_bytes(store: Store, name: str, role: str, data: bytes) -> CommitObject:
    """Upload `data` as the data object `name`; its entry."""
    url = store.url_of(name)
    with uploads() as log, upload(url) as out:
        out.write(data)
    return CommitObject(role, name, log[url].size, log[url].crc32)


def commit_folder(store: Store, save: str, objects: Iterable[CommitObject]) -> bool:
    """Write the commit object naming `objects`, only if there is none: False when there
    is one (another save's). Where the store has no verified conditional writes, the
    check and the write are two requests (two saves racing to one URL could both write)."""
    data = encode(Commit(None, save, tuple(objects)))
    if store.conditional:
        return store.put_new(FOLDER_COMMIT, data) is not None
    if FOLDER_COMMIT in store.list():
        return False
    store.put(FOLDER_COMMIT, data)
    return True


def committed_by(store: Store, save: str) -> bool:
    """Whether the commit object at `store` is save `save`'s (after a failure whose
    outcome is unknown: a commit that failed in flight may have landed)."""
    try:
        return read_commit(store, FOLDER_COMMIT).save == save
    except RecorderError:
        return False


def discard(store: Store, objects: Iterable[CommitObject]) -> None:
    """Delete these data objects, as far as the store lets us (a failed save's)."""
    for o in objects:
        with contextlib.suppress(RecorderError):
            store.delete(o.name)


def read_folder_commit(url: str) -> tuple[Store, Commit]:
    """The store at `url` and its folder checkpoint's commit, checked. `FileMissingError`
    saying it is not committed when there is no commit object."""
    store = _open_store(url)
    try:
        commit = read_commit(store, FOLDER_COMMIT)
    except FileMissingError:
        raise FileMissingError(
            f"not a committed checkpoint: no commit object {FOLDER_COMMIT} (a save that "
            "never finished, or no checkpoint at all: its data objects are never read)",
            source=store.url) from None
    if commit.step is not None or not _SAVE.fullmatch(commit.save):
        raise CorruptRecordError("the commit is not a folder checkpoint's", source=store.url_of(FOLDER_COMMIT))
    return store, commit


def _relative(role: str, source: str) -> str:
    parts = role.split("/")
    if (role.startswith("/") or "\\" in role or "\x00" in role
            or any(p in ("", ".", "..") for p in parts)):
        raise CorruptRecordError(f"the commit names a file {role!r} outside its folder",
                                 source=source)
    return role


@contextlib.contextmanager
def staged(url: str, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[Path, dict[str, str]]]:
    """The folder checkpoint at `url` downloaded into a private temporary folder (deleted
    after the block): its path, and the URL of each file in it (by its local path). Only
    the files `wanted` accepts (by their path in the folder) when given. Every object is
    checked against its commit entry as it streams in: `CorruptRecordError` naming the
    object for a damaged, truncated or longer one, `FileMissingError` for a missing one."""
    store, commit = read_folder_commit(url)
    source = store.url_of(FOLDER_COMMIT)
    seen: set[str] = set()
    for o in commit.objects:
        rel = _relative(o.role, source)
        if rel in seen:
            raise CorruptRecordError(f"the commit names the file {rel!r} twice", source=source)
        seen.add(rel)
    with tempfile.TemporaryDirectory(prefix="trainrec-folder-") as tmp:
        root = Path(tmp) / "checkpoint"
        root.mkdir()
        urls = {str(root): store.url}
        for o in commit.objects:
            if wanted is not None and not wanted(o.role):
                continue
            dest = root / o.role
            dest.parent.mkdir(parents=True, exist_ok=True)
            where = store.url_of(o.name)
            urls[str(dest)] = where
            with expecting({where: Written(o.size, o.crc32)}), open(dest, "wb") as out:
                download(where, out)
        yield root, urls


def renamed(error: RecorderError, urls: dict[str, str]) -> RecorderError:
    """`error` of a reader of a staged folder with its local paths (the keys of `urls`,
    from `staged`) said as their URLs; `error` itself when it names none."""
    def say(text: str) -> str:
        for local in sorted(urls, key=len, reverse=True):
            text = text.replace(local, urls[local])
        return text

    root = min(urls, key=len)
    if root not in str(error):
        return error
    text = str(error.args[0]) if error.args else str(error)
    where = f" (file {error.source}" if error.source else ""
    cut = text.rfind(where) if where else -1
    reason = text[:cut] if cut > 0 else text
    try:
        out = type(error)(say(reason), source=say(error.source), key=error.key)
    except TypeError:  # a subclass of another signature: the message said as it is
        return error
    out.__cause__ = error
    return out


def read_staged_folder(url: str, read: Callable[[Path], T],
                       wanted: Callable[[str], bool] | None = None) -> T:
    """`read` of the folder checkpoint at `url`, downloaded (`staged`); its errors name
    the URLs."""
    with staged(url, wanted) as (root, urls):
        try:
            return read(root)
        except RecorderError as e:
            raise renamed(e, urls) from e.__cause__


def save_folder(url: str, write: Callable[[Path], object]) -> None:
    """One process's save of a folder checkpoint at `url`: `write(local)` writes the folder
    at `local` (a path that does not exist yet, in a private temporary folder), then its
    files are uploaded and committed. Refused (`RecorderError`) when `url` is committed
    already; a save that fails leaves no commit, and deletes the objects it uploaded."""
    store = _open_store(url)
    refuse_committed(store)
    save = new_save_id()
    objects: list[CommitObject] = []
    with tempfile.TemporaryDirectory(prefix="trainrec-stage-") as tmp:
        local = Path(tmp) / "checkpoint"
        try:
            write(local)
        except RecorderError as e:
            raise renamed(e, {str(local): store.url}) from e
        try:
            upload_files(store, local, save, 0, objects)
            if not commit_folder(store, save, objects):
                raise RecorderError("a checkpoint was committed here by another save while this "
                                    "one uploaded: never replaced, this save's objects deleted",
                                    source=store.url)
        except BaseException:
            if not committed_by(store, save):
                discard(store, objects)
            raise
