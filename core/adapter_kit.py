"""`trainrec.adapter_kit`: everything an adapter author imports, from one place.

An adapter (spec/ADAPTERS.md) binds a framework to trainrec's protocols; its modules
import trainrec names from here (or from `trainrec` itself), never from a module of
trainrec's own layout, which may move. Grouped as the guide uses them:

- protocols its bindings satisfy and the values they exchange (section 1-2): `Backend`,
  `AutodiffBackend`, `Module`, `AutodiffModule`, `Optimizer`, `LrScheduler`, `ParamId`,
  `DType`, `FloatDType`, `TensorData`, `GradientsParams`, `StateRecord`, `RngRecord`,
  `record`;
- checking a record before loading it (section 2): `expect_kind`, `check_tensor_map`,
  `kind_mismatches`, and the errors `RecordMismatchError`, `CorruptRecordError`;
- item trees and the one walker over them: `Item`, `walk`, `walk_pairs`, `map_tree`,
  `map_leaves`, `path_of`, `iter_tensors`, `map_tensors`, `join_key`, `check_item`,
  `compare_items`;
- registration (section 3): `Adapter`, `register_adapter`, `adapt`;
- a recorder of the adapter's own file format: `RecorderBase`, `Precision`,
  `store_tensor`, `check_limits`, `atomic_write` (crash-safe file replacement);
- the training job the conformance suite and `trainrec demo` drive (section 4):
  `Workload`, `Parts`, `train_until`.
"""

from ._atomic import atomic_write
from .dtypes import DType, FloatDType
from .errors import CorruptRecordError, RecorderError, RecordMismatchError
from .format import check_limits
from .gradients import GradientsParams, GradientsParamsRecord
from .items import (
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
from .precision import Precision, store_tensor
from .protocols import (
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
from .recorders import RecorderBase
from .records import RngRecord, StateRecord, check_tensor_map, expect_kind, kind_mismatches, record
from .registry import Adapter, adapt, register_adapter
from .tensor import TensorData
from .workload import Parts, Workload, train_until

__all__ = [
    "Adapter",
    "AutodiffBackend",
    "AutodiffModule",
    "Backend",
    "CorruptRecordError",
    "DType",
    "FloatDType",
    "GradientsParams",
    "GradientsParamsRecord",
    "Item",
    "LrScheduler",
    "Module",
    "Optimizer",
    "ParamId",
    "Parts",
    "Precision",
    "PrecisionSettings",
    "Record",
    "Recorder",
    "RecorderBase",
    "RecorderError",
    "RecordMismatchError",
    "RngRecord",
    "StateRecord",
    "TensorData",
    "Workload",
    "adapt",
    "atomic_write",
    "check_item",
    "check_limits",
    "check_tensor_map",
    "compare_items",
    "expect_kind",
    "iter_tensors",
    "join_key",
    "kind_mismatches",
    "map_leaves",
    "map_tensors",
    "map_tree",
    "path_of",
    "record",
    "register_adapter",
    "store_tensor",
    "train_until",
    "walk",
    "walk_pairs",
]


def __dir__() -> list[str]:
    return __all__
