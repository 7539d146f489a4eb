"""`OrbaxRecorder`: records as Orbax checkpoints (a directory), written and read through
`orbax-checkpoint`, so runs that span hosts save with the engine JAX users already trust.

One Orbax checkpoint (`ocp.Checkpointer(ocp.CompositeCheckpointHandler())`) holds two
items, committed together by Orbax's temporary directory and rename:

- `arrays` (`ocp.args.PyTreeSave`): every non-empty tensor of the item, stored in its
  storage dtype (the precision settings'), named by its index in tensor order
  (`iter_tensors`): `"000000"`, `"000001"`, ... A tensor Orbax is given as a sharded
  `jax.Array` (see `sharding`) is written shard by shard, each process writing the
  shards it holds; a host (numpy) tensor by process 0.
- `trainrec` (`ocp.args.JsonSave`, the file `trainrec/metadata`): `{"format":
  "trainrec.orbax", "version", "trainrec", "settings", "record", "item", "tensors",
  "checksums", "dtypes", "crc"}`. `item` is the item tree with each tensor replaced by
  `{"__tensor__": index}`, each bytes value by `{"__tensor__": {"bytes": base64}}` and
  each non-finite float by `{"__tensor__": {"f64": 16 hex digits}}` (its bits, so a NaN
  payload is kept and the JSON stays standard); `tensors` lists per tensor `[key path,
  stored shape, stored dtype code, array name or null]` (null: a tensor with no elements,
  which Orbax cannot store, rebuilt from its shape); `checksums` and `dtypes` are the
  tables of the other envelope formats (CRC-32 of each stored tensor, the saved dtype of
  each one stored in another); `crc` is the CRC-32 of the canonical JSON of everything
  else (sorted keys, no spaces), so no field can be edited unnoticed.

A tensor captured across processes (a `ShardedTensor`: the shards this process holds of
an array spanning other processes' devices) is given to Orbax as the global `jax.Array`
rebuilt from those shards, so each process writes only its own; its `checksums` entry is
unused and `shards` holds a CRC-32 per distinct shard (`{"tensor index": {"a:b,c:d":
crc}}`), computed by the processes holding them and gathered from all of them. A load
given a layout for it (`sharding`, e.g. `shardings_of(live record)`) reads into each
process only its shards (a `ShardedTensor` again) and checks those, all processes failing
together when one finds a damaged shard; without one it reads the array whole and checks
every shard. A shard read in a layout other than the saved one has no CRC to check.

A load checks, before it reads any array, that the directory is a finalized Orbax
checkpoint, that the JSON item is whole, and that Orbax's array metadata has exactly the
arrays, shapes and dtypes the table lists; then it reads every array to host memory as
numpy (each process the whole array: `TrainingRecord.restore` places it as the live leaf
is placed), checks each checksum and gives back the same item tree every recorder gives.
Every failure is a `RecorderError` naming the checkpoint.

A save over an existing checkpoint writes the new one next to it and exchanges the two
atomically (Linux `renameat2(RENAME_EXCHANGE)`), so a save that fails or is killed at any
point leaves the old checkpoint as it was.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import math
import os
import shutil
import stat
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainrec import ChecksumError, CorruptRecordError, FileMissingError, RecorderError, TensorData
from trainrec.adapter_kit import (
    TENSOR_KEY,
    DType,
    Header,
    Item,
    PrecisionSettings,
    RecorderBase,
    ShardedTensor,
    ShardIndex,
    TensorTables,
    check_item,
    crc32,
    header_fields,
    iter_tensors,
    json_fits,
    kind_of,
    map_leaves,
    open_regular,
    parse_header,
    path_arg,
    read_json,
    reader_of,
    restore_dtypes,
    store_tensor,
    verify_checksums,
)

__all__ = ["OrbaxRecorder", "FORMAT", "VERSION", "read_orbax", "MAX_JSON_BYTES", "shardings_of"]

FORMAT = "trainrec.orbax"
VERSION = (1, 1)  # 1.1: the `shards` table (tensors captured across processes)
ARRAYS_ITEM = "arrays"
JSON_ITEM = "trainrec"
JSON_FILE = "metadata"  # the file `ocp.args.JsonSave` writes inside its item's directory
MARKER = f"{JSON_ITEM}/{JSON_FILE}"
MAX_JSON_BYTES = 16 << 20
"""A JSON item larger than this is refused before it is read, and never written (it holds
the structure and scalars only; the arrays live in Orbax's own files: 16 MiB is the table
of about 150,000 tensors). Its values are held to the object budget of `json_fits`."""
_ORBAX_JSON_BYTES = 1 << 20
_ORBAX_JSON_BYTES_PER_ARRAY = 2048
"""Orbax's own JSON files (`_CHECKPOINT_METADATA`, `arrays/_METADATA`, `arrays/_sharding`)
are read by trainrec first, up to this many bytes plus this many per array of the table
(about 190 are written per array), before Orbax reads them."""

_STAGING = ".trainrec-new"
"""A save over an existing checkpoint `NAME` writes `NAME.trainrec-new` first."""

Sharding = Any  # a jax.sharding.Sharding
ShardingRule = Callable[[str, tuple[int, ...]], Any]


class OrbaxRecorder(RecorderBase):
    """Records in an Orbax checkpoint directory (args: a path; output: the `Path`).

    `sharding` lays each tensor out across devices for Orbax to write: None (every tensor
    a host array, written by process 0), one `jax.sharding.Sharding` for every tensor, or
    `rule(key, shape) -> Sharding | None` per tensor (`key`: its path in the record's
    item, e.g. `"0.params.Dense_0.kernel"` for a `TrainingRecord`'s model; None: a host
    array). A sharded tensor is built from the host copy every process holds
    (`jax.make_array_from_callback`: each process materialises only its own shards) and
    Orbax writes each shard once, from the process that holds it. Dtypes JAX does not
    hold with its current settings (64-bit ones without `jax_enable_x64`) stay host arrays.

    Multi-process: every process calls `save` / `load` with the same record and path
    (as for any Orbax save); `jax.distributed.initialize` must have run. A record's
    `ShardedTensor`s (arrays captured across processes) are written each process its own
    shards, on their own sharding (`sharding` does not apply to them); at load, `sharding`
    gives the layout each is read into, each process reading only its shards
    (`shardings_of(record)` builds that rule from a record of the live state).
    """

    suffix = ".orbax"  # the name ending `CheckpointManager` gives its checkpoints
    is_directory = True  # a checkpoint is a directory (`CheckpointManager` lists and deletes it as one)
    temp_suffixes = (".orbax-checkpoint-tmp", _STAGING)  # what a killed save leaves next to it

    def __init__(
        self, settings: PrecisionSettings | None = None, *,
        sharding: Sharding | ShardingRule | None = None,
    ) -> None:
        super().__init__(settings)
        self._sharding = sharding

    def save_item(
        self, item: Item, args: Any, record_type: str = "Item", *, allow_lossy: bool = False
    ) -> Path:
        import orbax.checkpoint as ocp

        check_item(item)
        path = path_arg(args)
        source = str(path)
        _check_target(path)
        tables = TensorTables()
        table: list[list[Any]] = []
        arrays: dict[str, Any] = {}
        local: dict[str, dict[str, int]] = {}  # a sharded tensor's CRC per shard this process holds
        for index, (key, tensor) in enumerate(iter_tensors(item)):
            name = f"{index:06d}" if tensor.numel else None
            if isinstance(tensor, ShardedTensor):
                parts = self._store_shards(key, tensor, allow_lossy)
                tables.dtypes.append(None if parts.dtype is tensor.dtype else tensor.dtype.value)
                tables.checksums.append(0)  # unused: the shards table holds its CRCs
                local[str(index)] = {_index_text(i): crc32(_bytes_of(t))
                                     for i, t in parts.shards.items()}
                if name is not None:
                    arrays[name] = _global_array(parts, source, key)
                stored: TensorData = parts
            else:
                stored = store_tensor(tensor, self.settings, key=key, allow_lossy=allow_lossy,
                                      recorder=self.native_name())
                tables.add(tensor, stored)
                if name is not None:
                    arrays[name] = self._placed(key, stored, source)
            table.append([key, list(stored.shape), stored.dtype.value, name])
        shards = _merged_shard_crcs(local, item, source)
        doc: dict[str, Any] = {
            **header_fields(FORMAT, VERSION, self.settings, record_type),
            "item": _encode(item),
            "tensors": table,
            "checksums": tables.checksums,
            "dtypes": tables.dtypes,
            "shards": shards,
        }
        doc["crc"] = _doc_crc(doc)
        problem = json_fits(json.dumps(doc), MAX_JSON_BYTES)  # as `JsonSave` writes it
        if problem:
            raise RecorderError(
                f"the record's structure and scalars take {problem}: hold large data in "
                "arrays, not lists", source=source)
        items = {JSON_ITEM: ocp.args.JsonSave(doc)}
        if arrays:
            items[ARRAYS_ITEM] = ocp.args.PyTreeSave(arrays)
        replacing = path.exists()
        where = Path(os.path.abspath(path))  # Orbax takes absolute paths only
        target = where.with_name(where.name + _STAGING) if replacing else where
        primary = _process_index() == 0
        try:
            if primary and target.exists():  # left by a save that was killed
                shutil.rmtree(target)
            _sync("trainrec_orbax_prepare")
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
                ckptr.save(target, args=ocp.args.Composite(**items))
            failed: RecorderError | None = None
            if replacing and primary:
                try:
                    _exchange(target, where)
                    shutil.rmtree(target)  # the previous checkpoint
                except RecorderError as e:
                    failed = e  # raised after the barrier: the other processes must not wait on us
            _sync("trainrec_orbax_commit")
            if failed is not None:
                raise failed
            if _committed_crc(path) != doc["crc"]:  # another process's part of the save failed
                raise RecorderError("process 0 did not put this checkpoint in place (see its "
                                    "error); the path holds the previous one", source=source)
        except RecorderError:
            raise
        except Exception as e:  # Orbax's, tensorstore's and the file system's errors
            if not path.parent.is_dir():
                raise FileMissingError(
                    f"cannot save: the folder {str(path.parent)!r} does not exist (create it "
                    "first)", source=source) from e
            raise RecorderError(f"Orbax could not save the checkpoint: {_said(e)}",
                                source=source) from e
        return path

    def _store_shards(self, key: str, t: ShardedTensor, allow_lossy: bool) -> ShardedTensor:
        """`t` with each shard in the dtype the settings store it in."""
        parts = {i: store_tensor(part, self.settings, key=key, allow_lossy=allow_lossy,
                                 recorder=self.native_name()) for i, part in t.shards.items()}
        dtype = self.settings.target(t.dtype)
        return ShardedTensor(dtype, t.shape, parts, t.layout)

    def _placed(self, key: str, t: TensorData, source: str) -> Any:
        """The array Orbax is given for tensor `t`: a host array, or a global `jax.Array`
        laid out by this recorder's sharding."""
        host = t.array
        if self._sharding is None:
            return host
        import jax

        if jax.dtypes.canonicalize_dtype(host.dtype) != host.dtype:
            return host  # a 64-bit dtype without jax_enable_x64: JAX would narrow it
        rule = self._sharding
        sharding = rule if isinstance(rule, jax.sharding.Sharding) else rule(key, t.shape)
        if sharding is None:
            return host
        if not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(f"the sharding rule gave {type(sharding).__name__} for {key!r}, "
                            "not a jax.sharding.Sharding or None")
        try:
            return jax.make_array_from_callback(t.shape, sharding, lambda index: host[index])
        except (ValueError, TypeError) as e:
            raise RecorderError(f"cannot lay out a tensor of shape {t.shape} with {sharding}: {e}",
                                source=source, key=key) from e

    def read(self, args: Any, *, mmap: bool = False) -> tuple[Header, Item]:
        """Header and item of an Orbax checkpoint this recorder wrote; every tensor is read
        into host memory (`mmap` is accepted and ignored: Orbax reads through
        tensorstore), except a tensor saved from shards (a `ShardedTensor`) to which this
        recorder's `sharding` gives a sharding: each process reads only the shards its
        devices hold in that layout, and gets a `ShardedTensor` back."""
        return read_orbax(path_arg(args), mmap, sharding=self._sharding)


