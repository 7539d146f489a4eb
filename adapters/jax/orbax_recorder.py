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

This module is the recorder, `read_orbax` and the bounded read of the JSON item (beside
`MAX_JSON_BYTES`, which a save and a load both hold to); the rest is one idea a module:
`orbax_json` (the JSON item encoded and decoded, its CRC, its tensor table),
`orbax_files` (the checkpoint directory on disk, and the atomic exchange of a save over
an old one) and `orbax_shards` (tensors captured across processes, shard by shard).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from trainrec import ChecksumError, CorruptRecordError, FileMissingError, RecorderError, TensorData
from trainrec.adapter_kit import (
    Header,
    Item,
    PrecisionSettings,
    RecorderBase,
    ShardedTensor,
    TensorTables,
    check_item,
    crc32,
    folders,
    header_fields,
    iter_tensors,
    json_fits,
    location,
    open_regular,
    parse_header,
    path_arg,
    read_json,
    reader_of,
    restore_dtypes,
    store_tensor,
)

from .orbax_files import (
    ARRAYS_ITEM,
    JSON_ITEM,
    MARKER,
    _check_target,
    _check_tree,
    _exchange,
    _is_regular,
    _read_arrays,
    _said,
)
from .orbax_json import _decode, _doc_crc, _encode, _table
from .orbax_shards import (
    Sharding,
    ShardingRule,
    _agree,
    _bytes_of,
    _global_array,
    _index_text,
    _merged_shard_crcs,
    _read_layouts,
    _shard_table,
    _verified_shards,
    _verify,
)

__all__ = ["OrbaxRecorder", "FORMAT", "VERSION", "read_orbax", "MAX_JSON_BYTES", "shardings_of"]

FORMAT = "trainrec.orbax"
VERSION = (1, 1)  # 1.1: the `shards` table (tensors captured across processes)
MAX_JSON_BYTES = 16 << 20
"""A JSON item larger than this is refused before it is read, and never written (it holds
the structure and scalars only; the arrays live in Orbax's own files: 16 MiB is the table
of about 150,000 tensors). Its values are held to the object budget of `json_fits`."""

_STAGING = ".trainrec-new"
"""A save over an existing checkpoint `NAME` writes `NAME.trainrec-new` first."""


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
    ) -> Path | str:
        """Write `item` as the Orbax checkpoint `args` (a local path: a save over one
        there exchanges the two atomically; or a store URL, from one process: written in a
        private local temporary folder, uploaded, and committed by `.trainrec-commit`, never
        over a committed one) and return `args` (a `Path`, or the URL)."""
        import orbax.checkpoint as ocp

        check_item(item)
        where = location(args)
        if isinstance(where, str):
            import jax

            if jax.process_count() > 1:
                raise RecorderError("OrbaxRecorder saves to a store URL from one process only "
                                    f"(this run has {jax.process_count()}): save to a shared "
                                    "local folder and upload it, or from one process",
                                    source=where)
            folders.save_folder(where, lambda local: self.save_item(
                item, local, record_type, allow_lossy=allow_lossy))
            return where
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
        where = location(args)
        if isinstance(where, str):  # downloaded, checked against its commit, read there
            return folders.read_staged_folder(
                where, lambda local: read_orbax(local, False, sharding=self._sharding))
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
