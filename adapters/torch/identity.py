"""What identifies a torch LR schedule and an optimizer's hyperparameters, as fields a
restore compares (`trainrec.adapter_kit.settle`).

A scheduler's fields are its constructor's arguments as its `state_dict` holds them
(`_ARGS`: `CosineAnnealingLR`'s `T_max`, `eta_min`, `base_lrs`; a subclass those of its
nearest torch ancestor), a `SequentialLR`'s or `ChainedScheduler`'s children's (at any depth), and
what the state dict lacks, which the record keeps under `#identity` (`identity_of`): the
class of each child and the functions (`LambdaLR` / `MultiplicativeLR`'s `lr_lambdas`, a
`CyclicLR`'s `scale_fn`) by qualified name; a `functools.partial` (the HF schedule
factories) by its function's name, arguments and keywords; a lambda or a function
defined inside another also by the literals of its code and the numbers and strings it
closes over (`lambda s: 0.9 ** s` is not `lambda s: 0.5 ** s`). What moves as the run
goes on (`last_epoch`, `_step_count`, `_last_lr`, `T_cur`, `best`...) is the position,
not compared.

An optimizer's fields are each param group's hyperparameters but `lr` (the schedule's
position, whoever drives it), `initial_lr` (the scheduler's) and the implementation flags
(`foreach`, `fused`, `capturable`, `differentiable`), which change no value; a momentum
(or `betas[0]`) that a `OneCycleLR` / `CyclicLR` cycles (its group holds
`max_momentum`) is the position too.
"""

from __future__ import annotations

import bisect
import functools
import types
from typing import Any

from torch.optim import lr_scheduler as _sched

from trainrec.adapter_kit import Item

__all__ = ["IDENTITY_KEY", "identity_of", "scheduler_fields", "hyperparameter_fields",
           "NOT_HYPERPARAMETERS", "base_lrs_refusal", "base_lrs_refusals"]

IDENTITY_KEY = "#identity"

# constructor arguments as the state dict holds them, per torch scheduler class; a key
# absent from a state dict (another torch version) is left out
_ARGS: dict[type, tuple[str, ...]] = {
    _sched.LambdaLR: ("base_lrs",),
    _sched.MultiplicativeLR: ("base_lrs",),
    _sched.StepLR: ("step_size", "gamma", "base_lrs"),
    _sched.MultiStepLR: ("milestones", "gamma", "base_lrs"),
    _sched.ConstantLR: ("factor", "total_iters", "base_lrs"),
    _sched.LinearLR: ("start_factor", "end_factor", "total_iters", "base_lrs"),
    _sched.ExponentialLR: ("gamma", "base_lrs"),
    _sched.PolynomialLR: ("total_iters", "power", "base_lrs"),
    _sched.CosineAnnealingLR: ("T_max", "eta_min", "base_lrs"),
    _sched.CosineAnnealingWarmRestarts: ("T_0", "T_mult", "eta_min", "base_lrs"),
    _sched.CyclicLR: ("max_lrs", "total_size", "step_ratio", "mode", "gamma", "scale_mode",
                      "cycle_momentum", "use_beta1", "base_momentums", "max_momentums",
                      "base_lrs"),
    _sched.OneCycleLR: ("total_steps", "_schedule_phases", "_anneal_func_type", "anneal_func",
                        "cycle_momentum", "use_beta1", "base_lrs"),
    _sched.ReduceLROnPlateau: ("mode", "factor", "patience", "threshold", "threshold_mode",
                               "cooldown", "min_lrs", "default_min_lr", "eps"),
    _sched.SequentialLR: ("_milestones",),
    _sched.ChainedScheduler: (),
}
_FUNCTIONS = ("lr_lambdas", "_scale_fn_custom")  # state-dict keys holding functions
_CHILDREN = "_schedulers"
_ENTRIES = 64  # literals of a function kept, at most

