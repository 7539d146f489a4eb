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
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainrec import CorruptRecordError, FileMissingError, RecorderError, TensorData
from trainrec.adapter_kit import (
    TENSOR_KEY,
    DType,
    Header,
    Item,
    PrecisionSettings,
    RecorderBase,
    TensorTables,
    check_item,
    crc32,
    header_fields,
    iter_tensors,
    map_leaves,
    parse_header,
    path_arg,
    reader_of,
    restore_dtypes,
    store_tensor,
    verify_checksums,
)

__all__ = ["OrbaxRecorder", "FORMAT", "VERSION", "read_orbax", "MAX_JSON_BYTES"]

FORMAT = "trainrec.orbax"
VERSION = (1, 0)
ARRAYS_ITEM = "arrays"
JSON_ITEM = "trainrec"
JSON_FILE = "metadata"  # the file `ocp.args.JsonSave` writes inside its item's directory
MARKER = f"{JSON_ITEM}/{JSON_FILE}"
MAX_JSON_BYTES = 256 << 20
"""A JSON item larger than this is refused before it is read, and never written (it holds
the structure and scalars only; the arrays live in Orbax's own files)."""

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
    (as for any Orbax save); `jax.distributed.initialize` must have run.
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
        for index, (key, tensor) in enumerate(iter_tensors(item)):
            stored = store_tensor(tensor, self.settings, key=key, allow_lossy=allow_lossy,
                                  recorder=self.native_name())
            tables.add(tensor, stored)
            name = None
            if stored.numel:
                name = f"{index:06d}"
                arrays[name] = self._placed(key, stored, source)
            table.append([key, list(stored.shape), stored.dtype.value, name])
        doc: dict[str, Any] = {
            **header_fields(FORMAT, VERSION, self.settings, record_type),
            "item": _encode(item),
            "tensors": table,
            "checksums": tables.checksums,
            "dtypes": tables.dtypes,
        }
        doc["crc"] = _doc_crc(doc)
        size = len(json.dumps(doc))  # as `JsonSave` writes it
        if size > MAX_JSON_BYTES:
            raise RecorderError(
                f"the record's structure and scalars take {size} bytes as JSON, more than the "
                f"{MAX_JSON_BYTES} a load accepts: hold large data in arrays, not lists",
                source=source)
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
        tensorstore)."""
        return read_orbax(path_arg(args), mmap)


def read_orbax(path: Path, mmap: bool = False) -> tuple[Header, Item]:
    """Header and item of a trainrec Orbax checkpoint (the `trainrec.orbax` format's
    reader). Raises `FileMissingError` for a missing path, `CorruptRecordError` for a
    file, a directory that is not a whole trainrec Orbax checkpoint, or any damage."""
    source = str(path)
    path = Path(os.path.abspath(path))  # Orbax takes absolute paths only
    doc = _read_doc(path, source)
    header = parse_header(doc, FORMAT, VERSION[0], source)
    table = _table(doc, source)
    arrays = _read_arrays(path, table, source)
    tensors: list[TensorData] = []
    for key, shape, dtype, name in table:
        if name is None:
            arr = np.zeros(shape, dtype.numpy)
        else:
            arr = arrays[name]
            if arr.dtype != dtype.numpy or tuple(arr.shape) != tuple(shape):
                raise CorruptRecordError(
                    f"Orbax gave a {arr.dtype} array of shape {tuple(arr.shape)}, the table says "
                    f"{dtype.value} {tuple(shape)}", source=source, key=f"item.{key}")
        tensors.append(TensorData.from_array(arr, copy=False))
    item = _decode(doc["item"], tensors, source)
    if len(list(iter_tensors(item))) != len(tensors):
        raise CorruptRecordError("the item does not refer to every tensor of the table once",
                                 source=source, key="item")
    verify_checksums(item, doc["checksums"], source)
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
    if not (path / MARKER).is_file():
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
        doc = json.loads((path / MARKER).read_bytes())
    except (OSError, ValueError, RecursionError):
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
            with open(path, "rb") as f:
                hint = reader_of(f.read(64), not_=FORMAT)
        except OSError:
            hint = ""
        raise CorruptRecordError("a file, not an Orbax checkpoint (a directory)"
                                 + (hint or "; trainrec.read_file reads a record file of any format"),
                                 source=source)
    marker = path / MARKER
    if not marker.is_file():
        what = ("an Orbax checkpoint without trainrec's item (items: "
                f"{sorted(p.name for p in path.iterdir() if p.is_dir())})"
                if (path / "_CHECKPOINT_METADATA").is_file() else "not an Orbax checkpoint")
        raise CorruptRecordError(f"{what}: no {MARKER} file", source=source)
    if not (path / "commit_success.txt").is_file() and not (path / "_CHECKPOINT_METADATA").is_file():
        raise CorruptRecordError("an Orbax checkpoint that was never finalized", source=source)
    size = marker.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CorruptRecordError(f"the JSON item has {size} bytes, more than {MAX_JSON_BYTES}",
                                 source=source, key=MARKER)
    try:
        doc = json.loads(marker.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CorruptRecordError(f"the JSON item does not parse: {e}", source=source,
                                 key=MARKER) from None
    except OSError as e:
        raise RecorderError(f"cannot read the JSON item: {e}", source=source, key=MARKER) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptRecordError(f"the JSON item is not a {FORMAT} header", source=source,
                                 key=MARKER)
    stored = doc.get("crc")
    try:
        computed = _doc_crc(doc)
    except (ValueError, TypeError):  # a non-finite float: never written by a save
        computed = -1
    if type(stored) is not int or stored != computed:
        raise CorruptRecordError("the JSON item's checksum does not match: it was edited or "
                                 "damaged after the save", source=source, key=MARKER)
    return doc


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


def _read_arrays(path: Path, table: list[_Row], source: str) -> dict[str, np.ndarray[Any, Any]]:
    expected = {name: (shape, dtype) for _, shape, dtype, name in table if name is not None}
    if not expected:
        return {}
    import orbax.checkpoint as ocp

    where = path / ARRAYS_ITEM
    if not where.is_dir():
        raise CorruptRecordError(f"the {ARRAYS_ITEM} item is missing", source=source)
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
    restore = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in expected}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            got_items = ckptr.restore(path, args=ocp.args.Composite(
                **{ARRAYS_ITEM: ocp.args.PyTreeRestore(restore_args=restore)}))
        restored = dict(got_items[ARRAYS_ITEM])
    except Exception as e:  # tensorstore's errors for missing or damaged chunks
        raise CorruptRecordError(f"Orbax cannot read the arrays: {_said(e)}",
                                 source=source, key=ARRAYS_ITEM) from e
    return {k: np.asarray(v) for k, v in restored.items()}


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
