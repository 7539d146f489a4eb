"""trainrec: exact, portable training checkpoints.

A checkpoint taken at any micro-step, even inside a gradient-accumulation window,
restores model, optimizer, LR scheduler, pending accumulated gradients and the caller's
own counters and RNG, so the resumed run is bitwise identical to one that never stopped.

Importing trainrec imports no framework; adapters live in `trainrec.adapters.*`.
"""

from ._version import __version__
from .accumulator import GradientsAccumulator
from .array_api import ArrayApiAdapter, ArrayApiBackend
from .changes import UncheckedIdentityWarning
from .check import ResumeReport, check_resume
from .convert import register_neutral_form
from .dtypes import DType, FloatDType
from .errors import (
    ChecksumError,
    CorruptRecordError,
    FileMissingError,
    LossyPrecisionError,
    RecorderError,
    RecordMismatchError,
    UnsupportedVersionError,
)
from .flaxmsgpack import FlaxMsgpackFileRecorder
from .format import FORMAT_NAME, FORMAT_VERSION, Header
from .formats import Format, register_format
from .gradients import GradientsParams, GradientsParamsRecord
from .items import Item
from .manager import CheckpointManager, KeepBest, Preemption
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
from .recorders import (
    CompactRecorder,
    DefaultRecorder,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    read_file,
)
from .records import RngRecord, StateRecord, record
from .registry import Adapter, adapt, register_adapter
from .tensor import ShardedTensor, TensorData
from .training import RestoredTraining, TrainingRecord
from .workload import Parts, Workload, train_until

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
