"""Bindings of native torch objects to trainrec's protocols, and the adapter that finds them.

- `TorchModule(nn.Module)`: ParamIds from `named_parameters()` of the model inside any
  `torch.compile` / DDP / DataParallel wrappers (`wrappers.py`); the record is the whole
  `state_dict` (persistent buffers too), tied tensors stored once, plus every parameter's
  `.grad` that is not None (gradients accumulated natively with repeated `backward()`
  are pending gradients too); restore copies in place under `no_grad`, so optimizers
  keep pointing at the live parameters, and sets `.grad` to the recorded value or None.
- `TorchOptimizer(Optimizer)`: `state_dict` re-keyed from position to ParamId, with every
  param-group hyperparameter.
- `TorchLrScheduler(LRScheduler | ReduceLROnPlateau)`: `state_dict`. Functions (the
  lambdas of LambdaLR) are code, not data: torch records them as None and they come from
  the caller's program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from trainrec import RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import (
    Change,
    Item,
    cast_problem,
    check_tensor_map,
    expect_kind,
    field_changes,
    join_key,
    kind_mismatches,
    settle,
    unchecked,
)

from .backend import TorchBackend, from_torch_dtype, numpy_to_tensor
from .identity import (
    IDENTITY_KEY,
    flatten,
    group_keys_differ,
    hyperparameter_fields,
    identity_of,
    scheduler_fields,
    take_live_hyperparameters,
)
from .wrappers import named_parameters, named_state, refuse_dtensors

__all__ = ["TorchModule", "TorchOptimizer", "TorchLrScheduler", "TorchAdapter", "ADAPTER",
           "encode", "decode"]

_BACKEND = TorchBackend()
_PAIRS = "__pairs__"


# -- plain Python values of state_dicts <-> items -----------------------------------------


def encode(value: Any, key: str = "") -> Item:
    """A state_dict value as an item: tensors become host copies, tuples lists, dicts with
    non-str keys (MultiStepLR's Counter) `{"__pairs__": [[k, v], ...]}`."""
    if isinstance(value, torch.Tensor):
        return TensorData.from_array(_BACKEND.to_host(value), copy=False)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v, join_key(key, i)) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, join_key(key, k)) for k, v in value.items()}
        return {_PAIRS: [[encode(k, key), encode(v, join_key(key, str(k)))] for k, v in value.items()]}
    raise TypeError(
        f"state value {type(value).__qualname__} at {key or 'root'!r} is not data trainrec can "
        "record (tensors, numbers, str, bytes, None, lists, tuples, dicts)"
    )