def shardings_of(record: Any) -> ShardingRule:
    """The layout of every tensor `record` (a record, or an item) holds as shards: a rule
    for `OrbaxRecorder(sharding=...)`, so that a load reads into each process only the
    shards the live arrays put there. Capture the live (initialised) state and pass its
    record: `OrbaxRecorder(sharding=shardings_of(TrainingRecord.capture(...)))`."""
    from trainrec import NativePrecisionSettings

    item: Item = record.into_item(NativePrecisionSettings()) if hasattr(record, "into_item") else record
    layouts = {key: t for key, t in iter_tensors(item) if isinstance(t, ShardedTensor)}

    def rule(key: str, shape: tuple[int, ...]) -> Any:
        t = layouts.get(key)
        return t.layout if t is not None and t.shape == tuple(shape) else None

    return rule


def read_orbax(path: Path, mmap: bool = False, *,
               sharding: Sharding | ShardingRule | None = None) -> tuple[Header, Item]:
    """Header and item of a trainrec Orbax checkpoint (the `trainrec.orbax` format's
    reader). Raises `FileMissingError` for a missing path, `CorruptRecordError` for a
    file, a directory that is not a whole trainrec Orbax checkpoint, or any damage.
    `sharding` (as `OrbaxRecorder`'s): the layout a tensor saved from shards is read
    into, each process reading its own shards; None: every tensor whole."""
    source = str(path)
    path = Path(os.path.abspath(path))  # Orbax takes absolute paths only
    doc = _read_doc(path, source)
    header = parse_header(doc, FORMAT, VERSION[0], source)
    table = _table(doc, source)
    shard_crcs = _shard_table(doc, table, source)
    layouts = _read_layouts(table, shard_crcs, sharding)
    arrays = _read_arrays(path, table, source, layouts)
    tensors: list[TensorData] = []
    damaged: ChecksumError | None = None  # a shard this process read, checked by it alone
    for i, (key, shape, dtype, name) in enumerate(table):
        if name is None:
            arr: Any = np.zeros(shape, dtype.numpy)
        else:
            arr = arrays[name]
            if arr.dtype != dtype.numpy or tuple(arr.shape) != tuple(shape):
                raise CorruptRecordError(
                    f"Orbax gave a {arr.dtype} array of shape {tuple(arr.shape)}, the table says "
                    f"{dtype.value} {tuple(shape)}", source=source, key=f"item.{key}")
        if i not in shard_crcs:
            tensors.append(TensorData.from_array(arr, copy=False))
            continue
        try:
            tensors.append(_verified_shards(arr, shard_crcs[i], source, key))
        except ChecksumError as e:
            damaged = damaged or e
            tensors.append(TensorData.from_array(np.zeros(shape, dtype.numpy)))  # not returned
    if layouts:  # each process checked only its own shards: all fail if one does
        _agree(damaged, source)
    elif damaged is not None:
        raise damaged
    item = _decode(doc["item"], tensors, source)
    if len(list(iter_tensors(item))) != len(tensors):
        raise CorruptRecordError("the item does not refer to every tensor of the table once",
                                 source=source, key="item")
    _verify(item, doc["checksums"], shard_crcs, source)
    return header, restore_dtypes(item, doc.get("dtypes"), source)


