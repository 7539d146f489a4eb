"""`_Reader`: DCP's file reader in two passes, so that a rejected `DCPRecorder.load`
changes nothing live: every entry's checksum and every non-tensor value checked in DCP's
planning step (whose failures DCP raises on every rank), then the reads into the live state.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .dcp_checksum import _check_checksums
from .dcp_layout import DCP_DIR
from .dcp_state import Backup
from .dcp_unpickle import _plain_load, _Planner
from .dcp_zip import _read_in_place


class _Reader(FileSystemReader):
    """DCP's file reader, in two passes, so that a rejected load changes nothing live.

    In DCP's planning step (`prepare_local_plan`), every entry this rank will read
    (`verify=False`: every non-tensor entry) is checked against the CRC-32 the save
    recorded of its bytes, and the non-tensor entries are unpickled as plain values and
    `check`ed; DCP gathers every rank's failure and raises it on every rank before any
    reads. Only then are the entries read, the tensors into the live state, once `backup`
    has made the `Backup` a failure from there on is rolled back from. `error` keeps
    what refused the load on this rank (DCP wraps it in a `CheckpointException`);
    `reading` says the second pass began."""

    def __init__(self, folder: Path, metadata: Any, shards: dict[str, dict[tuple[int, int], int]],
                 group: Any, check: Callable[[dict[str, Any]], None], verify: bool = True,
                 backup: Callable[[], Backup] | None = None) -> None:
        super().__init__(str(folder))
        self.folder, self.metadata, self.shards = folder, metadata, shards
        self.group, self.check, self.verify = group, check, verify
        self.make_backup = backup
        self.backup: Backup | None = None
        self.error: Exception | None = None
        self.refused: Exception | None = None
        self.reading = False
        self.plain: dict[str, Any] = {}  # the non-tensor entries, checked, for `_Planner`

    @classmethod
    def refusing(cls, error: Exception, group: Any, path: Path) -> _Reader:
        """The reader of a rank whose own checks failed (`error`): DCP plans nothing for it
        (an empty state dict and metadata), and its `read_data` tells the other ranks."""
        reader = cls(path / DCP_DIR, Metadata(state_dict_metadata={}, storage_data={}), {}, group,
                     lambda loaded: None)
        reader.refused = reader.error = error
        return reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata  # read once, without unpickling anything but DCP's metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP calls this on every rank with what the rank will read, in its planning step,
        whose failures DCP gathers and raises on every rank before any rank reads: the
        checks go here, and need no round of their own."""
        try:
            if self.refused is not None:
                raise self.refused
            items: list[ReadItem] = list(plan.items)
            raw = [i for i in items if i.type == LoadItemType.BYTE_IO]
            where = [self.storage_data[i.storage_index] for i in (items if self.verify else raw)]
            _check_checksums(self.folder, {(str(w.relative_path), int(w.offset), int(w.length))
                                           for w in where}, self.shards)
            self.plain = self._plain_values(raw)
            self.check(self.plain)
        except Exception as e:
            self.error = e  # DCP raises a CheckpointException; `load` raises this instead
            raise
        return super().prepare_local_plan(plan)

    def _plain_values(self, items: list[ReadItem]) -> dict[str, Any]:
        """The non-tensor entries `items` by name, unpickled as plain values only."""
        out: dict[str, Any] = {}
        files: dict[str, list[ReadItem]] = {}
        for item in items:
            files.setdefault(str(self.storage_data[item.storage_index].relative_path), []).append(item)
        for name, some in files.items():
            with open(self.folder / name, "rb") as f:
                for item in some:
                    where = self.storage_data[item.storage_index]
                    f.seek(int(where.offset))
                    out[item.dest_index.fqn] = _plain_load(io.BytesIO(f.read(int(where.length))),
                                                           item.dest_index.fqn)
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        """DCP's read, except that a tensor entry whose bytes are exactly its live target's
        (`_read_in_place`) is read straight into it, where DCP would `torch.load` it into a
        new tensor and copy that; and that the non-tensor entries are the values checked
        in the planning step, not read again."""
        if self.make_backup is not None:
            self.backup = self.make_backup()  # nothing live changed yet when this fails
        self.reading = True  # every rank's checks passed: now into the live state
        if isinstance(planner, _Planner):
            planner.plain = self.plain
        rest: list[ReadItem] = []
        files: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                if isinstance(planner, _Planner) and item.dest_index.fqn in self.plain:
                    planner.load_bytes(item, io.BytesIO())  # the checked value
                else:
                    rest.append(item)
            else:
                where = self.storage_data[item.storage_index]
                files.setdefault(str(where.relative_path), []).append(item)
        for name, items in files.items():
            with open(self.folder / name, "rb") as f:
                rest.extend(i for i in items
                            if not _read_in_place(f, self.storage_data[i.storage_index], i, planner))
        return super().read_data(dataclasses.replace(plan, items=rest), planner)
