"""Where a checkpoint lives: a local path, or a URL of any fsspec filesystem.

A local path (a `str` without a scheme, a `PathLike`, or a `file://` URL) is used as
before: `_atomic.atomic_write` to save, `_files.open_regular` to read. Any other
`scheme://...` string is an object in a store that fsspec opens (`s3://` through s3fs,
`gs://` through gcsfs, `memory://` in process, any scheme fsspec knows). fsspec is imported
only when a URL is used; it is an optional extra (`pip install 'trainrec[s3]'`).

A save to a URL uploads as it serializes (`upload`): parts of `PART_BYTES` go out as they
fill (S3's multipart upload), and the object becomes visible only when the upload is
completed, after the last byte; a save that fails or is killed leaves no object (S3, GCS;
an interrupted multipart upload stays invisible until the bucket's lifecycle rule or
`abort` removes it). `memory://` holds the object in a buffer and stores it at the end.
A load streams the object into the recorder's buffer in chunks of `READ_BYTES`
(`read_into`). Each upload and read computes the CRC-32 of the bytes as they pass:
`uploads()` collects what each upload wrote (size and CRC), `expecting()` makes a read
refuse an object whose size or CRC is not the expected one (the commit protocol,
`commit.py`, uses both).

`Store` (`store.py`) is one folder of a store, with the small-object operations of the commit
protocol.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptRecordError, FileMissingError, RecorderError
from ..items.checksum import crc32
from .files import open_regular

__all__ = ["is_url", "location", "upload", "read_into", "read_bytes", "object_size",
           "uploads", "expecting", "open_input", "download", "output", "Written", "PART_BYTES", "READ_BYTES"]

PART_BYTES = 16 << 20
"""The size of one uploaded part: what a save to a URL holds in memory at most (beyond the
state it serializes)."""
READ_BYTES = 32 << 20
"""The size of one ranged read of a load from a URL."""
_AHEAD = 8
"""Ranged reads in flight at once on s3:// (each streamed into place: no memory held);
elsewhere `_CAT_AHEAD`."""
_CAT_AHEAD = 2
"""Ranged reads in flight at once on a store other than s3:// (each held whole until
copied into place: `_CAT_AHEAD * READ_BYTES` extra memory at most)."""

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
def is_url(target: object) -> bool:
    """Whether `target` is a store URL (`scheme://...`, other than `file://`)."""
    if not isinstance(target, str):
        return False
    m = _URL.match(target)
    return m is not None and m.group(1).lower() != "file"


def location(args: Any) -> Path | str:
    """A file recorder's args: a store URL as it is, anything else as a local `Path` (a
    `file://` URL as its path). `TypeError` for what is neither."""
    if isinstance(args, str):
        if is_url(args):
            return args
        if args.lower().startswith("file://"):
            return Path(args[len("file://"):])
    if not isinstance(args, (str, os.PathLike)):
        raise TypeError(f"file recorders take a path or a URL, got {type(args).__name__}")
    return Path(args)


def scheme_of(url: str) -> str:
    m = _URL.match(url)
    return m.group(1).lower() if m else ""


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem serving `url` and the path within it. `RecorderError` when
    fsspec, or the package of the scheme, is not installed (saying which extra to
    install), or the scheme is unknown."""
    scheme = scheme_of(url)
    extra = _EXTRAS.get(scheme, "s3")
    try:
        import fsspec
    except ImportError as e:
        raise RecorderError(f"a {scheme}:// URL needs fsspec: pip install 'trainrec[{extra}]'",
                            source=url) from e
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise RecorderError(f"a {scheme}:// URL needs its fsspec filesystem ({e}): pip install "
                            f"'trainrec[{extra}]'", source=url) from e
    except ValueError as e:
        raise RecorderError(f"fsspec knows no filesystem for {scheme}:// ({e})",
                            source=url) from e
    return fs, str(path)


@dataclass(frozen=True)
class Written:
    """What one upload wrote: `size` bytes whose CRC-32 is `crc32`."""

    size: int
    crc32: int


_local = threading.local()


@contextlib.contextmanager
def uploads() -> Iterator[dict[str, Written]]:
    """Collect, for every upload this thread completes inside the block, its URL and what
    it wrote."""
    outer = getattr(_local, "uploads", None)
    log: dict[str, Written] = {}
    _local.uploads = log
    try:
        yield log
    finally:
        _local.uploads = outer