NOT_HYPERPARAMETERS = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable",
                                 "differentiable"})


# schedulers whose next lr is computed from the last one (a param group's `lr`: the recorded
# position) or, OneCycleLR, from the param groups' `initial_lr` and `max_lr`, not from
# `base_lrs` (CosineAnnealingLR reads it at a restart only): a new base lr kept live would
# not take effect. LambdaLR, CyclicLR and CosineAnnealingWarmRestarts compute each lr from it.
_FROM_THE_LAST = (_sched.MultiplicativeLR, _sched.StepLR, _sched.MultiStepLR, _sched.ConstantLR,
                  _sched.LinearLR, _sched.ExponentialLR, _sched.PolynomialLR,
                  _sched.CosineAnnealingLR, _sched.OneCycleLR)


def base_lrs_refusal(cls: type, path: str = "scheduler") -> str:
    """Why a scheduler of class `cls` that the next steps continue cannot keep a live
    `base_lrs` other than the record's ("" when it can: its torch class computes each lr
    from them). A `get_lr` of your own is refused: trainrec cannot tell what it reads."""
    own = _own_get_lr(cls)
    fix = ("build the optimizer with the recorded lr and, to change the learning rate from here, "
           "scale each param group's 'lr' and 'initial_lr'{also} and " + path + ".base_lrs yourself "
           "after the restore")
    if own is not None:
        return (f"{own.__name__} computes each learning rate with a get_lr of its own, and trainrec "
                "cannot tell whether it reads base_lrs or the last lr (the recorded position); "
                + fix.format(also=""))
    for base in cls.__mro__:
        if base in _ARGS:
            if base not in _FROM_THE_LAST:
                return ""
            also = " and its 'max_lr' and 'min_lr'" if base is _sched.OneCycleLR else ""
            return (f"a {base.__name__} computes each learning rate from the last one (the recorded "
                    "position), not from base_lrs, so a new base lr would be kept yet not take effect; "
                    + fix.format(also=also))
    return ""


def args_of(cls: type) -> tuple[str, ...]:
    """The constructor arguments a scheduler of class `cls` holds in its state dict: its
    own torch class's, or its nearest torch ancestor's (a class of your own: `base_lrs`)."""
    for base in cls.__mro__:
        if base in _ARGS:
            return _ARGS[base]
    return ("base_lrs",)


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


def _value(v: Any, depth: int) -> Item:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and len(v) <= _ENTRIES and depth > 0:
        return [_value(x, depth - 1) for x in v]
    if callable(v) and depth > 0:
        return function_identity(v, depth - 1)
    return {"type": _name(type(v))}


def function_identity(fn: Any, depth: int = 3) -> dict[str, Item]:
    """A function as data: `{"fn": NAME}`, with a partial's `args` and `keywords`, and a
    lambda's or nested function's literals (`consts`) and closed-over values (`closure`)."""
    if isinstance(fn, functools.partial):
        return {"fn": _name(fn.func), "args": [_value(a, depth) for a in fn.args],
                "keywords": {str(k): _value(x, depth) for k, x in sorted(fn.keywords.items())}}
    if isinstance(fn, types.MethodType):
        return {"fn": _name(fn.__func__), "self": _name(type(fn.__self__))}
    if not isinstance(fn, types.FunctionType):
        return {"fn": _name(type(fn))}  # a callable object: torch keeps its __dict__
    out: dict[str, Item] = {"fn": _name(fn)}
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":  # the name says too little
        out["consts"] = _consts(fn.__code__, fn.__doc__)
        cells: dict[str, Item] = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cells[name] = _value(cell.cell_contents, depth)
            except ValueError:  # an empty cell
                continue
        if cells:
            out["closure"] = cells
    return out


