"""`Store`: one folder of a store, with the small-object operations the commit protocol
(`commit.py`) needs, conditional where the store has conditional writes (`conditional`).

The conditional writes: S3's `If-None-Match: *` and `If-Match: <etag>` on PUT and DELETE (AWS
since 2024, and moto), and `memory://`'s (one process: `location.MEMORY_LOCK`). Other stores have none verified here; gs:// is
refused too: gcsfs (2026.8) has create-if-absent (`mode="create"`, `ifGenerationMatch=0`,
experimental) but no overwrite or delete on a generation, which the lease's renewal and
release need.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import CorruptRecordError, RecorderError
from .location import (
    MEMORY_LOCK,
    _errors,
    _range_not_satisfiable,
    filesystem,
    memory_put,
    scheme_of,
)

__all__ = ["Store"]

_CONDITIONAL = {"s3", "s3a", "memory"}
_GCS_WHY = ("; gcsfs creates an object only if absent (mode='create', ifGenerationMatch=0, "
            "experimental in gcsfs and untested by its own suite) but has no overwrite or "
            "delete conditional on an object's generation, which the writer's lease needs")


class Store:
    """One folder of a store (`url`), holding the objects named `name` below it.

    Small objects (commit objects, locks, metrics) are written whole (`put`, `put_new`,
    `replace`); `conditional` says whether `put_new` and `replace` are atomic
    compare-and-set operations on this store (S3, `memory://`) or refused. Raises
    `RecorderError` for the store's errors, naming the object."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.scheme = scheme_of(url)
        self.fs, root = filesystem(self.url)
        self.root = root.rstrip("/")
        self.conditional = self.scheme in _CONDITIONAL

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list(self) -> dict[str, dict[str, Any]]:
        """Every object directly in the folder, by name, with fsspec's info ("size", and
        "LastModified" or "created"); `{}` for a folder that does not exist."""
        with _errors(self.url):
            try:
                found = self.fs.ls(self.root, detail=True, refresh=True)
            except FileNotFoundError:
                return {}
        out: dict[str, dict[str, Any]] = {}
        for info in found:
            if info.get("type") == "directory":
                continue
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = info
        return out

    def exists_folder(self) -> bool:
        """Whether the folder's bucket (or the folder) is there to write in."""
        with _errors(self.url):
            if self.scheme in ("s3", "s3a"):
                bucket = self.root.split("/", 1)[0]
                return bool(self.fs.exists(bucket))
            return True

    def read(self, name: str, max_bytes: int) -> tuple[bytes, str]:
        """The object and its tag (an ETag), `FileMissingError` when it is not there."""
        url = self.url_of(name)
        with _errors(url):
            if self.scheme == "memory":
                with MEMORY_LOCK:
                    data = bytes(self.fs.cat_file(self._path(name)))
                return data, _memory_tag(data)
            info = self.fs.info(self._path(name), refresh=True)
            if int(info["size"]) > max_bytes:
                raise CorruptRecordError(f"{info['size']} bytes, more than the {max_bytes} "
                                         "a load accepts", source=url)
            data = bytes(self.fs.cat_file(self._path(name)))
            return data, str(info.get("ETag", ""))

    def fetch(self, name: str, max_bytes: int) -> bytes:
        """The object `name` (one GET), `CorruptRecordError` when larger than `max_bytes`,
        `FileMissingError` when it is not there."""
        url = self.url_of(name)
        with _errors(url):
            try:
                data = bytes(self.fs.cat_file(self._path(name), start=0, end=max_bytes + 1))
            except OSError as e:
                if not _range_not_satisfiable(e):
                    raise
                data = b""  # a range from byte 0 not satisfiable: the object is empty
        if len(data) > max_bytes:
            raise CorruptRecordError(f"more than the {max_bytes} bytes a load accepts", source=url)
        return data

    def put(self, name: str, data: bytes) -> None:
        url = self.url_of(name)
        with _errors(url, writing=True):
            if self.scheme == "memory":
                memory_put(self.fs, self._path(name), data, exclusive=False)
            else:
                self.fs.pipe_file(self._path(name), data)

    def put_new(self, name: str, data: bytes) -> str | None:
        """Create the object `name`, atomically only if it is not there: its tag, or None
        when it exists. `RecorderError` on a store without conditional writes."""
        self._need_conditional("create an object only if it is absent")
        url = self.url_of(name)
        with _errors(url, writing=True):
            if self.scheme == "memory":
                try:
                    memory_put(self.fs, self._path(name), data, exclusive=True)
                except FileExistsError:
                    return None
                return _memory_tag(data)
            try:
                out = self.fs.pipe_file(self._path(name), data, mode="create")
            except FileExistsError:
                return None
            return _etag(out)

    def replace(self, name: str, data: bytes, tag: str) -> str | None:
        """Overwrite the object `name` only if it still has tag `tag`: the new tag, or
        None when it changed or is gone."""
        self._need_conditional("replace an object only if it is unchanged")
        url = self.url_of(name)
        with _errors(url, writing=True):
            if self.scheme == "memory":
                with MEMORY_LOCK:
                    path = self._path(name)
                    if not self.fs.exists(path) or _memory_tag(self.fs.cat_file(path)) != tag:
                        return None
                    self.fs.pipe_file(path, bytes(data))
                return _memory_tag(data)
            bucket, key = self._bucket_key(name)
            try:
                out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                      IfMatch=tag)
            except (FileNotFoundError, OSError) as e:
                if isinstance(e, FileNotFoundError) or _precondition(e):
                    return None
                raise
            finally:
                self.fs.invalidate_cache(self._path(name))
            return _etag(out)

    def delete(self, name: str, tag: str | None = None) -> bool:
        """Delete the object `name` (with `tag`: only if it still has it). False when it
        was not there or had another tag."""
        url = self.url_of(name)
        with _errors(url, writing=True):
            if self.scheme == "memory":
                with MEMORY_LOCK:
                    path = self._path(name)
                    if not self.fs.exists(path):
                        return False
                    if tag is not None and _memory_tag(self.fs.cat_file(path)) != tag:
                        return False
                    self.fs.rm_file(path)
                    return True
            if tag is not None and self.conditional:
                bucket, key = self._bucket_key(name)
                try:
                    self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=tag)
                except (FileNotFoundError, OSError) as e:
                    if isinstance(e, FileNotFoundError) or _precondition(e):
                        return False
                    raise
                finally:
                    self.fs.invalidate_cache(self._path(name))
                return True
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                return False
            return True

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self._path(name))
        return str(bucket), str(key)

    def _need_conditional(self, what: str) -> None:
        if not self.conditional:
            why = _GCS_WHY if self.scheme in ("gs", "gcs") else ""
            raise RecorderError(
                f"a {self.scheme}:// store has no conditional writes trainrec has verified "
                f"(needed to {what}){why}: writing checkpoints there could let two writers "
                "interleave or replace a commit; supported: s3://, memory://; "
                "CheckpointManager(..., read_only=True) reads here", source=self.url)



def _memory_tag(data: Any) -> str:
    return hashlib.md5(bytes(data), usedforsecurity=False).hexdigest()


def _etag(response: Any) -> str:
    if isinstance(response, dict) and response.get("ETag"):
        return str(response["ETag"])
    raise RecorderError("the store answered a write without an ETag")


def _precondition(e: BaseException) -> bool:
    """Whether an error of s3fs is S3's 412 Precondition Failed."""
    text = f"{e} {e.__cause__!r}"
    return "PreconditionFailed" in text or "Precondition" in text or "412" in text
