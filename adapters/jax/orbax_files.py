"""The Orbax checkpoint directory on disk: its item names, a save's target checked, the
new checkpoint swapped in for the old atomically (`renameat2(RENAME_EXCHANGE)`), the
directory's tree and Orbax's own JSON files checked before Orbax reads them, and the
arrays read through Orbax as host numpy.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np

from trainrec import CorruptRecordError, FileMissingError, RecorderError
from trainrec.adapter_kit import kind_of, read_json

from .orbax_json import _Row

ARRAYS_ITEM = "arrays"
JSON_ITEM = "trainrec"
JSON_FILE = "metadata"  # the file `ocp.args.JsonSave` writes inside its item's directory
MARKER = f"{JSON_ITEM}/{JSON_FILE}"


_ORBAX_JSON_BYTES = 1 << 20
_ORBAX_JSON_BYTES_PER_ARRAY = 2048
"""Orbax's own JSON files (`_CHECKPOINT_METADATA`, `arrays/_METADATA`, `arrays/_sharding`)
are read by trainrec first, up to this many bytes plus this many per array of the table
(about 190 are written per array), before Orbax reads them."""


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


def _said(e: BaseException) -> str:
    """An Orbax or tensorstore error in a line: without the tensorstore spec it appends
    (a page of JSON), at most 600 characters."""
    text = str(e).split(" [tensorstore_spec=")[0]
    text = text if len(text) <= 600 else text[:600] + "..."
    return f"{type(e).__name__}: {text}"