def _consts(code: types.CodeType, doc: Any) -> list[Item]:
    """The literals of `code` and of the functions defined in it, in order (the docstring
    and None left out: Python versions place them differently)."""
    out: list[Item] = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.extend(_consts(c, None))
        elif isinstance(c, (bool, int, float)) or (isinstance(c, str) and c != doc):
            out.append(c)
        elif isinstance(c, tuple):
            out.extend(x for x in c if isinstance(x, (bool, int, float, str)))
    return out[:_ENTRIES]


def identity_of(scheduler: Any) -> dict[str, Item]:
    """What the state dict of `scheduler` lacks to identify it: its class, its functions
    and its children's identities (see the module docstring)."""
    out: dict[str, Item] = {"class": _name(type(scheduler))}
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if isinstance(lambdas, (list, tuple)):
        out["lr_lambdas"] = [function_identity(f) for f in lambdas]
    custom = getattr(scheduler, "_scale_fn_custom", None)
    if custom is not None:
        out["_scale_fn_custom"] = function_identity(custom)
    children = getattr(scheduler, _CHILDREN, None)
    if isinstance(children, (list, tuple)):
        out[_CHILDREN] = [identity_of(c) for c in children]
    return out


def scheduler_fields(state: Item, live: Any, path: str = "scheduler") -> dict[str, Item]:
    """The constructor arguments in a scheduler state dict (an item), by path, read as the
    live scheduler `live` is built: its class's arguments, and each child's of a
    `SequentialLR` / `ChainedScheduler`, at any depth."""
    out: dict[str, Item] = {}
    if not isinstance(state, dict):
        return out
    for key in args_of(type(live)):
        if key in state:
            out[f"{path}.{key}"] = state[key]
    lambdas = state.get("lr_lambdas")
    if isinstance(lambdas, list):  # a callable object's attributes, which torch restores
        for i, entry in enumerate(lambdas):
            if isinstance(entry, dict) and entry:
                out[f"{path}.lr_lambdas.{i}.attributes"] = entry
    children, child_states = getattr(live, _CHILDREN, None), state.get(_CHILDREN)
    if isinstance(children, (list, tuple)) and isinstance(child_states, list):
        for i, (child, child_state) in enumerate(zip(children, child_states)):
            out.update(scheduler_fields(child_state, child, f"{path}.{_CHILDREN}.{i}"))
    return out


def base_lrs_refusals(live: Any, state: Item, path: str = "scheduler") -> dict[str, str]:
    """For the live scheduler `live` and each child (at any depth), `PATH.base_lrs` -> why
    a new base lr cannot be kept, given the recorded state dict `state` ("" where it can).

    A scheduler that the next steps continue computes each lr from the last one unless its
    class computes it from `base_lrs` (`base_lrs_refusal`); a `SequentialLR`'s child that
    has finished is never used again, and one that starts after the recorded position
    starts from `base_lrs` (torch's closed form), where its class has one."""
    out = {f"{path}.base_lrs": base_lrs_refusal(type(live), path)}
    children = getattr(live, _CHILDREN, None)
    if not isinstance(state, dict):
        return out
    child_states = state.get(_CHILDREN)
    if not isinstance(children, (list, tuple)) or not isinstance(child_states, list):
        return out
    # a SequentialLR: the child the next step continues (`current`, unless it starts then)
    milestones, last = state.get("_milestones"), state.get("last_epoch")
    steps = [m for m in milestones if isinstance(m, int)] if isinstance(milestones, list) else []
    sequential, current, starts = False, 0, False
    if (isinstance(live, _sched.SequentialLR) and isinstance(last, int)
            and isinstance(milestones, list) and len(steps) == len(milestones)):
        sequential, current = True, bisect.bisect_right(steps, last + 1)
        starts = current > 0 and steps[current - 1] == last + 1
    for i, (child, child_state) in enumerate(zip(children, child_states)):
        at = f"{path}.{_CHILDREN}.{i}"
        inner = base_lrs_refusals(child, child_state, at)
        if sequential and i < current:
            inner[f"{at}.base_lrs"] = ""  # finished: never used again
        elif (sequential and (i > current or starts) and hasattr(child, "_get_closed_form_lr")
              and _own_get_lr(type(child)) is None):
            inner[f"{at}.base_lrs"] = ""  # starts from base_lrs at its milestone
        out.update(inner)
    return out


