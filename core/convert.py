"""Converting a `TrainingRecord` between PyTorch and JAX (flax linen + optax).

Conversion works on records, never on live objects, and needs no framework: the source
record, and a *template* record of the target, captured from a freshly built target run
(its model, optimizer and scheduler), which decides names, layouts, dtypes and the
optimizer's state structure, as transformers' pytorch<->flax conversion does.

Parameters (presets; user rules come first, see `Rule`):

| torch                        | flax linen                      | transform        |
| ---------------------------- | ------------------------------- | ---------------- |
| `M.weight` (Linear [out,in]) | `params.M.kernel` [in,out]      | transpose        |
| `M.weight` (Conv2d OIHW)     | `params.M.kernel` (HWIO)        | (2,3,1,0)        |
| `M.weight` (LayerNorm)       | `params.M.scale`                | none             |
| `M.weight` (Embedding)       | `params.M.embedding`            | none             |
| `M.bias`                     | `params.M.bias`                 | none             |
| `M.running_mean` / `_var`    | `batch_stats.M.mean` / `.var`   | none             |
| `M.num_batches_tracked`      | (none: the template's is kept)  |                  |

BatchNorm conventions differ and are not converted: flax momentum 0.99 is torch
momentum 0.1, flax keeps the biased running variance and torch the unbiased one; the
running values are copied as they are. LayerNorm eps: torch 1e-5, flax 1e-6 by default.

Optimizers: SGD (momentum, nesterov) <-> optax `trace`; Adam / AdamW <-> optax
`ScaleByAdamState` (`count`, `mu`, `nu`); moments get their parameter's transform. The
JAX algorithm is the one the record's `#transforms` names (the JaxOptimizer binding
records the optax transforms in chain order): `scale_by_adam` without nesterov and with
`eps_root=0` (or `inject_hyperparams(adam|adamw)`), or `trace` (`inject_hyperparams(sgd)`),
with only stateless learning-rate, weight-decay and clipping transforms around it, and
state leaves exactly `mu`/`nu` or `trace`. Anything else (AMSGrad's `nu_max`, AdaBelief,
AdaMax, Yogi, NAdam, RAdam, whose states look like Adam's, RMSProp, Lion, rss + trace)
is a `ConversionError` naming the transforms and state found, as is a record without
`#transforms` (captured before it was kept). Conversion also refuses where the maths
differ: AMSGrad, SGD dampening, `maximize`, per-parameter step counts that disagree,
complex parameters. `force=True` converts anyway, keeping the template's fresh state
where the algorithms differ. A learning rate that `optax.inject_hyperparams` keeps as data
(`hyperparams.learning_rate`) is carried: a JAX target gets the torch groups' one rate
(groups that differ are refused unless forced), a torch target's groups get it (unless
`lr` is given).

Dtypes: values are cast to the template's dtypes; where a cast changes a value (f32
weights into a bfloat16 template; checked exactly, `precision.is_lossless`), conversion
refuses unless `allow_lossy=True`.

Schedulers: the position (torch `last_epoch`, a JaxLrScheduler `count`, or the count of
a schedule inside optax, e.g. `optax.adamw(warmup_cosine_decay_schedule(...))`) goes to
the target's scheduler and to the counts of the schedules inside its optax state (the
update counts of Adam get the optimizer's step). A schedule inside optax counts updates:
a torch `last_epoch` that differs from the optimizer's step (a scheduler stepped per
epoch, or with an offset: one record cannot tell them apart) is refused for it unless
`force=True`. A torch OneCycleLR target with `cycle_momentum` also gets the momentum (or
Adam's beta1) it sets at the position, computed from its state as its `get_lr` does. A torch target also keeps the rate at
that position (every group's `lr`, the scheduler's `_last_lr`), which no record gives
(the schedule is code): pass it as `lr`. Refused unless `force=True`: a position the
target has no schedule for (or a target schedule with no source position), a torch
scheduler that keeps more than `last_epoch` (SequentialLR, ChainedScheduler,
CosineAnnealingWarmRestarts, ReduceLROnPlateau), a torch target's rate at a new position
without `lr`. The closed forms differ: torch's CosineAnnealingLR is periodic past T_max
while optax's cosine decay clamps; OneCycle phase boundaries differ by one step. Use a
target schedule that reproduces the source's values.

A malformed record (a component that is not the map or list its framework writes, a
torch `step` that is not one number) is a `ConversionError` naming the key; a malformed
rules file a `ValueError` naming the rule (CLI: exit 3).

A parameter without optimizer state in the source (torch creates it at a parameter's
first step) keeps the template's, which a freshly built target holds at zero. Pending
gradients get their parameter's transform. Framework RNG states cannot be
converted: a caller state holding one is refused unless `drop_rng=True`, which replaces
it by None.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import RecorderError
from .gradients import GradientsParamsRecord
from .items import Item, check_item
from .precision import NativePrecisionSettings, is_lossless
from .records import StateRecord
from .tensor import TensorData
from .training import TrainingRecord

__all__ = ["ConversionError", "Rule", "load_rules", "convert", "framework_of", "TRANSFORMS"]


class ConversionError(RecorderError):
    """The record cannot be converted as asked; the message lists every problem."""


def _transpose2(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.T if a.ndim == 2 else a


TRANSFORMS: dict[str, Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]] = {
    "none": lambda a: a,
    "transpose": _transpose2,
    "oihw_to_hwio": lambda a: a.transpose(2, 3, 1, 0),
    "hwio_to_oihw": lambda a: a.transpose(3, 2, 0, 1),
    "oiw_to_wio": lambda a: a.transpose(2, 1, 0),
    "wio_to_oiw": lambda a: a.transpose(2, 1, 0),
}


@dataclass(frozen=True)
class Rule:
    """A user rule: source names matching `match` (a regex, full match) map to
    `re.sub(match, replace, name)` in the target, with `transform` applied."""

    match: str
    replace: str
    transform: str = "none"

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")
        re.compile(self.match)


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a JSON file `{"rules": [{"match", "replace", "transform"?}, ...]}`.
    Raises `ValueError` naming every rule that is not such a map of strings, whose
    `match` is not a regular expression or whose `transform` is unknown."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{path}: expected {{\"rules\": [...]}}")
    rules, problems = [], []
    for i, r in enumerate(data["rules"]):
        where = f"{path}: rules[{i}]"
        if not isinstance(r, dict):
            problems.append(f"{where}: expected a map {{\"match\", \"replace\", \"transform\"?}}, "
                            f"got {type(r).__name__}")
            continue
        unknown = sorted(set(r) - {"match", "replace", "transform"})
        missing = [k for k in ("match", "replace") if k not in r]
        wrong = [k for k in ("match", "replace", "transform") if k in r and not isinstance(r[k], str)]
        if unknown or missing or wrong:
            problems.append(f"{where}: " + "; ".join(
                [f"missing {k!r}" for k in missing] + [f"unknown key {k!r}" for k in unknown]
                + [f"{k!r} must be a string" for k in wrong]))
            continue
        try:
            rules.append(Rule(r["match"], r["replace"], r.get("transform", "none")))
        except re.error as e:
            problems.append(f"{where}: match {r['match']!r} is not a regular expression ({e})")
        except ValueError as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ValueError("bad conversion rules: " + "; ".join(problems))
    return rules


def framework_of(record: TrainingRecord[Any]) -> str:
    kind = record.model.kind
    if kind.startswith("torch"):
        return "torch"
    if kind.startswith("jax"):
        return "jax"
    raise ConversionError(f"no conversion for models of kind {kind!r}")


# -- flat views of each framework's records ------------------------------------------------


def _map(value: Item, key: str) -> dict[str, Item]:
    if not isinstance(value, dict):
        raise ConversionError(f"{key}: expected a map, got {type(value).__name__}")
    return value


def _list(value: Item, key: str) -> list[Item]:
    if not isinstance(value, list):
        raise ConversionError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _torch_params(model: StateRecord, role: str) -> dict[str, TensorData]:
    tensors = _map(_map(model.item, f"{role}.model").get("tensors"), f"{role}.model.tensors")
    return {k: v for k, v in tensors.items() if isinstance(v, TensorData)}


def _jax_params(model: StateRecord, role: str) -> dict[str, TensorData]:
    return {k: v for k, v in _map(model.item, f"{role}.model").items() if isinstance(v, TensorData)}


_TORCH_TO_FLAX = {  # torch leaf -> (flax collection, flax leaf candidates with transform by rank)
    "weight": ("params", ["kernel", "scale", "embedding"]),
    "bias": ("params", ["bias"]),
    "running_mean": ("batch_stats", ["mean"]),
    "running_var": ("batch_stats", ["var"]),
}


def _kernel_transform(ndim: int, to_flax: bool) -> str:
    return {2: "transpose", 3: "oiw_to_wio" if to_flax else "wio_to_oiw",
            4: "oihw_to_hwio" if to_flax else "hwio_to_oihw"}.get(ndim, "none")


def _preset_candidates(source: str, to_flax: bool) -> list[tuple[str, str]]:
    """Target names (and transforms) a source name may map to under the presets."""
    if to_flax:
        module, _, leaf = source.rpartition(".")
        if leaf not in _TORCH_TO_FLAX:
            return []
        collection, leaves = _TORCH_TO_FLAX[leaf]
        prefix = f"{collection}.{module}." if module else f"{collection}."
        return [(prefix + flax_leaf, "kernel") if flax_leaf == "kernel" else (prefix + flax_leaf, "none")
                for flax_leaf in leaves]
    collection, _, rest = source.partition(".")
    module, _, leaf = rest.rpartition(".")
    out = []
    for torch_leaf, (coll, leaves) in _TORCH_TO_FLAX.items():
        if coll == collection and leaf in leaves:
            name = f"{module}.{torch_leaf}" if module else torch_leaf
            out.append((name, "kernel" if leaf == "kernel" else "none"))
    return out


def _match_params(source: dict[str, TensorData], target: dict[str, TensorData], to_flax: bool,
                  rules: list[Rule]) -> dict[str, tuple[str, str]]:
    """target name -> (source name, transform); every problem raised at once."""
    mapping: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    for name, t in source.items():
        ruled = [r for r in rules if re.fullmatch(r.match, name)]
        if ruled:
            cands = [(re.sub(ruled[0].match, ruled[0].replace, name), ruled[0].transform)]
        else:
            cands = _preset_candidates(name, to_flax)
        placed = False
        for target_name, transform in cands:
            if transform == "kernel":
                transform = _kernel_transform(len(t.shape), to_flax)
            if target_name not in target or target_name in mapping:
                continue
            shape = TRANSFORMS[transform](np.empty(t.shape, np.uint8)).shape
            if shape != target[target_name].shape:
                problems.append(f"{name} -> {target_name}: shape {tuple(shape)} after {transform}, "
                                f"target has {target[target_name].shape}")
                placed = True
                break
            mapping[target_name] = (name, transform)
            placed = True
            break
        if not placed and not name.endswith("num_batches_tracked"):
            problems.append(f"{name}: no target among {[c[0] for c in cands] or 'the presets'}")
    for name in target:
        if name not in mapping and not name.endswith("num_batches_tracked"):
            problems.append(f"target {name}: no source tensor maps to it")
    if problems:
        raise ConversionError("parameters do not map:\n  " + "\n  ".join(problems))
    return mapping


def _apply(t: TensorData, transform: str, like: TensorData | None = None,
           lossy: list[str] | None = None, where: str = "") -> TensorData:
    """`t` transformed (and cast to `like`'s dtype), lazily: the work happens when the
    tensor is read, so a writer streams a conversion tensor by tensor. A cast to another
    dtype is checked now (the tensor read once): where it changes values, `where` goes
    to `lossy`."""
    dtype = like.dtype if like is not None else t.dtype
    if lossy is not None and dtype is not t.dtype and not is_lossless(t, dtype):
        lossy.append(f"{where} ({t.dtype.value} -> {dtype.value})")
    shape = tuple(TRANSFORMS[transform](np.empty(t.shape, np.uint8)).shape)

    def load() -> np.ndarray[Any, Any]:
        arr = np.ascontiguousarray(TRANSFORMS[transform](t.read()))
        return arr.astype(dtype.numpy) if arr.dtype != dtype.numpy else arr

    return TensorData(dtype, shape, load)


# -- optimizers -----------------------------------------------------------------------------


@dataclass
class _Neutral:
    algo: str  # "adam" or "sgd"
    step: int
    m: dict[str, TensorData]  # exp_avg / mu / momentum trace, by source ParamId
    v: dict[str, TensorData]  # exp_avg_sq / nu


def _torch_optimizer(opt: StateRecord, force: bool) -> _Neutral:
    item = _map(opt.item, "source.optimizer")
    groups = _list(item.get("param_groups"), "source.optimizer.param_groups")
    state = _map(item.get("state"), "source.optimizer.state")
    kind = opt.kind.lower()
    algo = "sgd" if kind.endswith(".sgd") else "adam" if kind.endswith((".adam", ".adamw")) else ""
    problems = [] if algo else [f"optimizer {opt.kind} has no optax counterpart here (SGD, Adam, AdamW)"]
    for gi, group in enumerate(groups):
        g = _map(group, f"source.optimizer.param_groups.{gi}")
        if g.get("amsgrad"):
            problems.append("AMSGrad: optax keeps the max of the bias-corrected nu, torch of the raw one")
        if g.get("maximize"):
            problems.append("maximize=True has no optax counterpart")
        if algo == "sgd" and g.get("dampening", 0):
            problems.append(f"SGD dampening={g['dampening']!r}: optax's trace has no dampening")
    steps = set()
    m: dict[str, TensorData] = {}
    v: dict[str, TensorData] = {}
    for pid, value in state.items():
        entry = _map(value, f"source.optimizer.state.{pid}")
        step = entry.get("step")
        if isinstance(step, TensorData):
            if step.shape not in ((), (1,)) or step.dtype.numpy.kind not in "iuf":
                raise ConversionError(f"source.optimizer.state.{pid}.step: expected one real number, "
                                      f"got a {step.dtype.value} tensor of shape {step.shape}")
            steps.add(int(float(step.array.reshape(()))))
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            steps.add(int(step))
        elif step is not None:
            raise ConversionError(f"source.optimizer.state.{pid}.step: expected a number, got {step!r}")
        for src, dst in (("exp_avg", m), ("momentum_buffer", m), ("exp_avg_sq", v)):
            moment = entry.get(src)
            if isinstance(moment, TensorData):
                if np.iscomplexobj(moment.array):
                    problems.append(f"{pid}: complex parameters")
                dst[pid] = moment
    if len(steps) > 1:
        problems.append(f"per-parameter step counts disagree ({sorted(steps)}); optax keeps one count")
    if problems and not force:
        raise ConversionError("the optimizer's maths differ between the frameworks:\n  "
                              + "\n  ".join(problems) + "\n(force=True converts anyway)")
    return _Neutral(algo or "adam", max(steps) if steps else 0, m, v)


TRANSFORMS_KEY = "#transforms"  # the optax transforms a JaxOptimizer record names
# stateless transforms that may come before the algorithm's (as torch's weight decay does
# for SGD) and after it (the learning rate, AdamW's decoupled decay)
_BEFORE = frozenset({"add_decayed_weights", "identity", "clip", "clip_by_global_norm"})
_AFTER = frozenset({"scale", "scale_by_learning_rate", "scale_by_schedule", "add_decayed_weights", "identity"})
_INJECTED = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}


def _state_field(key: str) -> str:
    """The optax state field a leaf belongs to: its first key that is no chain index and
    no `inner_state` (`0.nu_max.fc1.kernel` -> `nu_max`)."""
    return next((part for part in key.split(".") if not part.isdigit() and part != "inner_state"), key)


def _jax_algo(leaves: dict[str, Item], role: str, force: bool) -> str:
    """"adam" or "sgd": the algorithm a JaxOptimizer record's `#transforms` name, and whose
    state leaves are exactly that algorithm's (`mu`/`nu`, or `trace`); "" where it is
    neither and `force` is given; else `ConversionError` naming what was found."""
    names = leaves.get(TRANSFORMS_KEY)
    markers = {_state_field(k) for k, v in leaves.items() if isinstance(v, TensorData)
               and not _is_count(k) and ".hyperparams." not in f".{k}"}
    guess = "adam" if markers == {"mu", "nu"} else "sgd" if markers <= {"trace"} else ""
    if names is None:
        why = (f"{role}.optimizer names no optax transforms ({TRANSFORMS_KEY}: recorded before "
               "trainrec kept them), and Adam's state is that of AdaMax, Yogi, NAdam, RAdam or AdaBelief")
        if not force:
            raise ConversionError(why + "; capture the record again, or force=True to take it for "
                                  + (guess or "none of Adam and SGD"))
        return guess
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConversionError(f"{role}.optimizer.{TRANSFORMS_KEY}: expected a list of names, got {names!r}")
    algos: list[str] = []
    unknown: list[str] = []
    for name in [str(n) for n in names]:
        base, _, args = name.partition("(")
        if base == "scale_by_adam" and "nesterov=False" in args and "eps_root=0.0" in args:
            algos.append("adam")
        elif base == "trace":
            algos.append("sgd")
        elif base.startswith("inject_") and args.rstrip(")") in _INJECTED:
            algos.append(_INJECTED[args.rstrip(")")])
        elif base not in (_AFTER if algos else _BEFORE):
            unknown.append(name)
    algo = algos[0] if len(algos) == 1 else "" if algos else "sgd"
    if unknown or len(algos) > 1 or algo != (guess or algo) or (guess == "" and markers):
        if not force:
            raise ConversionError(
                f"{role}.optimizer: optax transforms {names} with state {sorted(markers) or 'none'}: no "
                "torch counterpart here (Adam / AdamW: scale_by_adam(nesterov=False, eps_root=0) with "
                "mu and nu; SGD: trace); build it with optax.adam, adamw or sgd (force=True keeps "
                "the target's fresh state)")
        return ""
    return algo


def _jax_optimizer(opt: StateRecord, force: bool) -> _Neutral:
    leaves = _map(opt.item, "source.optimizer")
    algo = _jax_algo(leaves, "source", force)
    m = {"params." + k.split(".mu.", 1)[1]: t for k, t in leaves.items()
         if ".mu." in f".{k}" and isinstance(t, TensorData)}
    v = {"params." + k.split(".nu.", 1)[1]: t for k, t in leaves.items()
         if ".nu." in f".{k}" and isinstance(t, TensorData)}
    trace = {"params." + k.split(".trace.", 1)[1]: t for k, t in leaves.items()
             if ".trace." in f".{k}" and isinstance(t, TensorData)}
    counts = [k for k in leaves if k.endswith("count")]
    mu_prefix = next((k.split(".mu.")[0] for k in leaves if ".mu." in f".{k}"), None)
    count_key = f"{mu_prefix}.count" if mu_prefix is not None and f"{mu_prefix}.count" in leaves else (
        counts[0] if counts else None)
    step = 0 if count_key is None else _count(leaves[count_key], f"source.optimizer.{count_key}")
    if not algo:
        return _Neutral("unknown", step, {}, {})
    if algo == "sgd":
        return _Neutral("sgd", step, trace, {})
    return _Neutral("adam", step, m, v)


def _target_algo(template: StateRecord, to_flax: bool, force: bool) -> str:
    if to_flax:
        return _jax_algo(_map(template.item, "template.optimizer"), "template", force)
    kind = template.kind.lower()
    return "sgd" if kind.endswith(".sgd") else "adam" if kind.endswith((".adam", ".adamw")) else ""


def _to_jax_optimizer(n: _Neutral, template: StateRecord, inverse: dict[str, tuple[str, str]],
                      position: int, rate: float | None, lossy: list[str]) -> Item:
    """The template's optax state with the source's moments, its step in every update count,
    `position` in every schedule count and `rate` (the torch groups' `lr`) in an
    `inject_hyperparams` learning rate."""
    leaves = _map(template.item, "template.optimizer")
    updates, _ = _counts(leaves)
    out: dict[str, Item] = {}
    problems = []
    for key, like in leaves.items():
        dotted = f".{key}"
        for marker, source in ((".mu.", n.m), (".nu.", n.v), (".trace.", n.m)):
            if marker in dotted:
                target_param = "params." + key.split(marker[1:], 1)[1]
                src = inverse.get(target_param)
                if src is None:
                    problems.append(f"{key}: no source parameter maps to {target_param}")
                    out[key] = like
                elif src[0] not in source:
                    out[key] = like  # torch keeps no state before a parameter's first step
                else:
                    out[key] = _apply(source[src[0]], src[1], like if isinstance(like, TensorData) else None,
                                      lossy, f"optimizer.{key}")
                break
        else:
            if _is_count(key) and isinstance(like, TensorData):
                value = n.step if key in updates else position
                out[key] = TensorData.from_array(np.asarray(value, like.dtype.numpy))  # 0-d
            elif _is_injected_rate(key) and rate is not None:
                out[key] = (TensorData.from_array(np.asarray(rate, like.dtype.numpy).reshape(like.shape))
                            if isinstance(like, TensorData) else rate)
            else:
                out[key] = like  # hyperparameters and empty states: the target's own
    if problems:
        raise ConversionError("optimizer state does not map:\n  " + "\n  ".join(problems))
    return out


def _to_torch_optimizer(n: _Neutral, template: StateRecord, inverse: dict[str, tuple[str, str]],
                        target_params: dict[str, TensorData], lrs: list[float] | None,
                        momenta: list[float] | None, lossy: list[str]) -> Item:
    """The template's param groups (with `lrs`, the rate of each group at the schedule
    position, where given, and `momenta`, the momentum or beta1 a OneCycleLR sets there)
    and the source's state."""
    item = _map(template.item, "template.optimizer")
    groups: list[Item] = []
    for gi, group in enumerate(_list(item.get("param_groups"), "template.optimizer.param_groups")):
        g = dict(_map(group, f"template.optimizer.param_groups.{gi}"))
        if lrs is not None:
            g["lr"] = lrs[gi]
        if momenta is not None:
            betas = g.get("betas")
            if isinstance(betas, list) and betas:
                g["betas"] = [momenta[gi], *betas[1:]]
            else:
                g["momentum"] = momenta[gi]
        groups.append(g)
    sgd = template.kind.lower().endswith(".sgd")
    state: dict[str, Item] = {}
    for gi, group in enumerate(groups):
        where = f"template.optimizer.param_groups.{gi}.params"
        for pid in _list(_map(group, where).get("params"), where):
            if not isinstance(pid, str) or pid not in target_params:
                raise ConversionError(f"{where}: {pid!r} is not a parameter of the template's model")
            src = inverse.get(pid)
            if src is None or src[0] not in n.m:
                continue  # no state yet for this parameter
            like = target_params[pid]
            if sgd:
                state[pid] = {"momentum_buffer": _apply(n.m[src[0]], src[1], like, lossy,
                                                        f"optimizer.state.{pid}.momentum_buffer")}
            else:
                state[pid] = {"step": TensorData.from_array(np.asarray(float(n.step), np.float32)),
                              "exp_avg": _apply(n.m[src[0]], src[1], like, lossy,
                                                f"optimizer.state.{pid}.exp_avg"),
                              "exp_avg_sq": _apply(n.v[src[0]], src[1], like, lossy,
                                                   f"optimizer.state.{pid}.exp_avg_sq")}
    return {"state": state, "param_groups": groups}


# -- state and schedulers ------------------------------------------------------------------


def _drop_rng(item: Item, drop: bool, path: str = "state") -> Item:
    if isinstance(item, dict):
        if "torch_cpu" in item and "base" in item:
            if not drop:
                raise ConversionError(
                    f"{path} holds torch RNG state, which the target framework cannot use; "
                    "convert with drop_rng=True (--drop-rng) to drop it")
            return None
        return {k: _drop_rng(v, drop, f"{path}.{k}") for k, v in item.items()}
    if isinstance(item, list):
        return [_drop_rng(v, drop, f"{path}.{i}") for i, v in enumerate(item)]
    return item


# torch schedulers whose whole position is `last_epoch` (and `_step_count`); the others
# (SequentialLR, ChainedScheduler, CosineAnnealingWarmRestarts, ReduceLROnPlateau) keep more
_TORCH_POSITIONAL = frozenset(f"torch.optim.lr_scheduler.{name}" for name in (
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
    "PolynomialLR", "CosineAnnealingLR", "OneCycleLR", "CyclicLR"))


def _count(value: Item, key: str) -> int:
    if isinstance(value, TensorData) and value.dtype.numpy.kind in "iu" and value.shape in ((), (1,)):
        return int(value.array.reshape(()))
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConversionError(f"{key}: expected an integer count, got {value!r}")


def _is_count(key: str) -> bool:
    return key == "count" or key.endswith(".count")


def _counts(leaves: dict[str, Item]) -> tuple[set[str], set[str]]:
    """(update counts, schedule counts) of an optax state: the count beside `mu`/`nu`
    (ScaleByAdamState) or beside `hyperparams` (inject_hyperparams) counts updates; any
    other count (ScaleByScheduleState, a scheduled hyperparameter's state) is the position
    of a schedule that lives inside optax."""
    updates: set[str] = set()
    schedules: set[str] = set()
    for key in leaves:
        if _is_count(key):
            prefix = key[: -len("count")]
            siblings = (prefix + "mu.", prefix + "nu.", prefix + "hyperparams.")
            (updates if any(k.startswith(siblings) for k in leaves) else schedules).add(key)
    return updates, schedules


def _source_schedule(source: TrainingRecord[Any], problems: list[str]) -> tuple[int, str] | None:
    """The source's schedule position and where it is kept; None when it schedules nothing."""
    sched = source.scheduler
    if sched is not None:
        item = _map(sched.item, "source.scheduler")
        key = "count" if "count" in item else "last_epoch"
        if sched.kind.startswith("torch") and sched.kind not in _TORCH_POSITIONAL:
            problems.append(f"source.scheduler: a {sched.kind} keeps more than its last_epoch; "
                            "its position does not carry")
        return _count(item.get(key), f"source.scheduler.{key}"), f"source.scheduler.{key}"
    if framework_of(source) != "jax":
        return None
    leaves = _map(source.optimizer.item, "source.optimizer")
    found = {key: _count(leaves[key], f"source.optimizer.{key}") for key in sorted(_counts(leaves)[1])}
    if len(set(found.values())) > 1:
        problems.append(f"source.optimizer: the schedule counts disagree ({found})")
    return (max(found.values()), f"source.optimizer.{min(found)}") if found else None


def _is_injected_rate(key: str) -> bool:
    return key == "hyperparams.learning_rate" or key.endswith(".hyperparams.learning_rate")


def _injected_rate(leaves: dict[str, Item], role: str) -> float | None:
    """The learning rate an `optax.inject_hyperparams` state holds as data, or None."""
    found: dict[str, float] = {}
    for key, value in leaves.items():
        if _is_injected_rate(key):
            if isinstance(value, TensorData) and value.shape in ((), (1,)) and value.dtype.is_float:
                found[key] = float(value.array.reshape(()))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                found[key] = float(value)
            else:
                raise ConversionError(f"{role}.optimizer.{key}: expected one rate, got {value!r}")
    if len(set(found.values())) > 1:
        raise ConversionError(f"{role}.optimizer: the injected learning rates disagree ({found})")
    return next(iter(found.values()), None)


def _torch_rate(opt: StateRecord) -> float | None:
    """The one `lr` of a torch optimizer record's param groups, or None when they differ."""
    groups = _list(_map(opt.item, "source.optimizer").get("param_groups"), "source.optimizer.param_groups")
    rates = {_map(g, f"source.optimizer.param_groups.{i}").get("lr") for i, g in enumerate(groups)}
    rate = rates.pop() if len(rates) == 1 else None
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def _rates(lr: float | Sequence[float], groups: int) -> list[float]:
    rates = [lr] * groups if isinstance(lr, (int, float)) else list(lr)
    if len(rates) != groups or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r >= 0
            for r in rates):
        raise ValueError(f"lr must be a finite rate >= 0 or one per param group ({groups}), got {lr!r}")
    return [float(r) for r in rates]