# -- saving ------------------------------------------------------------------------------------


def _check_target(path: Path) -> None:
    """Refuse to replace anything but a trainrec Orbax checkpoint: a save over a file or a
    foreign directory would delete what the caller did not mean to lose."""
    if not path.parent.is_dir():
        raise FileMissingError(f"cannot save: the folder {str(path.parent)!r} does not exist "
                               "(create it first)", source=str(path))
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink():
        raise RecorderError("the target is a symlink; save to the directory it names instead",
                            source=str(path))
    if not path.is_dir():
        raise RecorderError("the target is a file; an Orbax checkpoint is a directory and a save "
                            "replaces only an Orbax checkpoint of trainrec's", source=str(path))
    if not _is_regular(path / MARKER):
        raise RecorderError("the target is a directory that is not a trainrec Orbax checkpoint; "
                            "a save replaces only those (choose another path)", source=str(path))


def _encode(item: Item) -> Any:
    counter = iter(range(1 << 62))

    def leaf(_: str, v: Any) -> Any:
        if isinstance(v, TensorData):
            return {TENSOR_KEY: next(counter)}
        if isinstance(v, bytes):
            return {TENSOR_KEY: {"bytes": base64.b64encode(v).decode("ascii")}}
        if isinstance(v, float) and not math.isfinite(v):
            return {TENSOR_KEY: {"f64": struct.pack(">d", v).hex()}}
        return v

    return map_leaves(item, leaf)


