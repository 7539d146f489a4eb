"""`trainrec.adapter_kit`: everything an adapter author imports, from one place.

An adapter (spec/ADAPTERS.md) binds a framework to trainrec's protocols; its modules
import trainrec names from here (or from `trainrec` itself), never from a module of
trainrec's own layout, which may move. Grouped as the guide uses them:

- protocols its bindings satisfy and the values they exchange (section 1-2): `Backend`,
  `AutodiffBackend` (for an array-API library: `ArrayApiBackend`, `ArrayApiAdapter`),
  `Module`, `AutodiffModule`, `Optimizer`, `LrScheduler`, `ParamId`,
  `DType`, `FloatDType`, `TensorData`, `GradientsParams`, `StateRecord`, `RngRecord`,
  `record`;
- checking a record before loading it (section 2): `expect_kind`, `check_tensor_map`,
  `kind_mismatches`, `cast_problem` (what a cast to the live dtype would change), and the
  errors `RecordMismatchError`, `CorruptRecordError`;
  comparing what identifies a schedule or hyperparameters, with `allow_changes`
  (section 2): `Change`, `field_changes`, `same_value`, `settle`, `unchecked`,
  `parse_changes`, `for_component`, `ABSENT`, `UncheckedIdentityWarning`;
- item trees and the one walker over them: `Item`, `walk`, `walk_pairs`, `map_tree`,
  `map_leaves`, `path_of`, `iter_tensors`, `map_tensors`, `join_key`, `check_item`,
  `compare_items`;
- registration (section 3): `Adapter`, `register_adapter`, `adapt`;
- a recorder of the adapter's own file format: `RecorderBase`, `Precision`,
  `store_tensor`, `check_limits`, `atomic_write` (crash-safe file replacement);
  `location` and `output` (a path or a store URL, and where a save to it writes), `read_url`
  (a record object at a URL, read by its format's reader), `is_url`, and `folders` (a
  checkpoint that is a folder of files at a store URL: staged locally, uploaded, committed
  by one commit object; downloaded and checked to read);
- reading the files of a checkpoint safely: `open_regular` (a regular file only: a FIFO
  or device is refused, never waited on; `follow=False` refuses a link), `read_json` (a
  JSON file within bounds of bytes, values and depth) and `json_fits` (the same bounds,
  for a writer), `kind_of` (what a file that is not regular is, for the error);
- a file format with trainrec's envelope (a header, a per-tensor checksum and dtype table,
  a CRC over every byte; spec/FORMAT.md section 8): `Header`, `FILE_CRC_BYTES`, `CrcWriter`,
  `TensorTables`, `header_fields`, `path_arg`, `reserve_bytes`, `BF16PrecisionSettings`,
  and `ptfile` (the torch-free reader of `.pt` zips the torch adapter writes); reading one
  back: `parse_header`, `verify_checksums`, `restore_dtypes`, `crc32`, `TENSOR_KEY`
  (the map key items may not use, free for a format to mark tensors with) and
  `reader_of` (which recorder reads a file of another format, for the error);
- conversion through a neutral form (spec/ADAPTERS.md section 8): `NeutralForm`,
  `Neutral`, `NeutralOptimizer`, `ScheduleCount`, `TargetState`, `ConversionError`,
  `register_neutral_form`, `as_map`, `as_list`, `as_count`, `tensors_of`, the rules a form
  may preset (`Rule`, `PRESETS`) and `TrainingRecord`;
- the training job the conformance suite and `trainrec demo` drive (section 4):
  `Workload`, `Parts`, `train_until`.
"""