def _one_cycle_momenta(item: dict[str, Item], groups: list[Item], position: int) -> list[float] | str:
    """The momentum (SGD `momentum` or Adam's beta1) of each param group that a torch
    OneCycleLR with `cycle_momentum` sets at `position`, computed as its `get_lr` does
    (the same float operations, so the same values); or why it cannot be."""
    phases, kind = item.get("_schedule_phases"), item.get("_anneal_func_type")
    if kind not in ("cos", "linear") or not isinstance(phases, list) or not phases:
        return f"a OneCycleLR keeping _anneal_func_type {kind!r} and _schedule_phases {phases!r}"

    def anneal(start: float, end: float, pct: float) -> float:
        if kind == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    out = []
    for gi, group in enumerate(groups):
        g = _map(group, f"template.optimizer.param_groups.{gi}")
        start_step = 0.0
        for i, phase in enumerate(phases):
            ph = _map(phase, f"template.scheduler._schedule_phases.{i}")
            end_step = ph.get("end_step")
            lo, hi = g.get(str(ph.get("start_momentum"))), g.get(str(ph.get("end_momentum")))
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (end_step, lo, hi)):
                return f"param group {gi} or phase {i} lacks its momentum bounds"
            assert isinstance(end_step, (int, float)) and isinstance(lo, (int, float)) and isinstance(hi, (int, float))
            if position <= end_step or i == len(phases) - 1:
                out.append(anneal(lo, hi, (position - start_step) / (end_step - start_step)))
                break
            start_step = end_step
    return out