def decode(item: Item, like: Any = None) -> Any:
    """The inverse of `encode`; `like` (the live value, when known) restores tuples and
    dict subclasses such as `Counter`. Tensors come back as CPU tensors."""
    if isinstance(item, TensorData):
        return numpy_to_tensor(item.array)
    if isinstance(item, list):
        template = list(like) if isinstance(like, (list, tuple)) and len(like) == len(item) else [None] * len(item)
        out = [decode(v, t) for v, t in zip(item, template)]
        return tuple(out) if isinstance(like, tuple) else out
    if isinstance(item, dict):
        raw_pairs = item.get(_PAIRS)
        if set(item) == {_PAIRS} and isinstance(raw_pairs, list):
            pairs = [(decode(p[0]), p[1]) for p in raw_pairs if isinstance(p, list) and len(p) == 2]
            d: dict[Any, Any] = {k: decode(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in pairs}
        else:
            d = {k: decode(v, like.get(k) if isinstance(like, Mapping) else None) for k, v in item.items()}
        if isinstance(like, dict) and type(like) is not dict:
            return type(like)(d)
        return d
    return item


# -- module -------------------------------------------------------------------------------


class TorchModule:
    """A native `nn.Module` as an `AutodiffModule`."""

    kind = "torch.nn.Module"

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected torch.nn.Module, got {type(module).__name__}")
        self.module = module

    @property
    def backend(self) -> TorchBackend:
        return _BACKEND

    def param_ids(self) -> list[str]:
        return [name for name, _ in named_parameters(self.module)]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in named_parameters(self.module)}

    def _live(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Unique state tensors by name, and aliases (tied names) -> the name kept.
        `RecorderError` for sharded (DTensor) state."""
        unique: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[int, str] = {}
        state = named_state(self.module)
        refuse_dtensors(state, "state tensor")
        for name, t in state:
            if id(t) in seen:
                aliases[name] = seen[id(t)]
            else:
                seen[id(t)] = name
                unique[name] = t
        return unique, aliases

    def into_record(self) -> StateRecord:
        unique, aliases = self._live()
        tensors: dict[str, Item] = {
            k: TensorData.from_array(_BACKEND.to_host(v), copy=False) for k, v in unique.items()
        }
        aliases_item: dict[str, Item] = dict(aliases)
        params = named_parameters(self.module)
        refuse_dtensors([(n, p.grad) for n, p in params], "the gradient of")
        grads: dict[str, Item] = {
            name: TensorData.from_array(_BACKEND.to_host(p.grad), copy=False)
            for name, p in params
            if p.grad is not None
        }
        return StateRecord(self.kind, {"tensors": tensors, "aliases": aliases_item, "grads": grads})

    def _checked(
        self, record: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, TensorData], dict[str, TensorData]]:
        item = expect_kind(record, self.kind, "model")
        if not isinstance(item, dict) or set(item) != {"tensors", "aliases", "grads"}:
            raise RecordMismatchError(
                "torch module record must be {tensors, aliases, grads}", key="model"
            )
        unique, aliases = self._live()
        if item["aliases"] != aliases:
            raise RecordMismatchError(
                f"tied parameters differ: record {item['aliases']!r}, live {aliases}", key="model.aliases"
            )
        expected = {k: (tuple(v.shape), from_torch_dtype(v.dtype)) for k, v in unique.items()}
        params = {k: (tuple(p.shape), from_torch_dtype(p.dtype)) for k, p in named_parameters(self.module)}
        return (
            unique,
            check_tensor_map(item["tensors"], expected, "model"),
            check_tensor_map(item["grads"], params, "model.grads", allow_subset=True),
        )

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any, device: Any) -> None:
        live, tensors, grads = self._checked(record)
        staged = {k: numpy_to_tensor(t.array).to(live[k].dtype) for k, t in tensors.items()}
        params = dict(named_parameters(self.module))
        staged_grads = {
            k: numpy_to_tensor(t.array).to(device=params[k].device, dtype=params[k].dtype)
            for k, t in grads.items()
        }
        with torch.no_grad():
            for k, v in staged.items():
                live[k].copy_(v)
        for k, p in params.items():
            p.grad = staged_grads.get(k)


# -- optimizer ----------------------------------------------------------------------------


def _kind(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class TorchOptimizer:
    """A native `torch.optim.Optimizer` as an `Optimizer`, keyed by ParamId."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @property
    def kind(self) -> str:
        return _kind(self.optimizer)

    def _ids(self, module: Any) -> list[list[str]]:
        """ParamIds of every param group, in the optimizer's own order."""
        names = {id(p): n for n, p in named_parameters(_torch_module(module))}
        groups = []
        for gi, group in enumerate(self.optimizer.param_groups):
            ids = []
            for p in group["params"]:
                if id(p) not in names:
                    raise TypeError(
                        f"param group {gi} of the optimizer holds a parameter that is not in "
                        "the model: build the optimizer from model.parameters()"
                    )
                ids.append(names[id(p)])
            groups.append(ids)
        return groups

    def into_record(self, module: Any) -> StateRecord:
        sd = self.optimizer.state_dict()
        groups = self._ids(module)
        flat = [pid for ids in groups for pid in ids]
        state: dict[str, Item] = {flat[i]: encode(s, flat[i]) for i, s in sd["state"].items()}
        group_items: list[Item] = []
        for ids, g in zip(groups, sd["param_groups"]):
            hyper = {k: encode(v, k) for k, v in g.items() if k != "params"}
            hyper["params"] = list(ids)
            group_items.append(hyper)
        return StateRecord(self.kind, {"state": state, "param_groups": group_items})

    def _checked(self, record: Any, module: Any,
                 allow: frozenset[str] = frozenset()) -> tuple[dict[str, Any], frozenset[str]]:
        """(the record's item, the hyperparameters allowed to differ, by path: the load
        keeps their live values)."""
        item = expect_kind(record, self.kind, "optimizer")
        if not isinstance(item, dict) or set(item) != {"state", "param_groups"}:
            raise RecordMismatchError("optimizer record must be {state, param_groups}", key="optimizer")
        groups, state = item["param_groups"], item["state"]
        live_groups = self._ids(module)
        recorded_fields: dict[str, Item] = {}
        live_fields: dict[str, Item] = {}
        if not isinstance(groups, list) or len(groups) != len(live_groups):
            raise RecordMismatchError(
                f"record has {len(groups) if isinstance(groups, list) else '?'} param groups, "
                f"the live optimizer {len(live_groups)}", key="optimizer.param_groups")
        for gi, (g, ids) in enumerate(zip(groups, live_groups)):
            if not isinstance(g, dict) or not isinstance(g.get("params"), list):
                raise RecordMismatchError("malformed param group", key=f"optimizer.param_groups.{gi}")
            if sorted(map(str, g["params"])) != sorted(ids):  # type: ignore[arg-type]
                raise RecordMismatchError(
                    f"param group {gi} holds {g['params']!r} in the record, {ids} live",
                    key=f"optimizer.param_groups.{gi}")
            live_g = self.optimizer.param_groups[gi]
            live_keys = set(live_g) - {"params"}
            if set(g) - {"params"} != live_keys:
                raise RecordMismatchError(group_keys_differ(set(g) - {"params"}, live_keys),
                                          key=f"optimizer.param_groups.{gi}")
            live_item = {k: encode(live_g[k], k) for k in sorted(live_keys)}
            problems = [p for k in sorted(live_keys) for p in kind_mismatches(g[k], live_item[k], k)]
            if problems:
                raise RecordMismatchError(
                    "; ".join(problems), key=f"optimizer.param_groups.{gi}")
            at = f"optimizer.param_groups.{gi}"
            recorded_fields.update(hyperparameter_fields({k: v for k, v in g.items() if k != "params"}, at))
            live_fields.update(hyperparameter_fields(live_item, at))
        if not isinstance(state, dict):
            raise RecordMismatchError("optimizer state must be a map", key="optimizer.state")
        params = dict(named_parameters(_torch_module(module)))
        group_of = {str(pid): g for g in groups  # each a dict with a params list: checked above
                    for pid in cast(dict[str, list[Item]], g)["params"]}
        expected_keys = _STATE_KEYS.get(type(self.optimizer))
        for pid, entry in state.items():
            where = f"optimizer.state.{pid}"
            if pid not in params:
                raise RecordMismatchError("state for a parameter the model lacks", key=where)
            if pid not in group_of:
                raise RecordMismatchError("state for a parameter the optimizer does not update", key=where)
            if not isinstance(entry, dict):
                raise RecordMismatchError("per-parameter state must be a map", key=where)
            p = params[pid]
            if expected_keys is not None:
                keys = expected_keys(group_of[pid])
                problems = _builtin_state_mismatches(entry, keys, p)
            else:
                keys, problems = None, _state_mismatches(entry, self.optimizer.state.get(p), p)
            if not problems:
                problems = _cast_problems(entry, keys, p)
            if problems:
                raise RecordMismatchError("; ".join(problems), key=where)
        accepted = settle(field_changes(recorded_fields, live_fields),
                          set(recorded_fields) | set(live_fields), allow,
                          f"the hyperparameters of the live {self.kind}",
                          "Build the optimizer with the recorded run's hyperparameters.")
        return item, accepted

    def check_record(self, record: Any, module: Any, *,
                     allow_changes: frozenset[str] = frozenset()) -> None:
        self._checked(record, module, allow_changes)

    def load_record(self, record: Any, module: Any, device: Any, *,
                    allow_changes: frozenset[str] = frozenset()) -> None:
        item, accepted = self._checked(record, module, allow_changes)
        live_groups = self._ids(module)
        index = {pid: i for i, pid in enumerate(pid for ids in live_groups for pid in ids)}
        live_sd = self.optimizer.state_dict()
        groups = []
        for gi, (g, live_g) in enumerate(zip(item["param_groups"], live_sd["param_groups"])):
            hyper = {k: decode(v, live_g.get(k)) for k, v in g.items() if k != "params"}
            take_live_hyperparameters(hyper, live_g, accepted, f"optimizer.param_groups.{gi}")
            hyper["params"] = list(live_g["params"])
            groups.append(hyper)
        state = {index[pid]: decode(entry) for pid, entry in item["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self._recorded_scalars(item["state"], module)

    def _recorded_scalars(self, state: dict[str, Any], module: Any) -> None:
        """Put back, in its recorded dtype, each 0-d state tensor a torch optimizer makes
        in its own scalar dtype whatever the parameter's (NAdam's `mu_product`, ASGD's
        `eta` and `mu`), which `load_state_dict` casts to the parameter's dtype: f32 into
        a bf16 parameter's state would round, where the run that never stopped keeps f32."""
        expected_keys = _STATE_KEYS.get(type(self.optimizer))
        if expected_keys is None:
            return
        params = dict(named_parameters(_torch_module(module)))
        for pid, entry in state.items():
            live = self.optimizer.state.get(params[pid], {})
            for name, v in entry.items():
                t = live.get(name)
                if (name != "step" and isinstance(v, TensorData) and isinstance(t, torch.Tensor)
                        and v.shape == () and from_torch_dtype(t.dtype) is not v.dtype):
                    live[name] = numpy_to_tensor(v.array).to(t.device)


# Per-parameter state that torch's own optimizers create, from their group's
# hyperparameters: key -> "param" (a tensor of the parameter's shape and dtype kind),
# "scalar" (a 0-d float tensor; `step` may also be a number, which torch converts) or
# "none" (None or absent: SGD without momentum, which torch < 2.1 recorded as None). An
# entry holds exactly these keys, or none before the first step. Only these classes,
# exactly: a subclass may keep more state.
_StateKeys = dict[str, str]


def _adam_keys(g: Any) -> _StateKeys:
    keys = {"step": "scalar", "exp_avg": "param", "exp_avg_sq": "param"}
    return {**keys, "max_exp_avg_sq": "param"} if g.get("amsgrad") else keys


def _rmsprop_keys(g: Any) -> _StateKeys:
    keys = {"step": "scalar", "square_avg": "param"}
    if g.get("momentum"):
        keys["momentum_buffer"] = "param"
    if g.get("centered"):
        keys["grad_avg"] = "param"
    return keys


_optim = torch.optim
_STATE_KEYS: dict[type, Any] = {
    _optim.SGD: lambda g: {"momentum_buffer": "param" if g.get("momentum") else "none"},
    _optim.Adam: _adam_keys,
    _optim.AdamW: _adam_keys,
    _optim.Adamax: lambda g: {"step": "scalar", "exp_avg": "param", "exp_inf": "param"},
    _optim.NAdam: lambda g: {"step": "scalar", "mu_product": "scalar", "exp_avg": "param",
                             "exp_avg_sq": "param"},
    _optim.RAdam: lambda g: {"step": "scalar", "exp_avg": "param", "exp_avg_sq": "param"},
    _optim.Adagrad: lambda g: {"step": "scalar", "sum": "param"},
    _optim.Adadelta: lambda g: {"step": "scalar", "square_avg": "param", "acc_delta": "param"},
    _optim.RMSprop: _rmsprop_keys,
    _optim.Rprop: lambda g: {"step": "scalar", "prev": "param", "step_size": "param"},
    _optim.ASGD: lambda g: {"step": "scalar", "eta": "scalar", "mu": "scalar", "ax": "param"},
}


def _builtin_state_mismatches(entry: dict[str, Any], keys: _StateKeys, p: torch.Tensor) -> list[str]:
    required = {k for k, kind in keys.items() if kind != "none"}
    if entry and not required <= set(entry) <= set(keys):
        return [f"state keys {sorted(entry)} in the record, the optimizer keeps {sorted(required)}"]
    shape, kind = tuple(p.shape), from_torch_dtype(p.dtype)
    problems = []
    for name, v in entry.items():
        if keys[name] == "none":
            if v is not None:
                problems.append(f"{name}: {type(v).__name__} in the record, None expected")
        elif keys[name] == "param":
            if not isinstance(v, TensorData):
                problems.append(f"{name}: {type(v).__name__} in the record, a tensor of shape {shape} expected")
            elif v.shape != shape:
                problems.append(f"{name}: shape {v.shape} in the record, the parameter's {shape} expected")
            elif (v.dtype.is_float, v.dtype.is_int) != (kind.is_float, kind.is_int):
                problems.append(f"{name}: dtype {v.dtype.value} in the record, parameter is {kind.value}")
        elif isinstance(v, TensorData):
            if v.shape != () or not v.dtype.is_float:
                problems.append(f"{name}: a {v.dtype.value} tensor of shape {v.shape} in the record, "
                                "a 0-d float tensor expected")
        elif name != "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            problems.append(f"{name}: {type(v).__name__} {v!r:.40} in the record, a 0-d float tensor expected")
    return problems


def _cast_problems(entry: dict[str, Any], keys: _StateKeys | None, p: torch.Tensor) -> list[str]:
    """What torch's `load_state_dict` would change in `entry`: it casts every state tensor
    but `step` to a floating parameter's dtype. A 0-d scalar a built-in optimizer keeps in
    its own dtype (`keys` says which) is put back as recorded instead (`_recorded_scalars`)."""
    if not p.is_floating_point():
        return []
    dtype = from_torch_dtype(p.dtype)
    why = "the parameter's dtype (torch's load_state_dict casts optimizer state to it)"
    return [problem for name, v in entry.items()
            if name != "step" and isinstance(v, TensorData) and not (keys and keys.get(name) == "scalar")
            for problem in [cast_problem(name, v, dtype, why)] if problem is not None]


def _state_mismatches(entry: dict[str, Any], live: Any, p: torch.Tensor) -> list[str]:
    """Any other optimizer: like its live state for the parameter, when it has one;
    otherwise a tensor of the parameter's rank must have its shape (`exp_avg`,
    `momentum_buffer`; others, such as 0-d `step` or factored moments, pass)."""
    if live:
        return kind_mismatches(entry, encode(live), "")
    return [
        f"{name}: shape {v.shape} in the record, parameter has {tuple(p.shape)}"
        for name, v in entry.items()
        if isinstance(v, TensorData) and len(v.shape) == p.ndim > 0 and v.shape != tuple(p.shape)
    ]


# -- scheduler ----------------------------------------------------------------------------


class TorchLrScheduler:
    """A native torch LR scheduler as an `LrScheduler`. `step()` steps it and returns the
    first group's new learning rate (ReduceLROnPlateau needs its metric: call its own
    `step(metric)`).

    The record is the `state_dict` and, under `#identity`, what identifies the schedule
    beyond it (`identity.py`: the children's classes, the functions by name, a
    `functools.partial`'s keywords). A restore compares the schedule's constructor
    arguments and that identity with the live scheduler's and refuses any difference
    (`RecordMismatchError` naming each field with both values) unless `allow_changes`
    names it; an allowed field keeps its live value. A record without `#identity`
    (written before it was kept) loads with its functions and children's classes
    unchecked, and an `UncheckedIdentityWarning` naming them."""

    def __init__(self, scheduler: Any) -> None:
        if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "load_state_dict"):
            raise TypeError(f"{type(scheduler).__name__} is not a torch LR scheduler")
        self.scheduler = scheduler

    @property
    def kind(self) -> str:
        return _kind(self.scheduler)

    def step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    def into_record(self) -> StateRecord:
        item = encode(self.scheduler.state_dict())
        if not isinstance(item, dict) or IDENTITY_KEY in item:
            raise TypeError(f"the state dict of {self.kind} is not a map of str keys without "
                            f"{IDENTITY_KEY!r}")
        item[IDENTITY_KEY] = identity_of(self.scheduler)
        return StateRecord(self.kind, item)

    def _checked(self, record: Any, allow: frozenset[str],
                 warn: bool = True) -> tuple[dict[str, Any], dict[str, Any], frozenset[str]]:
        """(the record's state dict item, the live state dict, the fields allowed to
        differ, whose live values the load keeps)."""
        item = expect_kind(record, self.kind, "scheduler")
        state, live, changes, fields, unknown = self.compare(item)
        if unknown and warn:
            unchecked(sorted({".".join(p.split(".")[:2]) for p in unknown}), allow, f"the {self.kind} schedule")
        accepted = settle(changes, fields | unknown, allow, f"the fields of the live {self.kind} schedule",
                          "Build the scheduler as the recorded run did.")
        return state, live, accepted

    def compare(self, item: Item, path: str = "scheduler") -> tuple[
            dict[str, Any], dict[str, Any], list[Change], set[str], set[str]]:
        """A scheduler record's item against the live scheduler: (its state dict item, the
        live state dict, the fields that differ, every field compared, the fields only an
        identity would say and the item has none: an older record's). `RecordMismatchError`
        for a state dict of other keys (another class) or a malformed identity."""
        live = self.scheduler.state_dict()
        identity = item.get(IDENTITY_KEY) if isinstance(item, dict) else None
        state = {k: v for k, v in item.items() if k != IDENTITY_KEY} if isinstance(item, dict) else item
        if not isinstance(state, dict) or set(state) != set(live):
            raise RecordMismatchError(
                f"scheduler state keys differ: record {sorted(state) if isinstance(state, dict) else state!r}, "
                f"live {sorted(live)}", key=path)
        children = getattr(self.scheduler, "_schedulers", None)
        live_children = [type(c) for c in children] if isinstance(children, (list, tuple)) else None
        self._check_children(state, live)
        live_identity = identity_of(self.scheduler)
        recorded_fields = scheduler_fields(state, type(self.scheduler), live_children, path)
        live_fields = scheduler_fields(encode(live), type(self.scheduler), live_children, path)
        unknown: set[str] = set()
        if isinstance(identity, dict):
            recorded_fields.update(flatten(identity, path))
            live_fields.update(flatten(live_identity, path))
        elif identity is not None:
            raise RecordMismatchError(f"{IDENTITY_KEY} must be a map, got {type(identity).__name__}",
                                      key=f"{path}.{IDENTITY_KEY}")
        else:  # an older record: what only the identity says goes unchecked
            unknown = {p for p in flatten(live_identity, path) if p != f"{path}.class"}
        return (state, live, field_changes(recorded_fields, live_fields),
                set(recorded_fields) | set(live_fields), unknown)

    @staticmethod
    def _check_children(state: dict[str, Any], live: dict[str, Any]) -> None:
        recorded, live_children = state.get("_schedulers"), live.get("_schedulers")
        if not isinstance(live_children, list):
            return
        if not isinstance(recorded, list) or len(recorded) != len(live_children):
            raise RecordMismatchError(
                f"the record holds {len(recorded) if isinstance(recorded, list) else 'no'} "
                f"child schedulers, the live scheduler {len(live_children)}", key="scheduler._schedulers")
        for i, (r, c) in enumerate(zip(recorded, live_children)):
            if not isinstance(r, dict) or not isinstance(c, dict) or set(r) != set(c):
                raise RecordMismatchError(
                    f"child scheduler {i}'s state keys differ: record "
                    f"{sorted(r) if isinstance(r, dict) else r!r}, live "
                    f"{sorted(c) if isinstance(c, dict) else c!r} (another class?)",
                    key=f"scheduler._schedulers.{i}")

    def check_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        self._checked(record, allow_changes)

    def load_record(self, record: Any, *, allow_changes: frozenset[str] = frozenset()) -> None:
        state, live, accepted = self._checked(record, allow_changes, warn=False)
        decoded = decode(state, live)
        for path in accepted:
            take_live(decoded, live, path.split(".")[1:])
        self.scheduler.load_state_dict(decoded)


def take_live(decoded: Any, live: Any, at: list[str]) -> None:
    """Put the live value of the state-dict field at `at` into `decoded` (a field only the
    identity has, such as a function's name, is left: functions are never loaded)."""
    for i, key in enumerate(at):
        last = i == len(at) - 1 or at[i + 1] == "attributes"
        if isinstance(decoded, dict) and isinstance(live, dict) and key in decoded and key in live:
            if last:
                decoded[key] = live[key]
                return
            decoded, live = decoded[key], live[key]
        elif isinstance(decoded, list) and isinstance(live, list) and key.isdigit() \
                and int(key) < min(len(decoded), len(live)):
            if last:
                decoded[int(key)] = live[int(key)]
                return
            decoded, live = decoded[int(key)], live[int(key)]
        else:
            return


def _torch_module(module: Any) -> nn.Module:
    if isinstance(module, TorchModule):
        return module.module
    if isinstance(module, nn.Module):
        return module
    raise TypeError(f"the torch optimizer binding needs a torch model, got {type(module).__name__}")


def _is_scheduler(obj: Any) -> bool:
    sched = torch.optim.lr_scheduler
    return isinstance(obj, (sched.LRScheduler, sched.ReduceLROnPlateau))


class TorchAdapter:
    """Finds the binding for torch objects: modules, optimizers, LR schedulers, and the
    backend for tensors, tensor types and devices."""

    name = "torch"

    def adapt(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return TorchModule(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return TorchOptimizer(obj)
        if _is_scheduler(obj):
            return TorchLrScheduler(obj)
        if isinstance(obj, (torch.Tensor, torch.device)):
            return _BACKEND
        if isinstance(obj, type) and issubclass(obj, torch.Tensor):
            return _BACKEND
        return None


ADAPTER = TorchAdapter()