def _doc_crc(doc: dict[str, Any]) -> int:
    body = {k: v for k, v in doc.items() if k != "crc"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return crc32(text.encode("ascii"))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(new: Path, old: Path) -> None:
    """Swap the directories `new` and `old` in one step: `old`'s path then holds the new
    checkpoint and `new`'s the previous one. Raises `RecorderError` where the system
    cannot (not Linux, or a file system without `RENAME_EXCHANGE`), leaving both as they
    were."""
    if sys.platform != "linux":
        raise RecorderError("replacing an existing Orbax checkpoint needs Linux "
                            "(renameat2 RENAME_EXCHANGE); save to a new path", source=str(old))
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        hint = ("; this file system cannot exchange two paths atomically: save to a new path"
                if err in (errno.EINVAL, errno.ENOSYS) else "")
        raise RecorderError(f"cannot put the new checkpoint in place: {os.strerror(err)}{hint} "
                            f"(the new one is at {str(new)!r})", source=str(old))
    dfd = os.open(old.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)


def _committed_crc(path: Path) -> Any:
    """The `crc` of the JSON item at `path` (None when there is none that parses)."""
    try:
        doc = read_json(path / MARKER, max_bytes=MAX_JSON_BYTES, max_depth=None, follow=False)
    except RecorderError:
        return None
    return doc.get("crc") if isinstance(doc, dict) else None


def _process_index() -> int:
    import jax

    return int(jax.process_index())


def _sync(name: str) -> None:
    """A barrier across JAX processes (nothing with one process)."""
    import jax

    if jax.process_count() > 1:
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(name)


# -- loading -----------------------------------------------------------------------------------


def _read_doc(path: Path, source: str) -> dict[str, Any]:
    if not path.exists():
        raise FileMissingError("no such checkpoint", source=source)
    if not path.is_dir():
        try:
            with open_regular(path, source) as f:
                hint = reader_of(f.read(64), not_=FORMAT)
        except (OSError, RecorderError):
            hint = ""
        raise CorruptRecordError("a file, not an Orbax checkpoint (a directory)"
                                 + (hint or "; trainrec.read_file reads a record file of any format"),
                                 source=source)
    _check_tree(path, source)
    marker = path / MARKER
    if not _is_regular(marker):
        what = ("an Orbax checkpoint without trainrec's item (items: "
                f"{sorted(p.name for p in path.iterdir() if p.is_dir())})"
                if _is_regular(path / "_CHECKPOINT_METADATA") else "not an Orbax checkpoint")
        raise CorruptRecordError(f"{what}: no {MARKER} file", source=source)
    if not _is_regular(path / "commit_success.txt") and not _is_regular(path / "_CHECKPOINT_METADATA"):
        raise CorruptRecordError("an Orbax checkpoint that was never finalized", source=source)
    # the item's nesting is bounded by `_decode` (256), below the parser's recursion limit
    doc = read_json(marker, max_bytes=MAX_JSON_BYTES, max_depth=None, source=source, key=MARKER,
                    follow=False)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptRecordError(f"the JSON item is not a {FORMAT} header", source=source,
                                 key=MARKER)
    stored = doc.get("crc")
    try:
        computed = _doc_crc(doc)
    except (ValueError, TypeError, RecursionError):  # a non-finite float: never written
        computed = -1
    if type(stored) is not int or stored != computed:
        raise CorruptRecordError("the JSON item's checksum does not match: it was edited or "
                                 "damaged after the save", source=source, key=MARKER)
    return doc


def _is_regular(path: Path) -> bool:
    """Whether `path` is a regular file (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _check_tree(path: Path, source: str) -> None:
    """Refuse a checkpoint holding anything but regular files and real folders: Orbax and
    tensorstore open every file they read as it is, so a FIFO would block them (a load,
    `trainrec verify`) forever, a device never end, and a link read outside the
    checkpoint. Nothing is opened."""
    folders = [path]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
                    elif not entry.is_file(follow_symlinks=False):
                        what = kind_of(entry.stat(follow_symlinks=False).st_mode)
                        raise CorruptRecordError(
                            f"{os.path.relpath(entry.path, path)} is {what}: an Orbax checkpoint "
                            "holds only regular files and folders (nothing was read)",
                            source=source)
        except OSError as e:
            raise RecorderError(f"cannot list the checkpoint: {e}", source=source) from e


def _check_orbax_json(path: Path, names: list[str], source: str) -> None:
    """Read Orbax's own JSON files within bounds before Orbax does (a sparse 8 GiB
    `_METADATA` was a `MemoryError`, and one listing 15,000 arrays the table does not have
    made Orbax open each for 12 seconds before failing), and refuse array metadata that
    lists other arrays than the table's."""
    cap = _ORBAX_JSON_BYTES + _ORBAX_JSON_BYTES_PER_ARRAY * len(names)
    for name in ("_CHECKPOINT_METADATA", f"{ARRAYS_ITEM}/_METADATA", f"{ARRAYS_ITEM}/_sharding"):
        if not (path / name).exists():
            continue
        doc = read_json(path / name, max_bytes=cap, max_depth=16, source=source, key=name,
                        follow=False)
        tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
        if name.endswith("/_METADATA") and isinstance(tree, dict):
            want = {str((n,)) for n in names}
            if set(tree) != want:
                extra, missing = sorted(set(tree) - want), sorted(want - set(tree))
                raise CorruptRecordError(
                    f"the arrays do not match the tensor table: Orbax's array metadata lists "
                    f"{len(tree)}, the table {len(want)}"
                    + (f"; not in the table: {', '.join(extra[:5])}" if extra else "")
                    + (f"; missing: {', '.join(missing[:5])}" if missing else ""),
                    source=source, key=name)