def _carry_schedule(source: TrainingRecord[Any], template: TrainingRecord[Any], step: int,
                    lr: float | Sequence[float] | None,
                    force: bool) -> tuple[int, StateRecord | None, list[float] | None, list[float] | None]:
    """(the position for the target's schedule counts, the target's scheduler record, the
    rate of each torch param group at that position, the momentum a torch OneCycleLR sets
    there). Raises `ConversionError` where the position has no place in the target, or a
    torch target's rate at it is unknown."""
    problems: list[str] = []
    source_schedule = _source_schedule(source, problems)
    sched = template.scheduler
    to_flax = framework_of(template) == "jax"
    lrs: list[float] | None = None
    momenta: list[float] | None = None
    if to_flax:
        if lr is not None:
            raise ValueError("lr is for torch targets: JAX computes its rate from the schedule count")
        places = [f"template.optimizer.{k}" for k in sorted(_counts(_map(
            template.optimizer.item, "template.optimizer"))[1])]
        if sched is not None:
            places.append("template.scheduler.count")
    else:
        groups = _list(_map(template.optimizer.item, "template.optimizer").get("param_groups"),
                       "template.optimizer.param_groups")
        lrs = None if lr is None else _rates(lr, len(groups))
        places = [] if sched is None else ["template.scheduler.last_epoch"]
    if source_schedule is None:
        position = step
        if places and step > 0:
            problems.append(f"the template schedules its learning rate ({', '.join(places)}), "
                            f"the source has no schedule position after {step} steps")
    else:
        position, where = source_schedule
        updates_counted = [p for p in places if p.startswith("template.optimizer.")]
        if where.endswith("last_epoch") and position != step and updates_counted:
            problems.append(f"{where} = {position} but the optimizer took {step} steps (the torch "
                            f"scheduler is not stepped once per update), and the template's schedule "
                            f"counts updates ({', '.join(updates_counted)}): its rates would differ")
        if not places and position > 0:
            problems.append(f"{where} = {position}: the template has no schedule to carry it"
                            + (" (an optax schedule or a JaxLrScheduler)" if to_flax else " (a torch scheduler)"))
    scheduler = sched
    if sched is not None:
        item = dict(_map(sched.item, "template.scheduler"))
        if to_flax:
            if "count" not in item:
                problems.append(f"template.scheduler: a {sched.kind} has no count to carry the position")
            else:
                item["count"] = position
        elif sched.kind not in _TORCH_POSITIONAL:
            problems.append(f"template.scheduler: a {sched.kind} keeps more than its last_epoch; "
                            "the position does not carry")
        else:
            if position != item.get("last_epoch") and lrs is None:
                problems.append(
                    f"template.scheduler: a {sched.kind} at last_epoch {position} keeps each group's "
                    "learning rate there, which the records do not give (the schedule is code); pass "
                    f"lr= (the source schedule's rate at {position})")
            if (sched.kind.endswith(".OneCycleLR") and item.get("cycle_momentum")
                    and position != item.get("last_epoch")):
                found = _one_cycle_momenta(item, groups, position)
                if isinstance(found, str):
                    problems.append(f"template.scheduler: {found}: the momentum at {position} is unknown")
                else:
                    momenta = found
            item["last_epoch"], item["_step_count"] = position, position + 1
            if lrs is not None:
                item["_last_lr"] = list(lrs)
        scheduler = StateRecord(sched.kind, item)
    if problems and not force:
        raise ConversionError("the learning-rate schedule does not carry over:\n  " + "\n  ".join(problems)
                              + "\n(force=True converts anyway: the template's rates, the position where it fits)")
    return position, scheduler, lrs, momenta