@contextlib.contextmanager
def expecting(objects: dict[str, Written]) -> Iterator[None]:
    """Within the block, a read of one of these URLs on this thread refuses an object of
    another size or CRC-32 with `CorruptRecordError`."""
    outer = getattr(_local, "expected", None)
    _local.expected = {**(outer or {}), **objects}
    try:
        yield
    finally:
        _local.expected = outer


def _expected(url: str) -> Written | None:
    expected = getattr(_local, "expected", None)
    return None if expected is None else expected.get(url)


class _CrcSink:
    """A write-only file that passes every write to `out`, counting bytes and CRC-32."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32(view, self.crc)
        self.size += view.nbytes
        self._out.write(view)
        return view.nbytes

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.size


@contextlib.contextmanager
def upload(url: str, *, exclusive: bool = False) -> Iterator[Any]:
    """Yield a file to write the object `url`; it becomes visible when the block ends
    without error, complete, and never otherwise (a failed upload is aborted). With
    `exclusive`, an existing object is never replaced (`FileExistsError`, where the store
    has conditional writes). OSErrors are raised as `RecorderError` naming `url`."""
    fs, path = filesystem(url)
    with _errors(url, writing=True):
        out = _Upload(fs, path, exclusive, streams=scheme_of(url) != "memory")
        sink = _CrcSink(out)
        try:
            yield sink
            out.finish()
        except BaseException:
            out.abort()
            raise
    log = getattr(_local, "uploads", None)
    if log is not None:
        log[url] = Written(sink.size, sink.crc)


class _Upload:
    """The bytes of one object on their way: held until they fill a part, then streamed
    as a multipart upload that `finish` completes (the object appears) and `abort`
    abandons; an object smaller than a part is one PUT at `finish`. `memory://` holds
    the whole object and stores it at `finish`."""

    def __init__(self, fs: Any, path: str, exclusive: bool, *, streams: bool) -> None:
        self._fs, self._path, self._exclusive, self._streams = fs, path, exclusive, streams
        self._held: io.BytesIO | None = io.BytesIO()
        self._file: Any = None

    def write(self, data: memoryview) -> None:
        if data.nbytes > PART_BYTES:  # a tensor's bytes: a part at a time, never all held
            for start in range(0, data.nbytes, PART_BYTES):
                self.write(data[start: start + PART_BYTES])
            return
        if self._file is not None:
            self._file.write(data)
            return
        assert self._held is not None
        self._held.write(data)
        if self._streams and self._held.tell() >= PART_BYTES:
            self._file = self._fs.open(self._path, "xb" if self._exclusive else "wb",
                                       block_size=PART_BYTES, autocommit=False)
            held, self._held = self._held, None
            self._file.write(held.getbuffer())
            del held

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()  # uploads the last part; the object is not there yet
            self._file.commit()
            return
        assert self._held is not None
        data = self._held.getbuffer()
        if not self._streams:
            memory_put(self._fs, self._path, data, exclusive=self._exclusive)
        else:
            self._fs.pipe_file(self._path, bytes(data),
                               mode="create" if self._exclusive else "overwrite")

    def abort(self) -> None:
        self._held = None
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.discard()


@contextlib.contextmanager
def open_input(target: Path | str) -> Iterator[Any]:
    """A local file (a regular one, `_files.open_regular`) or the object `url`, open for
    reading; an object read to its end is checked against `expecting`."""
    if not isinstance(target, str):
        with open_regular(target) as f:
            yield f
        return
    fs, path = filesystem(target)
    with _errors(target):
        f = fs.open(path, "rb", block_size=READ_BYTES)
    with f:
        yield _CheckedReader(f, target, _expected(target))


class _CheckedReader:
    """A sequential reader of an object that checks its size and CRC-32 at its end."""

    def __init__(self, f: Any, url: str, expected: Written | None) -> None:
        self._f, self._url, self._expected = f, url, expected
        self._size = self._crc = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        if self._expected is not None:
            if data:
                self._crc = crc32(data, self._crc)
                self._size += len(data)
            elif n != 0:
                _check(self._url, Written(self._size, self._crc), self._expected)
        return data

    def seek(self, offset: int) -> int:
        """Go back to the start (the only seek a sequential checked read allows)."""
        if offset != 0:
            raise ValueError("a checked object read seeks only to its start")
        self._size = self._crc = 0
        return int(self._f.seek(0))


def download(url: str, out: Any) -> None:
    """Copy the object `url` into the open file `out`, in chunks, checked against
    `expecting`."""
    with open_input(url) as f:
        while chunk := f.read(READ_BYTES):
            out.write(chunk)


def output(target: Path | str, *, durable: bool = True, size_hint: int = 0) -> Any:
    """Where a file recorder writes: `upload(url)` for a store URL, else
    `_atomic.atomic_write(path, durable=, size_hint=)`."""
    if isinstance(target, str):
        return upload(target)
    from .atomic import atomic_write

    return atomic_write(target, durable=durable, size_hint=size_hint)


def object_size(url: str) -> int:
    """The size of the object `url` (`FileMissingError` when there is none); the size
    `expecting` says when it says one (the read checks it)."""
    expected = _expected(url)
    if expected is not None:
        return expected.size
    fs, path = filesystem(url)
    with _errors(url):
        info = fs.info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError(21, "a folder, not an object", url)
        return int(info["size"])


def read_into(url: str, buf: np.ndarray[Any, Any]) -> None:
    """Fill `buf` (bytes) with the object `url`, in ranged reads of `READ_BYTES`, `_AHEAD`
    of them in flight; the size and CRC are checked against `expecting` (the CRC of each
    range as it lands, in order, while the next ones come in). `CorruptRecordError` when
    the object ends early (or, expected, goes on).

    On s3:// each ranged GET's body streams straight into its slice of `buf` (chunks of at
    most `_CHUNK`: no range is ever held whole); on any other store each range is one
    `cat_file` copied into place (`_CAT_AHEAD` ranges held at most)."""
    fs, path = filesystem(url)
    view = buf.data.cast("B")
    n = len(view)
    expected = _expected(url)
    ranges = [(start, min(start + READ_BYTES, n)) for start in range(0, n, READ_BYTES)] or [(0, 0)]
    streams = hasattr(fs, "_call_s3") and getattr(fs, "loop", None) is not None
    crc = 0
    with _errors(url):
        landed = (_s3_ranges if streams else _cat_ranges)(fs, path, view, ranges, expected is not None)
        try:
            for (start, end), got in zip(ranges, landed):
                if got < end - start:
                    raise CorruptRecordError(f"the object ended after {start + got} bytes, "
                                             f"not {n}", source=url)
                if got > end - start:
                    raise CorruptRecordError(f"the object holds more than the {n} bytes its "
                                             "commit says: replaced", source=url)
                if expected is not None:
                    crc = crc32(view[start:end], crc)
        finally:
            landed.close()
    if expected is not None:
        _check(url, Written(n, crc), expected)


_CHUNK = 1 << 20
"""The most bytes of a streamed range taken from the connection at once."""


def _cat_ranges(fs: Any, path: str, view: memoryview, ranges: list[tuple[int, int]],
                longer: bool) -> Generator[int, None, None]:
    """Read each range with `cat_file` (`_CAT_AHEAD` in flight), copy it into `view` and yield
    how many bytes it had (one more asked of the last when `longer` is to be caught)."""
    n = len(view)

    def fetch(start: int, end: int) -> bytes:
        ask = end + 1 if end == n and longer else end
        return bytes(fs.cat_file(path, start=start, end=ask)) if ask > start else b""

    with ThreadPoolExecutor(_CAT_AHEAD) as ahead:
        pending = [ahead.submit(fetch, *r) for r in ranges[:_CAT_AHEAD]]
        try:
            for i, (start, end) in enumerate(ranges):
                data = pending.pop(0).result()
                if i + _CAT_AHEAD < len(ranges):
                    pending.append(ahead.submit(fetch, *ranges[i + _CAT_AHEAD]))
                got = len(data)
                view[start:start + min(got, end - start)] = memoryview(data)[:end - start]
                del data
                yield got
        finally:
            for f in pending:
                f.cancel()


def _s3_ranges(fs: Any, path: str, view: memoryview, ranges: list[tuple[int, int]],
               longer: bool) -> Generator[int, None, None]:
    """Ranged GETs of s3fs on its event loop, `_AHEAD` in flight, each body streamed into
    its slice of `view`; yields each range's byte count in order as it completes."""
    import asyncio

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    n = len(view)
    gate: list[asyncio.Semaphore] = []

    async def one(start: int, end: int) -> int:
        if not gate:
            gate.append(asyncio.Semaphore(_AHEAD))
        ask = end + 1 if end == n and longer else end
        if ask <= start:
            return 0
        async with gate[0]:
            pos, tries = start, 0
            while True:
                try:
                    return await _stream_range(fs, bucket, key, extra, view, start, end, ask, pos)
                except _PartialReadError as e:  # the connection broke: the rest of the range again
                    pos, tries = e.pos, tries + 1
                    if tries >= 3:
                        raise OSError(f"reading bytes {start}-{ask - 1}: {e.__cause__}") from e

    futures = [asyncio.run_coroutine_threadsafe(one(*r), fs.loop) for r in ranges]
    try:
        for f in futures:
            yield f.result()
    finally:
        for f in futures:
            f.cancel()
        for f in futures:  # none may still write into `view` once this returns
            with contextlib.suppress(BaseException):
                f.result()


