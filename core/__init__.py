"""trainrec: exact, portable training checkpoints.

A checkpoint taken at any micro-step, even inside a gradient-accumulation window,
restores model, optimizer, LR scheduler, pending accumulated gradients and the caller's
own counters and RNG, so the resumed run is bitwise identical to one that never stopped.

Importing trainrec imports no framework; adapters live in `trainrec.adapters.*`.
"""

from . import errors as _errors
from ._version import __version__
from .check.resume import ResumeReport, check_resume
from .conversion.convert import register_neutral_form
from .errors import (
    ChecksumError,
    CorruptRecordError,
    FileMissingError,
    LossyPrecisionError,
    RecorderError,
    RecordMismatchError,
    UnsupportedVersionError,
)
from .format.header import FORMAT_NAME, FORMAT_VERSION, Header
from .items.dtypes import DType, FloatDType
from .items.tensor import ShardedTensor, TensorData
from .items.tree import Item
from .manager.local import CheckpointManager, KeepBest, Preemption
from .precision import (
    BF16PrecisionSettings,
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
    Precision,
    first_lossy,
    is_lossless,
)
from .recorders import burn as _burn
from .recorders import formats as _formats
from .recorders.flaxmsgpack import FlaxMsgpackFileRecorder
from .recorders.formats import Format, register_format
from .recorders.namedmpk import (
    CompactRecorder,
    DefaultRecorder,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
)
from .recorders.read import read_file
from .training.accumulator import GradientsAccumulator
from .training.array_api import ArrayApiAdapter, ArrayApiBackend
from .training.changes import UncheckedIdentityWarning
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
from .training.record import RestoredTraining, TrainingRecord
from .training.records import RngRecord, StateRecord, record
from .training.registry import Adapter, adapt, register_adapter
from .workload.loop import Parts, Workload, train_until


def _burn_layout(record: object) -> dict[str, Item] | None:
    """A Bin template laid out from another adapter's record by the neutral forms; the
    conversion layer sits above the recorders', so the package wires it here."""
    from .conversion.burn_neutral import burn_layout

    return burn_layout(record)


_burn.register_template_layout(_burn_layout)
# the errors of the layers below the format registry name the reader of another format's file
_errors.register_format_hints(_formats.reader_of, _formats.directory_reader)

__all__ = [
    "__version__",
    "Adapter",
    "ArrayApiAdapter",
    "ArrayApiBackend",
    "AutodiffBackend",
    "AutodiffModule",
    "BF16PrecisionSettings",
    "Backend",
    "CheckpointManager",
    "ChecksumError",
    "CompactRecorder",
    "CorruptRecordError",
    "DType",
    "DefaultRecorder",
    "DoublePrecisionSettings",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FileMissingError",
    "FlaxMsgpackFileRecorder",
    "FloatDType",
    "Format",
    "FullPrecisionSettings",
    "GradientsAccumulator",
    "GradientsParams",
    "GradientsParamsRecord",
    "HalfPrecisionSettings",
    "Header",
    "Item",
    "KeepBest",
    "LossyPrecisionError",
    "LrScheduler",
    "Module",
    "NamedMpkBytesRecorder",
    "NamedMpkFileRecorder",
    "NamedMpkGzFileRecorder",
    "NativePrecisionSettings",
    "Optimizer",
    "Parts",
    "ParamId",
    "Precision",
    "Preemption",
    "PrecisionSettings",
    "Record",
    "Recorder",
    "RecorderError",
    "RecordMismatchError",
    "RestoredTraining",
    "ResumeReport",
    "RngRecord",
    "StateRecord",
    "TensorData",
    "ShardedTensor",
    "TrainingRecord",
    "UncheckedIdentityWarning",
    "UnsupportedVersionError",
    "Workload",
    "adapt",
    "check_resume",
    "first_lossy",
    "is_lossless",
    "read_file",
    "record",
    "register_adapter",
    "register_format",
    "register_neutral_form",
    "train_until",
]