_Row = tuple[str, tuple[int, ...], DType, "str | None"]


def _table(doc: dict[str, Any], source: str) -> list[_Row]:
    rows = doc.get("tensors")
    if not isinstance(rows, list):
        raise CorruptRecordError("the tensor table is missing", source=source, key="tensors")
    out: list[_Row] = []
    for i, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
              and isinstance(row[1], list) and len(row[1]) <= 64
              and all(type(d) is int and d >= 0 for d in row[1])
              and (row[3] is None or row[3] == f"{i:06d}"))
        try:
            dtype = DType.from_code(row[2]) if ok else None
        except ValueError:
            dtype = None
        if dtype is None:
            raise CorruptRecordError(f"malformed tensor table entry {i}", source=source,
                                     key="tensors")
        shape = tuple(row[1])
        if (row[3] is None) != (math.prod(shape) == 0):
            raise CorruptRecordError(f"tensor table entry {i} names an array for a tensor without "
                                     "elements, or none for one with", source=source, key="tensors")
        out.append((row[0], shape, dtype, row[3]))
    return out


def _read_arrays(path: Path, table: list[_Row], source: str,
                 layouts: dict[str, Any] | None = None) -> dict[str, Any]:
    expected = {name: (shape, dtype) for _, shape, dtype, name in table if name is not None}
    if not expected:
        return {}
    where = path / ARRAYS_ITEM
    if not where.is_dir():
        raise CorruptRecordError(f"the {ARRAYS_ITEM} item is missing", source=source)
    _check_orbax_json(path, sorted(expected), source)
    import orbax.checkpoint as ocp

    try:
        meta = ocp.PyTreeCheckpointHandler().metadata(where)
        tree = getattr(meta, "tree", meta)
        found = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in dict(tree).items()}
    except Exception as e:  # Orbax's errors for damaged metadata
        raise CorruptRecordError(f"Orbax cannot read the array metadata: {_said(e)}",
                                 source=source, key=ARRAYS_ITEM) from e
    problems = []
    for name in sorted(expected.keys() | found.keys()):
        want, got = expected.get(name), found.get(name)
        if want is None:
            problems.append(f"{name}: an array the table does not list")
        elif got is None:
            problems.append(f"{name}: missing")
        elif got != (want[0], want[1].numpy):
            problems.append(f"{name}: {got[1]} {got[0]}, the table says {want[1].value} {want[0]}")
    if problems:
        raise CorruptRecordError("the arrays do not match the tensor table: " + "; ".join(problems),
                                 source=source, key=ARRAYS_ITEM)
    layouts = layouts or {}
    restore: dict[str, Any] = {
        name: (ocp.ArrayRestoreArgs(sharding=layouts[name], global_shape=tuple(expected[name][0]),
                                    dtype=expected[name][1].numpy)
               if name in layouts else ocp.RestoreArgs(restore_type=np.ndarray))
        for name in expected}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            got_items = ckptr.restore(path, args=ocp.args.Composite(
                **{ARRAYS_ITEM: ocp.args.PyTreeRestore(restore_args=restore)}))
        restored = dict(got_items[ARRAYS_ITEM])
    except Exception as e:  # tensorstore's errors for missing or damaged chunks
        raise CorruptRecordError(f"Orbax cannot read the arrays: {_said(e)}",
                                 source=source, key=ARRAYS_ITEM) from e
    return {k: v if k in layouts else np.asarray(v) for k, v in restored.items()}