class _PartialReadError(Exception):
    """A ranged read broken off after `pos`."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


def _range_not_satisfiable(e: OSError) -> bool:
    """Whether S3 answered a ranged GET with 416: the object ends before the range starts.
    Told by the response s3fs keeps as the error's cause, never by the message (which names
    the object: a key holding "416" is no answer)."""
    response = getattr(e.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in ("InvalidRange", "416") or status == 416


async def _stream_range(fs: Any, bucket: str, key: str, extra: dict[str, str], view: memoryview,
                        start: int, end: int, ask: int, pos: int) -> int:
    """GET bytes `pos`..`ask - 1` into `view[pos:end]`; the range's byte count (more than
    `end - start` when the object goes on past `end`, which is not copied)."""
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={pos}-{ask - 1}",
                                 **extra)
    except OSError as e:
        if _range_not_satisfiable(e):
            return pos - start  # the object ends before `pos`
        raise
    body = resp["Body"]
    try:
        while True:
            try:
                chunk = await body.read(_CHUNK)
            except Exception as e:
                raise _PartialReadError(pos) from e
            if not chunk:
                return pos - start
            take = min(len(chunk), end - pos) if pos < end else 0
            if take:
                view[pos:pos + take] = chunk[:take] if take < len(chunk) else chunk
            if take < len(chunk):
                return pos - start + len(chunk)  # past `end`: longer than it should be
            pos += take
    finally:
        body.close()


def read_bytes(url: str, max_bytes: int) -> bytes:
    """The whole object `url`, refused (`CorruptRecordError`) when larger than
    `max_bytes` or not what `expecting` says."""
    size = object_size(url)
    if size > max_bytes:
        raise CorruptRecordError(f"{size} bytes, more than the {max_bytes} a load accepts",
                                 source=url)
    buf = np.empty(size, np.uint8)
    read_into(url, buf)
    return buf.tobytes()


def _check(url: str, got: Written, expected: Written) -> None:
    if got.size != expected.size:
        raise CorruptRecordError(f"the object holds {got.size} bytes, its commit says "
                                 f"{expected.size}: truncated or replaced", source=url)
    if got.crc32 != expected.crc32:
        raise CorruptRecordError(f"the object's CRC-32 is {got.crc32:08x}, its commit says "
                                 f"{expected.crc32:08x}: damaged or replaced", source=url)


@contextlib.contextmanager
def _errors(url: str, *, writing: bool = False) -> Iterator[None]:
    try:
        yield
    except RecorderError:
        raise
    except FileNotFoundError as e:
        what = "cannot save: no such bucket or folder" if writing else "no such object"
        raise FileMissingError(f"{what} ({e})", source=url) from e
    except IsADirectoryError as e:
        raise FileMissingError(f"a folder, not an object ({e})", source=url) from e
    except FileExistsError:
        raise
    except (OSError, ValueError) as e:
        raise RecorderError(f"cannot {'write' if writing else 'read'} the object: {e}",
                            source=url) from e


# `memory://` (one process) has no conditional writes of its own: its writes, and `Store`'s
# compare-and-set on it, hold this lock
MEMORY_LOCK = threading.Lock()


def memory_put(fs: Any, path: str, data: Any, *, exclusive: bool) -> None:
    with MEMORY_LOCK:
        if exclusive and fs.exists(path):
            raise FileExistsError(17, "exists", path)
        fs.pipe_file(path, bytes(data))