# -- the conversion ------------------------------------------------------------------------


def convert(source: TrainingRecord[Any], template: TrainingRecord[Any], *,
            rules: list[Rule] | None = None, force: bool = False,
            drop_rng: bool = False, lr: float | Sequence[float] | None = None,
            allow_lossy: bool = False) -> TrainingRecord[Any]:
    """`source` converted into the framework, layout and structure of `template`.

    The learning-rate schedule's position (torch `last_epoch`, a `JaxLrScheduler` count,
    or the count of a schedule inside optax) goes to the target's schedule. A torch target
    also keeps the rate itself (each group's `lr`, the scheduler's `_last_lr`): `lr` gives
    it (one rate, or one per param group: the source schedule's value at its position).

    Raises `ConversionError` listing every problem (unmapped or mismatched tensors,
    optimizer maths that differ, a schedule position the target cannot hold or whose
    torch rate is not given, RNG state) at once; `force=True` converts anyway where the
    maths or the schedule differ. A template dtype narrower than the source's (f32 weights
    into a bfloat16 template) is refused where the cast changes a value (checked exactly,
    `trainrec.precision.is_lossless`) unless `allow_lossy=True`, which rounds them.
    `ValueError` for an `lr` that is not a rate per group.
    """
    src_fw, dst_fw = framework_of(source), framework_of(template)
    if src_fw == dst_fw:
        raise ConversionError(f"both records are {src_fw}: nothing to convert")
    to_flax = dst_fw == "jax"
    src_params = (_torch_params if src_fw == "torch" else _jax_params)(source.model, "source")
    dst_params = (_jax_params if to_flax else _torch_params)(template.model, "template")
    mapping = _match_params(src_params, dst_params, to_flax, rules or [])
    lossy: list[str] = []
    new_params = {name: _apply(src_params[s], tr, dst_params[name], lossy, f"model.{name}")
                  for name, (s, tr) in mapping.items()}
    for name, t in dst_params.items():
        new_params.setdefault(name, t)  # num_batches_tracked: the template's
    if src_fw == "torch":
        native = source.model.item.get("grads") if isinstance(source.model.item, dict) else None
        if native and not force:
            raise ConversionError("the torch model holds gradients in .grad (native accumulation); "
                                  "move them into the accumulator, or force=True to drop them")
    neutral = _torch_optimizer(source.optimizer, force) if to_flax else _jax_optimizer(source.optimizer, force)
    target_algo = _target_algo(template.optimizer, to_flax, force)
    if neutral.m and target_algo != neutral.algo:
        if not force:
            raise ConversionError(f"the source optimizer keeps {neutral.algo} state, the template's "
                                  f"({template.optimizer.kind}) {target_algo or 'no state this converts'}: "
                                  "build the target with the same algorithm (force=True keeps the "
                                  "template's fresh state)")
        neutral = _Neutral(target_algo, neutral.step, {}, {})
    if to_flax:
        rate = None
        if _injected_rate(_map(template.optimizer.item, "template.optimizer"), "template") is not None:
            rate = _torch_rate(source.optimizer)
            if rate is None and not force:
                raise ConversionError("the template injects one learning rate (optax.inject_hyperparams), "
                                      "the source's param groups hold different ones (force=True keeps "
                                      "the template's)")
    elif lr is None:  # a JAX rate held as data is the torch groups' rate
        lr = _injected_rate(_map(source.optimizer.item, "source.optimizer"), "source")
    position, scheduler, lrs, momenta = _carry_schedule(source, template, neutral.step, lr, force)
    if to_flax:
        t_model = _map(template.model.item, "template.model")
        model_item: Item = {k: new_params.get(k, v) for k, v in t_model.items()}
        opt_item = _to_jax_optimizer(neutral, template.optimizer, mapping, position, rate, lossy)
    else:
        t_model = _map(template.model.item, "template.model")
        model_item = {"tensors": {k: new_params[k] for k in dst_params}, "aliases": t_model.get("aliases"),
                      "grads": {}}
        opt_item = _to_torch_optimizer(neutral, template.optimizer, mapping, dst_params, lrs, momenta, lossy)
    if lossy and not allow_lossy:
        raise ConversionError("the template's dtypes are narrower and would change these values:\n  "
                              + "\n  ".join(lossy) + "\n(allow_lossy=True converts anyway, rounding them)")
    inverse_src = {s: (t, tr) for t, (s, tr) in mapping.items()}
    grads = {}
    for pid, g in source.grads.grads.items():
        if pid not in inverse_src:
            raise ConversionError(f"pending gradient {pid} has no target parameter")
        target_name, tr = inverse_src[pid]
        grads[target_name] = _apply(g, tr)
    whole = _list(source.into_item(NativePrecisionSettings()), "source")
    state_item = _drop_rng(whole[4], drop_rng)
    return TrainingRecord(
        StateRecord(template.model.kind, check_item(model_item)),
        StateRecord(template.optimizer.kind, check_item(opt_item)),
        scheduler,
        GradientsParamsRecord(grads),
        state_item,
        None,
    )