def _own_get_lr(cls: type) -> type | None:
    """The class below its nearest torch ancestor that defines `get_lr` (None: torch's own)."""
    for base in cls.__mro__:
        if base in _ARGS or base.__module__.startswith("torch."):
            return None
        if "get_lr" in vars(base) or "_get_closed_form_lr" in vars(base):
            return base
    return None


def flatten(item: Item, path: str) -> dict[str, Item]:
    """`item` (an identity) as leaves by path: maps are walked, and lists of maps."""
    if isinstance(item, dict) and item:
        out: dict[str, Item] = {}
        for k, v in item.items():
            out.update(flatten(v, f"{path}.{k}"))
        return out
    if isinstance(item, list) and item and all(isinstance(x, dict) for x in item):
        out = {}
        for i, v in enumerate(item):
            out.update(flatten(v, f"{path}.{i}"))
        return out
    return {path: item}


def hyperparameter_fields(group: dict[str, Item], path: str) -> dict[str, Item]:
    """The hyperparameters of a param group (an item, `params` aside) by path (see the
    module docstring)."""
    cycled = "max_momentum" in group  # OneCycleLR / CyclicLR cycle the momentum
    out: dict[str, Item] = {}
    for key, value in group.items():
        if key in NOT_HYPERPARAMETERS or (cycled and key == "momentum"):
            continue
        if cycled and key == "betas" and isinstance(value, list):
            for i, beta in enumerate(value[1:], start=1):
                out[f"{path}.betas.{i}"] = beta
            continue
        out[f"{path}.{key}"] = value
    return out


def take_live_hyperparameters(hyper: dict[str, Any], live: dict[str, Any], accepted: frozenset[str],
                              path: str) -> None:
    """Into `hyper` (a param group the load gives the optimizer), the live value of each
    hyperparameter of the group at `path` that `accepted` names (a cycled `betas`: all
    but `betas[0]`, which is the schedule's)."""
    for field in accepted:
        if not field.startswith(path + "."):
            continue
        key = field.removeprefix(path + ".").split(".")[0]
        if key not in live or key not in hyper:
            continue
        if key == "betas" and field != f"{path}.betas":  # cycled: the recorded betas[0] stays
            hyper[key] = type(live[key])([hyper[key][0], *live[key][1:]])
        else:
            hyper[key] = live[key]


_SCHEDULER_KEYS = {"initial_lr": "an LR scheduler", "max_lr": "OneCycleLR", "min_lr": "OneCycleLR",
                   "max_momentum": "OneCycleLR or CyclicLR", "base_momentum": "OneCycleLR or CyclicLR"}


def group_keys_differ(recorded: set[str], live: set[str]) -> str:
    """The message for a param group whose hyperparameter names differ; a key that a
    scheduler puts there (`initial_lr`) says that a scheduler was built, or not."""
    only_record, only_live = sorted(recorded - live), sorted(live - recorded)
    said = []
    for keys, side, other in ((only_record, "the record's", "the live one's"),
                              (only_live, "the live one's", "the record's")):
        for key in keys:
            by = _SCHEDULER_KEYS.get(key)
            note = f" (set when {by} is built on the optimizer)" if by else ""
            said.append(f"{side} param group holds {key}{note}, {other} does not")
    hint = ""
    if "initial_lr" in only_record:
        hint = ("; the recorded run had an LR scheduler on this optimizer: build that scheduler "
                "on the live optimizer and pass it")
    elif "initial_lr" in only_live:
        hint = "; the live optimizer has an LR scheduler, the recorded run's had none"
    return "hyperparameters differ: " + "; ".join(said) + hint
