"""`TorchOptimizer`: a `torch.optim` optimizer's state and param groups as a record, and
back, with the state keys each built-in optimizer must hold (`_STATE_KEYS`) checked.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from trainrec import RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import (
    Item,
    cast_problem,
    expect_kind,
    field_changes,
    kind_mismatches,
    settle,
)

from .backend import from_torch_dtype, numpy_to_tensor
from .identity import group_keys_differ, hyperparameter_fields, take_live_hyperparameters
from .module_binding import _torch_module
from .state_values import _kind, decode, encode
from .wrappers import named_parameters


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