# -- tensors saved from shards ----------------------------------------------------------------


def _index_text(index: ShardIndex) -> str:
    """A shard's place as text, `"0:4,0:8"` (start:stop per axis; `""` for a scalar)."""
    return ",".join(f"{a}:{b}" for a, b in index)


def _parse_index(text: Any, shape: tuple[int, ...]) -> ShardIndex | None:
    """The shard index `text` names inside `shape`, None when it is malformed or outside."""
    if not isinstance(text, str):
        return None
    parts = text.split(",") if text else []
    if len(parts) != len(shape):
        return None
    out = []
    for part, n in zip(parts, shape):
        a, sep, b = part.partition(":")
        if not (sep and a.isdigit() and b.isdigit() and int(a) <= int(b) <= n):
            return None
        out.append((int(a), int(b)))
    return tuple(out)


def _bytes_of(t: TensorData) -> Any:
    return t.array.reshape(-1).view(np.uint8).data


def _global_array(t: ShardedTensor, source: str, key: str) -> Any:
    """The global `jax.Array` Orbax is given for `t`: this process's devices get its
    shards (`jax.make_array_from_single_device_arrays`), so each process writes its own."""
    from .placement import global_array

    try:
        return global_array(t)
    except RecorderError as e:
        raise RecorderError(str(e), source=source, key=key) from None
    except (ValueError, TypeError) as e:
        raise RecorderError(f"cannot rebuild the global array from this process's shards: {e}",
                            source=source, key=key) from e