from .conversion.convert import (
    ConversionError,
    Neutral,
    NeutralForm,
    NeutralOptimizer,
    ScheduleCount,
    TargetState,
    as_count,
    as_list,
    as_map,
    out_in_weight,
    register_neutral_form,
    tensors_of,
)
from .conversion.rules import PRESETS, Rule
from .errors import CorruptRecordError, RecorderError, RecordMismatchError
from .format.envelope import (
    FILE_CRC_BYTES,
    CrcWriter,
    TensorTables,
    header_fields,
    parse_header,
    path_arg,
    reserve_bytes,
    restore_dtypes,
    verify_checksums,
)
from .format.header import Header
from .format.limits import check_limits
from .items.checksum import crc32
from .items.dtypes import DType, FloatDType
from .items.tensor import ShardedTensor, ShardIndex, TensorData
from .items.tree import (
    TENSOR_KEY,
    Item,
    check_item,
    compare_items,
    iter_tensors,
    join_key,
    map_leaves,
    map_tensors,
    map_tree,
    path_of,
    walk,
    walk_pairs,
)
from .precision import BF16PrecisionSettings, Precision, store_tensor
from .recorders import ptfile
from .recorders.namedmpk import RecorderBase
from .recorders.remote import read_url
from .recorders.sniff import reader_of
from .storage import folder as folders
from .storage.atomic import atomic_write
from .storage.files import json_fits, kind_of, open_regular, read_json
from .storage.location import is_url, location, output
from .training.array_api import ArrayApiAdapter, ArrayApiBackend
from .training.changes import (
    ABSENT,
    Change,
    UncheckedIdentityWarning,
    field_changes,
    for_component,
    parse_changes,
    same_value,
    settle,
    unchecked,
)
from .training.gradients import GradientsParams, GradientsParamsRecord
from .training.protocols import (
    AutodiffBackend,
    AutodiffModule,
    Backend,
    LrScheduler,
    Module,
    Optimizer,
    ParamId,
    PrecisionSettings,
    Record,
    Recorder,
)
from .training.record import TrainingRecord
from .training.records import (
    RngRecord,
    StateRecord,
    cast_problem,
    check_tensor_map,
    expect_kind,
    kind_mismatches,
    record,
)
from .training.registry import Adapter, adapt, register_adapter
from .workload.loop import Parts, Workload, train_until

__all__ = [
    "ABSENT",
    "Adapter",
    "ArrayApiAdapter",
    "ArrayApiBackend",
    "AutodiffBackend",
    "AutodiffModule",
    "BF16PrecisionSettings",
    "Backend",
    "Change",
    "ConversionError",
    "CorruptRecordError",
    "CrcWriter",
    "DType",
    "FILE_CRC_BYTES",
    "FloatDType",
    "GradientsParams",
    "GradientsParamsRecord",
    "Header",
    "Item",
    "LrScheduler",
    "Module",
    "Neutral",
    "out_in_weight",
    "NeutralForm",
    "NeutralOptimizer",
    "Optimizer",
    "PRESETS",
    "ParamId",
    "Parts",
    "Precision",
    "PrecisionSettings",
    "Record",
    "RecordMismatchError",
    "Recorder",
    "RecorderBase",
    "RecorderError",
    "RngRecord",
    "Rule",
    "ScheduleCount",
    "StateRecord",
    "TENSOR_KEY",
    "TargetState",
    "TensorData",
    "ShardedTensor",
    "ShardIndex",
    "TensorTables",
    "TrainingRecord",
    "UncheckedIdentityWarning",
    "Workload",
    "adapt",
    "as_count",
    "as_list",
    "as_map",
    "atomic_write",
    "location",
    "output",
    "folders",
    "is_url",
    "read_url",
    "check_item",
    "check_limits",
    "cast_problem",
    "check_tensor_map",
    "compare_items",
    "crc32",
    "expect_kind",
    "field_changes",
    "for_component",
    "header_fields",
    "iter_tensors",
    "join_key",
    "json_fits",
    "kind_of",
    "kind_mismatches",
    "map_leaves",
    "map_tensors",
    "map_tree",
    "open_regular",
    "parse_header",
    "path_arg",
    "parse_changes",
    "path_of",
    "ptfile",
    "read_json",
    "reader_of",
    "record",
    "register_adapter",
    "register_neutral_form",
    "reserve_bytes",
    "restore_dtypes",
    "same_value",
    "settle",
    "store_tensor",
    "tensors_of",
    "train_until",
    "unchecked",
    "verify_checksums",
    "walk",
    "walk_pairs",
]


def __dir__() -> list[str]:
    return __all__
