"""`TrainingRecord`: model, optimizer, scheduler, pending gradients and caller state in
one record, captured at any micro-step and restored exactly.

Data path of a save: `capture` (host copies) -> `into_item` (5-item list) -> recorder ->
bytes. A load is the same path backwards; `restore` checks every component against the
live objects before it mutates any of them.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, overload

from ..errors import CorruptRecordError, LossyPrecisionError, RecorderError, RecordMismatchError
from ..items.tree import Item, check_item
from ..precision import NativePrecisionSettings, convert_item
from .accumulator import GradientsAccumulator
from .changes import for_component, parse_changes
from .gradients import GradientsParamsRecord
from .protocols import AutodiffModule, PrecisionSettings, Recorder
from .records import RecordDeclarationError, StateRecord
from .registry import adapt_module, adapt_optimizer, adapt_scheduler

__all__ = ["TrainingRecord", "RestoredTraining"]

U = TypeVar("U")
_NATIVE = NativePrecisionSettings()
_COMPONENTS = ("model", "optimizer", "scheduler", "grads", "state")


@dataclass
class RestoredTraining(Generic[U]):
    """What `TrainingRecord.restore` returns: the caller's objects, restored (an
    immutable native model, such as an equinox module, as its restored replacement), a new
    accumulator holding the pending gradients, and the caller's state. Apply the state
    before consuming the next training batch."""

    model: Any
    optimizer: Any
    scheduler: Any
    accumulator: GradientsAccumulator[Any]
    state: U


class TrainingRecord(Generic[U]):
    """One record containing the trainable state and a caller-defined continuation record.

    Capture at a training boundary with no concurrent updates. The caller's state
    carries its counters and any available input/RNG records; this type does not infer
    them or snapshot a DataLoader. Recorder precision settings apply to all component
    records and must preserve their values for exact continuation.
    """

    RECORD_NAME = "TrainingRecord"

    def __init__(
        self,
        model: StateRecord,
        optimizer: StateRecord,
        scheduler: StateRecord | None,
        grads: GradientsParamsRecord,
        state_item: Item,
        state_type: type[U] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grads = grads
        self._state_item = state_item
        self._state_type = state_type

    # -- capture ---------------------------------------------------------------------------

    @classmethod
    def capture(
        cls, model: Any, optimizer: Any, scheduler: Any, accumulator: GradientsAccumulator[Any],
        state: U,
    ) -> TrainingRecord[U]:
        """Capture the components without consuming the model or clearing gradients."""
        m, o, s = _bind(model, optimizer, scheduler)
        _check_accumulator(accumulator)
        grads = accumulator.try_to_record()
        return cls._assemble(m, o, s, grads, state)

    @classmethod
    async def capture_async(
        cls, model: Any, optimizer: Any, scheduler: Any, accumulator: GradientsAccumulator[Any],
        state: U,
    ) -> TrainingRecord[U]:
        """Capture with asynchronous gradient readback; no recorder I/O is performed."""
        m, o, s = _bind(model, optimizer, scheduler)
        _check_accumulator(accumulator)
        grads = await accumulator.to_record_async()
        return cls._assemble(m, o, s, grads, state)

    @classmethod
    def _assemble(
        cls, m: AutodiffModule, o: Any, s: Any, grads: GradientsParamsRecord, state: U
    ) -> TrainingRecord[U]:
        if not hasattr(state, "into_item"):
            raise TypeError(
                f"state must be a Record (e.g. a @trainrec.record dataclass), got "
                f"{type(state).__name__}"
            )
        state_item = state.into_item(_NATIVE)
        return cls(
            _as_state(m.into_record()),
            _as_state(o.into_record(m)),
            None if s is None else _as_state(s.into_record()),
            grads,
            state_item,
            type(state),
        )

    # -- state -----------------------------------------------------------------------------

    @property
    def state(self) -> U:
        """The caller's state, rebuilt as its record type (the raw item tree when the
        record was loaded without `state_type`: a `TrainingRecord[Any]`)."""
        return cast(U, self._state_on(None))

    def _state_on(self, device: Any) -> Any:
        if self._state_type is None:
            return self._state_item
        try:
            return self._state_type.from_item(self._state_item, device)  # type: ignore[attr-defined]
        except (RecorderError, RecordDeclarationError):
            raise  # the file, or the state's class, is at fault: said as such
        except (TypeError, ValueError, KeyError) as e:
            raise CorruptRecordError(f"caller state does not rebuild: {e}", key="state") from e

    # -- items and recorders ---------------------------------------------------------------

    def into_item(self, settings: PrecisionSettings) -> Item:
        """The record as a 5-item list: model, optimizer, scheduler, grads, state."""
        return [
            self.model.into_item(settings),
            self.optimizer.into_item(settings),
            None if self.scheduler is None else self.scheduler.into_item(settings),
            self.grads.into_item(settings),
            convert_item(self._state_item, settings),
        ]

    @classmethod
    def from_item(
        cls, item: Item, device: Any = None, state_type: type[U] | None = None
    ) -> TrainingRecord[U]:
        """Rebuild from a 5-item list; raises `CorruptRecordError` naming the bad component."""
        _check_state_type(state_type)
        if not isinstance(item, list) or len(item) != 5:
            raise CorruptRecordError(
                "a TrainingRecord item is a list of 5: model, optimizer, scheduler, grads, state"
            )
        model_i, opt_i, sched_i, grads_i, state_i = item
        record = cls(
            StateRecord.from_item(model_i, device, key="model"),
            StateRecord.from_item(opt_i, device, key="optimizer"),
            None if sched_i is None else StateRecord.from_item(sched_i, device, key="scheduler"),
            GradientsParamsRecord.from_item(grads_i, device, key="grads"),
            check_item(state_i, "state"),
            state_type,
        )
        if state_type is not None:
            record._state_on(device)  # reject a state that does not rebuild now, not later
        return record

    def save(self, recorder: Recorder, args: Any = None, *, allow_lossy: bool = False) -> Any:
        """Save all components in one recorder payload.

        Raises `LossyPrecisionError` naming the first tensor whose value the recorder's
        precision settings would change, unless `allow_lossy=True` and it is a float (a
        changed integer is refused even then; the recorder checks
        each tensor as it converts it; a refused save leaves an existing file intact)."""
        _check_recorder(recorder, "save_item")
        item = self.into_item(_NATIVE)
        try:
            return recorder.save_item(item, args, self.RECORD_NAME, allow_lossy=allow_lossy)
        except LossyPrecisionError as e:
            raise LossyPrecisionError(e.reason, source=e.source, key=_component_path(e.key)) from None

    @overload
    @classmethod
    def load(
        cls, recorder: Recorder, args: Any, device: Any = None, *, state_type: type[U],
        **load_kw: Any,
    ) -> TrainingRecord[U]: ...

    @overload
    @classmethod
    def load(
        cls, recorder: Recorder, args: Any, device: Any = None, *, state_type: None = None,
        **load_kw: Any,
    ) -> TrainingRecord[Any]: ...

    @classmethod
    def load(
        cls, recorder: Recorder, args: Any, device: Any = None, *, state_type: type[U] | None = None,
        **load_kw: Any,
    ) -> TrainingRecord[Any]:
        """Read a combined record using the selected recorder and device."""
        _check_recorder(recorder, "read")
        _check_state_type(state_type)
        if isinstance(device, type) and callable(getattr(device, "from_item", None)):
            raise TypeError(f"{device.__name__} was given as the device: state_type is keyword-only "
                            f"(TrainingRecord.load(recorder, path, device, state_type={device.__name__}))")
        header, item = recorder.read(args, **load_kw)
        if header.record_type != cls.RECORD_NAME:
            raise RecordMismatchError(
                f"payload holds a {header.record_type}, not a TrainingRecord", source=str(args)
            )
        return cls.from_item(item, device, state_type)

    # -- restore ---------------------------------------------------------------------------

    def restore(self, model: Any, optimizer: Any, scheduler: Any, device: Any, *,
                allow_changes: Iterable[str] | None = None) -> RestoredTraining[U]:
        """Restore onto compatible model, optimizer and scheduler configurations.

        Every component is checked first (ParamIds, shapes, dtypes, optimizer kind,
        scheduler presence, and what identifies the schedule and the optimizer's
        hyperparameters); on a `RecorderError` nothing has changed. No scheduler step,
        optimizer step or gradient reset is performed. Apply the returned caller state
        before consuming the next training batch. `RestoredTraining.model` is `model`,
        restored in place, except for a native model that cannot be (an equinox module):
        then it is the new model its adapter built (the bound module's `native`).

        A schedule or hyperparameter that differs from the record's (a `T_max`, a
        `LambdaLR`'s function, a weight decay, optax's `b1`) is a `RecordMismatchError`
        naming each field and both values. `allow_changes` (e.g. `{"scheduler.T_max",
        "optimizer.weight_decay"}`) names those you changed on purpose: they keep their
        live values. `ValueError` for an entry that names no field compared; an adapter
        that compares no fields refuses a non-empty `allow_changes` with `ValueError`."""
        m, o, s = _bind(model, optimizer, scheduler)
        allow = parse_changes(allow_changes)
        o_kw = _changes_kw(o.check_record, allow, "optimizer", o)
        s_kw = {} if s is None else _changes_kw(s.check_record, allow, "scheduler", s)
        if s is None and for_component(allow, "scheduler"):
            raise ValueError("allow_changes names scheduler fields but scheduler=None was given")
        m.check_record(self.model)
        if s is None and self.scheduler is not None:
            said = ""
            try:  # what the optimizer's adapter says of it (torch: the groups' initial_lr)
                o.check_record(self.optimizer, m, **o_kw)
            except RecordMismatchError as e:
                said = f"; the optimizer does not fit either: {str(e).removesuffix(f' (key {e.key!r})')}"
            raise RecordMismatchError(
                f"the record holds the state of an LR scheduler ({self.scheduler.kind}) but "
                "scheduler=None was given: build the scheduler on the optimizer as the recorded "
                f"run did and pass it{said}", key="scheduler")
        if s is not None and self.scheduler is None:
            raise RecordMismatchError("the record holds no scheduler state but a scheduler was given",
                                      key="scheduler")
        refused: list[RecordMismatchError] = []  # the optimizer's and the scheduler's, said at once
        checks: list[Callable[[], None]] = [lambda: o.check_record(self.optimizer, m, **o_kw)]
        if s is not None:
            checks.append(lambda: s.check_record(self.scheduler, **s_kw))
        for check in checks:
            try:
                check()
            except RecordMismatchError as e:
                refused.append(e)
        if len(refused) == 1:
            raise refused[0]
        if refused:
            raise RecordMismatchError("; and ".join(str(e) for e in refused)) from refused[0]
        _check_grads(self.grads, m)
        accumulator: GradientsAccumulator[Any] = GradientsAccumulator(backend=m.backend)
        placements = getattr(m, "param_placements", None)  # optional: JAX shardings
        accumulator.load_record(self.grads, device, placements=None if placements is None else placements())
        state = self._state_on(device)
        _write_all(m, o, s, self, device, o_kw, s_kw)
        # an immutable native model (an equinox module) cannot be written into: its bound
        # module holds the restored one as `native`, which the caller gets back instead
        restored = getattr(m, "native", model) if m is not model else model
        return RestoredTraining(restored, optimizer, scheduler, accumulator, state)

    def __repr__(self) -> str:
        return (
            f"TrainingRecord(model={self.model.kind}, optimizer={self.optimizer.kind}, "
            f"scheduler={None if self.scheduler is None else self.scheduler.kind}, "
            f"pending={len(self.grads.grads)})"
        )


def _write_all(m: AutodiffModule, o: Any, s: Any, record: TrainingRecord[Any], device: Any,
               o_kw: dict[str, Any], s_kw: dict[str, Any]) -> None:
    """Load the three components; if any write fails, put back what they held before.

    Everything was checked already, so a failure here is the environment's (a device
    error, memory) or an interrupt. The live objects are backed up to the host first (a
    capture) and restored from that backup; an `Exception` then becomes a
    `RecorderError` saying "rolled back", any other `BaseException` (`KeyboardInterrupt`,
    `SystemExit`) is re-raised as it came. Only when the rollback fails too can they be
    left partly written, and the error (or a note on the interrupt) says so.

    A component with `snapshot()` and `revert(snapshot)` (JAX holders, whose state is
    immutable arrays) is backed up by those instead: no host copy, and a target that
    holds no values yet (abstract JAX arrays) can be put back as it was."""
    def load_model(r: Any) -> None:
        m.load_record(r, device)

    def load_optimizer(r: Any) -> None:
        o.load_record(r, m, device, **o_kw)

    def load_scheduler(r: Any) -> None:
        s.load_record(r, **s_kw)

    def put_back_optimizer(r: Any) -> None:
        o.load_record(r, m, device)  # its own state: nothing to allow

    def put_back_scheduler(r: Any) -> None:
        s.load_record(r)

    def backup(component: Any, capture: Callable[[], Any], load: Callable[[Any], None]) -> tuple[Any, Any]:
        """(the backup, how to put it back)"""
        snapshot, revert = getattr(component, "snapshot", None), getattr(component, "revert", None)
        if callable(snapshot) and callable(revert):
            return snapshot(), revert
        return capture(), load

    # (how to load a record into the component, its backup and how to put it back, the record)
    steps: list[tuple[Callable[[Any], None], tuple[Any, Any], Any]] = [
        (load_model, backup(m, m.into_record, load_model), record.model),
        (load_optimizer, backup(o, lambda: o.into_record(m), put_back_optimizer), record.optimizer),
    ]
    if s is not None and record.scheduler is not None:
        steps.append((load_scheduler, backup(s, s.into_record, put_back_scheduler), record.scheduler))
    done = 0
    try:
        for load, _, new in steps:
            done += 1  # a failing write may have changed its component: roll it back too
            load(new)
    except BaseException as e:  # an interrupt (Ctrl-C, SystemExit) too: never leave a mix
        try:
            for _, (saved, put_back), _ in reversed(steps[:done]):
                put_back(saved)
        except BaseException as rollback_error:
            message = (
                f"restore failed while writing ({e!r}) and so did the rollback "
                f"({rollback_error!r}): the live model, optimizer and scheduler may be "
                "partly restored"
            )
            interrupt = next((x for x in (e, rollback_error) if not isinstance(x, Exception)), None)
            if interrupt is not None:
                interrupt.add_note(message)
                raise interrupt  # noqa: B904 - the interrupt itself, its context kept
            raise RecorderError(message) from e
        if not isinstance(e, Exception):
            raise  # rolled back: the interrupt goes on as it came
        raise RecorderError(
            f"restore failed while writing into the live objects ({e!r}); they were rolled "
            "back to their previous state"
        ) from e


def _changes_kw(method: Callable[..., Any], allow: frozenset[str], component: str,
                bound: Any) -> dict[str, Any]:
    """The keyword that passes `allow`'s entries for `component` to a binding's
    `check_record` / `load_record`; none when there are none, so that an adapter whose
    methods take no `allow_changes` keeps working; `ValueError` when it takes none and
    some are given."""
    mine = for_component(allow, component)
    if not mine:
        return {}
    try:
        takes = "allow_changes" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ValueError(f"allow_changes names {component} fields ({', '.join(sorted(mine))}) but "
                         f"the {component} adapter of {bound.kind} compares none")
    return {"allow_changes": mine}


def _check_recorder(recorder: Any, method: str) -> None:
    """`TypeError` for a recorder class in place of an instance, or an object that is none."""
    if isinstance(recorder, type):
        raise TypeError(f"recorder must be a recorder instance, got the class {recorder.__name__}: "
                        f"pass {recorder.__name__}()")
    if not callable(getattr(recorder, method, None)):
        raise TypeError(f"recorder must be a trainrec recorder (e.g. NamedMpkFileRecorder()), got "
                        f"{type(recorder).__name__}, which has no {method}()")


def _check_state_type(state_type: Any) -> None:
    """`TypeError` for a `state_type` that is not a record class."""
    is_class = isinstance(state_type, type) or isinstance(typing.get_origin(state_type), type)  # or State[int]
    if state_type is not None and not (is_class and callable(getattr(state_type, "from_item", None))):
        shown = state_type.__name__ if isinstance(state_type, type) else repr(state_type)
        raise TypeError(f"state_type must be the caller state's record class (a @trainrec.record "
                        f"dataclass, or a class with a from_item classmethod), got {shown}")


def _check_accumulator(accumulator: Any) -> None:
    if not isinstance(accumulator, GradientsAccumulator):
        raise TypeError(f"accumulator must be a GradientsAccumulator (an empty one when no gradient is "
                        f"pending), got {type(accumulator).__name__}")


def _bind(model: Any, optimizer: Any, scheduler: Any) -> tuple[AutodiffModule, Any, Any]:
    for what, obj in (("model", model), ("optimizer", optimizer)):
        if obj is None:
            raise TypeError(f"the {what} is None: a TrainingRecord holds a model and an optimizer "
                            "(only the scheduler may be None)")
    return (
        adapt_module(model),
        adapt_optimizer(optimizer),
        None if scheduler is None else adapt_scheduler(scheduler),
    )


def _as_state(record: Any) -> StateRecord:
    if isinstance(record, StateRecord):
        return record
    raise TypeError(f"adapters must return StateRecord, got {type(record).__name__}")


def _check_grads(grads: GradientsParamsRecord, module: AutodiffModule) -> None:
    shapes = module.param_shapes()
    for pid, t in grads.grads.items():
        if pid not in shapes:
            raise RecordMismatchError("pending gradient for a parameter the model lacks", key=f"grads.{pid}")
        if tuple(shapes[pid]) != t.shape:
            raise RecordMismatchError(
                f"pending gradient has shape {t.shape}, parameter has {tuple(shapes[pid])}",
                key=f"grads.{pid}",
            )


def _component_path(path: str) -> str:
    head, _, rest = path.partition(".")
    if head.isdigit() and int(head) < len(_COMPONENTS):
        return f"{_COMPONENTS[int(head)]}.{rest}" if rest else _COMPONENTS[int(head)]
    return path