def _all_processes(local: Any) -> list[Any]:
    """`local` (JSON data) of every JAX process, in process order (a collective: every
    process calls it)."""
    import jax

    if jax.process_count() == 1:
        return [local]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(local, sort_keys=True).encode("ascii"), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(every[p, : int(n)])) for p, n in enumerate(sizes)]


def _merged_shard_crcs(local: dict[str, dict[str, int]], item: Item,
                       source: str) -> dict[str, dict[str, int]]:
    """The `shards` table: for each tensor saved from shards (by tensor index), the
    CRC-32 of each distinct shard, gathered from every process (each computes those its
    devices hold). Raises `RecorderError` when two processes hold different bytes for one
    shard or when no process holds one."""
    if not local:
        return {}
    merged: dict[str, dict[str, int]] = {}
    for part in _all_processes(local):
        for index, crcs in part.items():
            into = merged.setdefault(index, {})
            for where, crc in crcs.items():
                if into.setdefault(where, crc) != crc:
                    raise RecorderError(f"two processes hold different values for the shard at "
                                        f"[{where}] of tensor {index}", source=source)
    tensors = list(iter_tensors(item))
    for index, crcs in merged.items():
        key, t = tensors[int(index)]
        assert isinstance(t, ShardedTensor), key  # every process captured the same record
        layout = t.layout.devices_indices_map(t.shape).values()
        from .placement import shard_index

        want = {_index_text(shard_index(i, t.shape)) for i in layout}
        if want != set(crcs):
            raise RecorderError(f"the processes hold shards {sorted(crcs)} of a tensor laid out "
                                f"in {sorted(want)}", source=source, key=key)
    return merged


def _shard_table(doc: dict[str, Any], table: list[_Row], source: str) -> dict[int, dict[ShardIndex, int]]:
    """The `shards` table by tensor index, each shard's index parsed; `CorruptRecordError`
    for a malformed one (absent: a 1.0 checkpoint, every tensor whole)."""
    raw = doc.get("shards", {})
    if not isinstance(raw, dict):
        raise CorruptRecordError("malformed shards table", source=source, key="shards")
    out: dict[int, dict[ShardIndex, int]] = {}
    for index, crcs in raw.items():
        i = int(index) if isinstance(index, str) and index.isdigit() else -1
        if not 0 <= i < len(table) or not isinstance(crcs, dict) or not crcs:
            raise CorruptRecordError(f"malformed shards table entry {index!r}", source=source,
                                     key="shards")
        shape = table[i][1]
        parsed: dict[ShardIndex, int] = {}
        for where, crc in crcs.items():
            at = _parse_index(where, shape)
            if at is None or type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
                raise CorruptRecordError(f"malformed shard [{where}] of tensor {index}",
                                         source=source, key="shards")
            parsed[at] = crc
        if sum(math.prod(b - a for a, b in at) for at in parsed) != math.prod(shape):
            raise CorruptRecordError(f"the shards of tensor {index} do not tile its shape {shape}",
                                     source=source, key="shards")
        out[i] = parsed
    return out


def _read_layouts(table: list[_Row], shard_crcs: dict[int, dict[ShardIndex, int]],
                  sharding: Sharding | ShardingRule | None) -> dict[str, Any]:
    """The sharding each array saved from shards is read into (by array name): the
    rule's; the others are read whole."""
    if sharding is None or not shard_crcs:
        return {}
    import jax

    out: dict[str, Any] = {}
    for i, (key, shape, _, name) in enumerate(table):
        if i in shard_crcs and name is not None:
            layout = sharding if isinstance(sharding, jax.sharding.Sharding) else sharding(key, shape)
            if layout is not None:
                if not isinstance(layout, jax.sharding.Sharding):
                    raise TypeError(f"the sharding rule gave {type(layout).__name__} for {key!r}, "
                                    "not a jax.sharding.Sharding or None")
                out[name] = layout
    return out


