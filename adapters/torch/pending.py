"""Pending `.grad` and the caller's state as one trainrec payload, for tools that save
everything else themselves (Accelerate's `save_state`, Lightning's checkpoint).

`pack(model, state, counters)` snapshots every parameter's pending `.grad` (through a
`GradientsAccumulator`, as a `GradientsParamsRecord`), the caller's `@trainrec.record`
state and the tool's integer counters into a `dict` of bytes and ints that any pickle-based
checkpoint stores as it is. `unpack(payload, model, state_type)` checks all of it against
the model first and returns a `Pending` whose `apply(model)` writes `.grad`; a rejected
payload changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from trainrec import (
    GradientsAccumulator,
    GradientsParams,
    GradientsParamsRecord,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
)

from .grads import set_grads
from .rng import TorchRngRecord

__all__ = ["FORMAT", "Pending", "pack", "unpack"]

FORMAT = "trainrec.pending/1"
"""The payload's `format` entry; another value is refused."""

_RECORDER = NamedMpkBytesRecorder(NativePrecisionSettings())  # every tensor keeps its dtype


@dataclass(frozen=True)
class Pending:
    """A checked payload: pending gradients (on the host), the caller's state (or None)
    and the tool's counters."""

    grads: GradientsParamsRecord
    state: Any
    counters: dict[str, int]
    rng: TorchRngRecord | None = None

    def apply(self, model: nn.Module) -> None:
        """Write `.grad` of every parameter of `model`: the recorded gradient (cast to
        nothing: dtype and shape were checked by `unpack`) or None."""
        acc: GradientsAccumulator[nn.Module] = GradientsAccumulator()
        device = next((p.device for p in model.parameters()), "cpu")
        acc.load_record(self.grads, device)
        set_grads(model, acc.grads(), allow_empty=True)


def pack(model: nn.Module, state: Any, counters: Mapping[str, int], *,
         rng: TorchRngRecord | None = None) -> dict[str, Any]:
    """The payload of `model`'s pending `.grad` (nothing is cleared), `state` (a
    `@trainrec.record` or None), `counters` (name -> int) and `rng` (or None). Raises
    `RecorderError` when a gradient or the state cannot be recorded."""
    grads = GradientsParams()
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.register(name, p.grad)
    acc: GradientsAccumulator[nn.Module] = GradientsAccumulator()
    if not grads.is_empty():
        acc.adopt(model, grads)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "grads": _RECORDER.record(acc.try_to_record(), None),
        "state": None if state is None else _RECORDER.record(state, None),
        "rng": None if rng is None else _RECORDER.record(rng, None),
    }
    for key, value in counters.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"counter {key!r} must be an int, got {type(value).__name__}")
        payload[key] = value
    return payload


def unpack(payload: Any, model: nn.Module, state_type: type[Any] | None,
           counters: tuple[str, ...], *, source: str, rng: bool = False) -> Pending:
    """Check `payload` (from `pack`) against `model` and `state_type` and return it.

    Raises `RecordMismatchError` naming `source` and every mismatch: another format,
    missing counters, a gradient for a ParamId the model lacks or of another shape or dtype,
    a state where none is expected or the reverse, no RNG states when `rng`;
    `RecorderError` for a corrupt payload."""
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, Mapping) else type(payload).__name__
        raise RecordMismatchError(f"{source} is not a trainrec pending-gradients payload "
                                  f"(format {got!r}, expected {FORMAT!r})")
    missing = [k for k in ("grads", "state", "rng", *counters) if k not in payload]
    if missing:
        raise RecordMismatchError(f"{source} lacks {missing}: it was saved by another version "
                                  "or edited")
    bad = [k for k in counters if not isinstance(payload[k], int) or isinstance(payload[k], bool)]
    if bad:
        raise RecordMismatchError(f"{source}: counters {bad} are not ints")
    if not isinstance(payload["grads"], (bytes, bytearray)):
        raise RecordMismatchError(f"{source}: 'grads' must be bytes, got "
                                  f"{type(payload['grads']).__name__}")
    try:
        grads = _RECORDER.load(bytes(payload["grads"]), None, GradientsParamsRecord)
    except RecorderError as e:
        raise type(e)(f"{source}: pending gradients: {e}") from e
    problems = _mismatches(grads, model)
    if problems:
        raise RecordMismatchError(f"{source}: the pending gradients do not fit the model: "
                                  + "; ".join(problems))
    state = _optional(payload, "state", state_type, source)
    rng_record = _optional(payload, "rng", TorchRngRecord if rng else None, source)
    return Pending(grads, state, {k: int(payload[k]) for k in counters}, rng_record)


def _optional(payload: Mapping[str, Any], key: str, record_type: type[Any] | None,
              source: str) -> Any:
    """The record under `key`, which must be there exactly when `record_type` is given."""
    saved = payload[key]
    if (saved is None) != (record_type is None):
        raise RecordMismatchError(
            f"{source}: " + (f"it holds no {key} but one is expected" if saved is None
                             else f"it holds a {key} but none is expected (was it written "
                                  f"with another {key} setting?)")
        )
    if record_type is None:
        return None
    if not isinstance(saved, (bytes, bytearray)):
        raise RecordMismatchError(f"{source}: {key!r} must be bytes, got {type(saved).__name__}")
    try:
        return _RECORDER.load(bytes(saved), None, record_type)
    except RecorderError as e:
        raise type(e)(f"{source}: {key}: {e}") from e


def _mismatches(grads: GradientsParamsRecord, model: nn.Module) -> list[str]:
    params = dict(model.named_parameters())
    out = []
    for pid, t in grads.grads.items():
        p = params.get(pid)
        if p is None:
            out.append(f"{pid!r} is not a parameter of the model (it has "
                       f"{list(params)[:3]}{'...' if len(params) > 3 else ''})")
            continue
        if tuple(t.shape) != tuple(p.shape):
            out.append(f"{pid!r} has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}")
        dtype = str(p.dtype).removeprefix("torch.")
        if _DTYPE_NAMES.get(t.dtype.value) != dtype:
            out.append(f"{pid!r} has dtype {t.dtype.value}, the parameter {dtype}")
    return out


_DTYPE_NAMES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}