def _verified_shards(arr: Any, crcs: dict[ShardIndex, int], source: str, key: str) -> TensorData:
    """The tensor of an array saved from shards, each shard checked against its CRC: a
    whole array (read whole, or a layout this process holds all of) as a `TensorData`,
    every saved shard cut from it and checked; a global array spanning other processes
    as a `ShardedTensor` of this process's shards, those in the saved layout checked (a
    shard of another layout has no CRC to check)."""
    from .placement import host_copy, shards_of

    if isinstance(arr, np.ndarray) or arr.is_fully_addressable:
        whole = arr if isinstance(arr, np.ndarray) else host_copy(arr)
        for at, crc in crcs.items():
            part = TensorData.from_array(whole[tuple(slice(a, b) for a, b in at)])
            _check_crc(part, crc, at, source, key)
        return TensorData.from_array(whole, copy=False)
    parts = shards_of(arr)
    for at, part in parts.items():
        if at in crcs:
            _check_crc(part, crcs[at], at, source, key)

    return ShardedTensor(DType.from_numpy(arr.dtype), tuple(arr.shape), parts, arr.sharding)


def _agree(damaged: ChecksumError | None, source: str) -> None:
    """Raise in every process when any found a damaged shard (a collective: a process
    that failed alone would leave the others waiting in their next one)."""
    reports = _all_processes(None if damaged is None else str(damaged))
    for process, report in enumerate(reports):
        if report is not None:
            raise ChecksumError(f"process {process} read a damaged shard: {report}",
                                source=source) from damaged


def _check_crc(part: TensorData, crc: int, at: ShardIndex, source: str, key: str) -> None:
    got = crc32(_bytes_of(part))
    if got != crc:
        raise ChecksumError(f"shard [{_index_text(at)}] checksum mismatch (stored {crc:#010x}, "
                            f"computed {got:#010x})", source=source, key=f"item.{key}")


def _verify(item: Item, checksums: Any, sharded: dict[int, Any], source: str) -> None:
    """Each whole tensor against its CRC-32 in `checksums` (one entry per tensor, in
    order; a tensor saved from shards was checked shard by shard)."""
    verify_checksums(item, checksums, source, recompute=False)  # the table's shape
    for i, ((key, t), stored) in enumerate(zip(iter_tensors(item), checksums)):
        got = None if i in sharded else crc32(_bytes_of(t))
        if got is not None and got != stored:
            raise ChecksumError(f"tensor checksum mismatch (stored {stored:#010x}, computed "
                                f"{got:#010x})", source=source, key=f"item.{key}")


def _said(e: BaseException) -> str:
    """An Orbax or tensorstore error in a line: without the tensorstore spec it appends
    (a page of JSON), at most 600 characters."""
    text = str(e).split(" [tensorstore_spec=")[0]
    text = text if len(text) <= 600 else text[:600] + "..."
    return f"{type(e).__name__}: {text}"


def _decode(node: Any, tensors: list[TensorData], source: str) -> Item:
    seen: set[int] = set()

    def go(n: Any, key: str, depth: int) -> Item:
        if depth > 256:
            raise CorruptRecordError("nesting deeper than 256", source=source, key=key)
        if isinstance(n, dict):
            if TENSOR_KEY in n:
                return special(n, key)
            return {k: go(v, f"{key}.{k}" if key else k, depth + 1) for k, v in n.items()}
        if isinstance(n, list):
            return [go(v, f"{key}.{i}" if key else str(i), depth + 1) for i, v in enumerate(n)]
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        raise CorruptRecordError(f"{type(n).__name__} is not an item", source=source, key=key)

    def special(n: dict[str, Any], key: str) -> Item:
        v = n[TENSOR_KEY]
        if len(n) == 1 and type(v) is int and 0 <= v < len(tensors) and v not in seen:
            seen.add(v)
            return tensors[v]
        if len(n) == 1 and isinstance(v, dict) and len(v) == 1:
            try:
                if isinstance(v.get("bytes"), str):
                    return base64.b64decode(v["bytes"], validate=True)
                if isinstance(v.get("f64"), str) and len(v["f64"]) == 16:
                    value: float = struct.unpack(">d", bytes.fromhex(v["f64"]))[0]
                    return value
            except ValueError:
                pass
        raise CorruptRecordError("a malformed tensor, bytes or float reference", source=source,
                                 key=f"item.{key}" if key else "item")

    out = go(node, "", 0)
    return check_item(out, source=source)
