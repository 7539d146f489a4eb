"""The neutral forms of JAX records; imports no JAX. `FORM` ("jax"): flax linen variables
in a `JaxModule` and optax states; `NNX_FORM` ("flax.nnx"): `nnx.Module` and
`nnx.Optimizer` records, read as linen's of the same paths (`NnxForm`); `EQX_FORM`
("equinox"): `eqx.Module` records, in torch's layouts (`EqxForm`).

Parameters (flax variable names `collection.M.leaf`; `M` is the module path, where a
`name_i` segment, flax's name for the i-th module of a list attribute, also reads `name.i`):

| flax linen                          | neutral role   | layout                                 |
| ----------------------------------- | -------------- | -------------------------------------- |
| `params.M.kernel` 2-D (Dense)       | `dense.kernel` | [in, out] as is                        |
| `params.M.kernel` 3-5-D (Conv)      | `conv.kernel`  | (*spatial, in, out) as is              |
| `params.M.kernel` 3-D (attention)   | `dense.kernel` | (d, heads, hd) -> [d, heads*hd]; (heads, hd, d) -> [heads*hd, d] |
| `params.M.bias`                     | `bias`         | as is; (heads, hd) -> [heads*hd]       |
| `params.M.scale`                    | `norm.scale`   | as is                                  |
| `params.M.embedding`                | `embedding`    | as is                                  |
| `batch_stats.M.mean` / `.var`       | `norm.mean` / `norm.var` |                              |

Optimizers: the algorithm is the one the record's `#transforms` names (the JaxOptimizer
binding records the optax transforms in chain order): `scale_by_adam` without nesterov
and with `eps_root=0` (or `inject_hyperparams(adam|adamw)`): "adam" (`mu`, `nu`, `count`);
`trace` (or `inject_hyperparams(sgd)`): "sgd" (`trace` is the momentum; no dampening),
with only stateless learning-rate, weight-decay and clipping transforms around it, and
state leaves exactly `mu`/`nu` or `trace`. Anything else (AMSGrad's `nu_max`,
AdaBelief, AdaMax, Yogi, NAdam, RAdam, whose states look like Adam's, RMSProp, Lion,
rss + trace) is a `ConversionError` naming the transforms and state found, as is a record
without `#transforms` (captured before it was kept), unless forced. A learning rate that
`optax.inject_hyperparams` keeps as data (`hyperparams.learning_rate`) is the rate held
as data: a JAX target that injects one gets the source's (refused, unless forced, where
the source holds none or several). The update's maths (`trainrec.convert.MATHS`) are read
from the record's `#identity` by `optax_maths`: betas and eps, momentum and nesterov,
`add_decayed_weights` before the algorithm (L2) or after it (decoupled), clipping before
it, and the rate at the schedule's count, computed from the recorded constants of optax's
built-in schedules; a `JaxLrScheduler`'s rate (applied by the caller's code) and a schedule
function of the caller's are unknown.

Schedules: a JaxLrScheduler's `count` (stepped by the caller) or, without one, the counts
of schedules inside the optax state (e.g. `optax.adamw(warmup_cosine_decay_schedule(...))`),
which count updates. As a target, the position goes to both, and the update counts of
Adam (and `inject_hyperparams`) get the optimizer's step. The closed forms differ from
torch's: torch's CosineAnnealingLR is periodic past T_max while optax's cosine decay
clamps; OneCycle phase boundaries differ by one step. Use a target schedule that
reproduces the source's values.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from trainrec.adapter_kit import (
    PRESETS,
    ConversionError,
    Item,
    Neutral,
    NeutralOptimizer,
    Rule,
    ScheduleCount,
    StateRecord,
    TargetState,
    TensorData,
    TrainingRecord,
    as_count,
    as_map,
    out_in_weight,
    tensors_of,
)

from .optax_maths import optax_maths

__all__ = ["FORM", "NNX_FORM", "EQX_FORM", "JaxForm", "NnxForm", "EqxForm", "TRANSFORMS_KEY"]

TRANSFORMS_KEY = "#transforms"  # the optax transforms a JaxOptimizer record names
# stateless transforms that may come before the algorithm's (as torch's weight decay does
# for SGD) and after it (the learning rate, AdamW's decoupled decay)
_BEFORE = frozenset({"add_decayed_weights", "identity", "clip", "clip_by_global_norm"})
_AFTER = frozenset({"scale", "scale_by_learning_rate", "scale_by_schedule", "add_decayed_weights", "identity"})
_INJECTED = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}
_MARKERS = ((".mu.", "first_moment"), (".nu.", "second_moment"), (".trace.", "momentum"))


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


def _state_field(key: str) -> str:
    """The optax state field a leaf belongs to: its first key that is no chain index and
    no `inner_state` (`0.nu_max.fc1.kernel` -> `nu_max`)."""
    return next((part for part in key.split(".") if not part.isdigit() and part != "inner_state"), key)


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
                "neutral form here (Adam / AdamW: scale_by_adam(nesterov=False, eps_root=0) with "
                "mu and nu; SGD: trace); build it with optax.adam, adamw or sgd (force=True keeps "
                "the target's fresh state)")
        return ""
    return algo


def _schedule_count(leaves: dict[str, Item]) -> int:
    """The position of the schedules inside an optax state: their counts' (the largest)."""
    counts = [as_count(leaves[k], f"optimizer.{k}") for k in _counts(leaves)[1]]
    return max(counts, default=0)


def _flax_paths(path: str) -> list[str]:
    """`path`, and where flax named a list's modules `name_i`, the same path as `name.i`."""
    alt = ".".join(re.sub(r"^(.+)_(\d+)$", r"\1.\2", part) for part in path.split(".")) if path else path
    return [path] if alt == path else [path, alt]


class JaxForm:
    """JAX records: `jax.pytree` models (flax variables), optax states, optax schedules."""

    name = "jax"
    kinds = ("jax",)
    keeps_rate = False
    rng_markers: frozenset[str] = frozenset()

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        """The tensors, once some are flax linen parameters (`params.M.leaf`); else
        `ConversionError` saying how to capture nnx, equinox or a plain tree."""
        tensors = tensors_of(model.item, f"{role}.model")
        if tensors and not any(k.startswith("params.") for k in tensors):
            some = ", ".join(sorted(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
            raise ConversionError(
                f"{role}.model: a {model.kind} record converts as flax linen variables, whose parameters "
                f"are under `params` (`params.Dense_0.kernel`); this one has none ({some}). Capture "
                "an nnx.Module or eqx.Module itself (not nnx.state or eqx.filter of it: the flax.nnx and "
                "equinox forms convert those), or hold a plain tree as trj.JaxModule({'params': tree})")
        return tensors

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        collection, _, rest = name.partition(".")
        module, _, leaf = rest.rpartition(".")
        rank = len(shape)
        out: list[Neutral] = []
        for path in _flax_paths(module):
            if collection == "params":
                if leaf == "kernel":
                    if rank == 2:
                        out.append(Neutral(path, "dense.kernel"))
                    if 3 <= rank <= 5:
                        out.append(Neutral(path, "conv.kernel"))
                    if rank == 3:  # attention: (d, heads, head_dim) and (heads, head_dim, d)
                        out += [Neutral(path, "dense.kernel", shape=(shape[0], shape[1] * shape[2])),
                                Neutral(path, "dense.kernel", shape=(shape[0] * shape[1], shape[2]))]
                elif leaf == "bias":
                    out.append(Neutral(path, "bias", shape=(int(np.prod(shape)),) if rank == 2 else None))
                elif leaf in ("scale", "embedding"):
                    out.append(Neutral(path, "norm.scale" if leaf == "scale" else "embedding"))
            elif collection == "batch_stats" and leaf in ("mean", "var"):
                out.append(Neutral(path, f"norm.{leaf}"))
        return out

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        """flax `MultiHeadDotProductAttention` <-> torch `nn.MultiheadAttention` and separate
        q/k/v/out `Linear`s (`trainrec.rules.PRESETS["attention"]`: its rules say which
        direction they apply to)."""
        return list(PRESETS["attention"])

    # a moment's parameter is this prefix and the path after `mu.`/`nu.`/`trace.` in the optax
    # state: flax linen's optax states hold the `params` collection's tree
    _moment_prefix = "params."

    def _optax_leaves(self, item: Item, role: str) -> dict[str, Item]:
        """The optimizer record's optax state leaves, keyed as `JaxOptimizer` records them,
        with its `#` keys."""
        return as_map(item, f"{role}.optimizer")

    def _optax_item(self, leaves: dict[str, Item], template: dict[str, Item], state: TargetState) -> Item:
        """The optimizer item of `leaves` (`_optax_leaves`' form, converted), for the template."""
        return leaves

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        leaves = self._optax_leaves(record.optimizer.item, role)
        algo = _jax_algo(leaves, role, force)
        moments: dict[str, dict[str, TensorData]] = {}
        if algo:
            wanted = ("first_moment", "second_moment") if algo == "adam" else ("momentum",)
            for key, t in leaves.items():
                for marker, which in _MARKERS:
                    if which in wanted and marker in f".{key}" and isinstance(t, TensorData):
                        moments.setdefault(self._moment_prefix + key.split(marker[1:], 1)[1], {})[which] = t
        counts = [k for k in leaves if k.endswith("count")]
        mu_prefix = next((k.split(".mu.")[0] for k in leaves if ".mu." in f".{k}"), None)
        count_key = f"{mu_prefix}.count" if mu_prefix is not None and f"{mu_prefix}.count" in leaves else (
            counts[0] if counts else None)
        step = 0 if count_key is None else as_count(leaves[count_key], f"{role}.optimizer.{count_key}")
        settings, unknown, tolerance = self._maths(record, leaves, algo, _schedule_count(leaves), step)
        return NeutralOptimizer(algo, step, moments, settings, _injected_rate(leaves, role), unknown=unknown,
                                tolerance=tolerance)

    def _maths(self, record: TrainingRecord[Any], leaves: dict[str, Item], algo: str, position: int,
               step: int) -> tuple[dict[str, Item], dict[str, str], dict[str, float]]:
        """The update's `MATHS` at `position` (`optax_maths`); a rate a `JaxLrScheduler`
        gives is applied by the caller's code, which the record does not hold."""
        settings, unknown, tolerance = optax_maths(leaves, algo, position, step)
        if record.scheduler is not None and record.scheduler.kind == "optax.schedule":
            settings.pop("lr", None)
            unknown["lr"] = ("a JaxLrScheduler's rate is applied by the caller's code, which the record does "
                             "not hold")
        return settings, unknown, tolerance

    def read_schedule(self, record: TrainingRecord[Any], role: str, problems: list[str]) -> list[ScheduleCount]:
        sched = record.scheduler
        out = []
        if role == "template" or sched is None:
            leaves = self._optax_leaves(record.optimizer.item, role)
            for key in sorted(_counts(leaves)[1]):
                where = f"{role}.optimizer.{key}"
                out.append(ScheduleCount(where, as_count(leaves[key], where), True))
        if sched is not None:
            item = as_map(sched.item, f"{role}.scheduler")
            if "count" not in item:
                if role == "template":
                    problems.append(f"template.scheduler: a {sched.kind} has no count to carry the position")
                    return out
                raise ConversionError(f"{role}.scheduler.count: expected an integer count, got None")
            out.append(ScheduleCount(f"{role}.scheduler.count",
                                     as_count(item["count"], f"{role}.scheduler.count"), False))
        return out

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        return {k: params.get(k, v) for k, v in as_map(template.item, "template.model").items()}

    def write_state(self, template: TrainingRecord[Any], state: TargetState) -> tuple[Item, StateRecord | None]:
        leaves = self._optax_leaves(template.optimizer.item, "template")
        updates, _ = _counts(leaves)
        rate = None
        if _injected_rate(leaves, "template") is not None:
            rate = state.source_lr
            if rate is None:
                state.problems.append("the template injects one learning rate (optax.inject_hyperparams), "
                                      "the source holds none as data, or several (param groups that differ)")
        out: dict[str, Item] = {}
        for key, like in leaves.items():
            dotted = f".{key}"
            for marker, which in _MARKERS:
                if marker in dotted:
                    param = self._moment_prefix + key.split(marker[1:], 1)[1]
                    got = state.moment(param, which, like if isinstance(like, TensorData) else None,
                                       f"optimizer.{key}")
                    out[key] = like if got is None else got
                    break
            else:
                if _is_count(key) and isinstance(like, TensorData):
                    value = state.step if key in updates else state.position
                    out[key] = TensorData.from_array(np.asarray(value, like.dtype.numpy))  # 0-d
                elif _is_injected_rate(key) and rate is not None:
                    out[key] = (TensorData.from_array(np.asarray(rate, like.dtype.numpy).reshape(like.shape))
                                if isinstance(like, TensorData) else rate)
                else:
                    out[key] = like  # hyperparameters and empty states: the target's own
        scheduler = template.scheduler
        if scheduler is not None:
            item = dict(as_map(scheduler.item, "template.scheduler"))
            if "count" in item:
                item["count"] = state.position
            scheduler = StateRecord(scheduler.kind, item)
        algo = _jax_algo(leaves, "template", True)  # read_optimizer refused it unless forced
        values, unknown, tolerance = self._maths(template, leaves, algo, state.position, state.step)
        if rate is not None:
            values["lr"] = rate
            unknown.pop("lr", None)
        state.values.update(values)
        state.unknown.update(unknown)
        state.tolerance.update(tolerance)
        return self._optax_item(out, as_map(template.optimizer.item, "template.optimizer"), state), scheduler


_OPT_STATE = "opt_state."  # an nnx.Optimizer record: `step`, and the optax state under `opt_state`


class NnxForm(JaxForm):
    """flax nnx records: an `nnx.Module` (`NnxModule`: every variable by its path,
    `linear.kernel`) and an `nnx.Optimizer` (`NnxOptimizer`: `step`, and the optax state
    under `opt_state`). Parameters read as flax linen's of the same path: `kernel`,
    `bias`, `scale`, `embedding` as `params.PATH.LEAF`, BatchNorm's `mean` and `var` as its
    `batch_stats`; the `count` of an `Rngs` stream is a `counter` (the template's is
    kept), as is its key (not a tensor: never converted)."""

    name = "flax.nnx"
    kinds = ("flax.nnx",)
    _moment_prefix = ""  # nnx.Optimizer's optax state holds the Params by their own paths

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        return tensors_of(model.item, f"{role}.model")

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        parts = name.split(".")
        if "rngs" in parts[:-1] and parts[-1] == "count":
            return [Neutral(".".join(parts[:-1]), "counter")]
        collection = "batch_stats" if parts[-1] in ("mean", "var") else "params"
        return super().candidates(f"{collection}.{name}", shape)

    def _optax_leaves(self, item: Item, role: str) -> dict[str, Item]:
        leaves = as_map(item, f"{role}.optimizer")
        if "step" not in leaves:
            raise ConversionError(f"{role}.optimizer: an nnx.Optimizer record holds `step`; this one does not")
        return {k[len(_OPT_STATE):] if k.startswith(_OPT_STATE) else k: v for k, v in leaves.items()
                if k != "step"}

    def _optax_item(self, leaves: dict[str, Item], template: dict[str, Item], state: TargetState) -> Item:
        like = template["step"]
        step: Item = TensorData.from_array(np.asarray(state.step, like.dtype.numpy)) \
            if isinstance(like, TensorData) else state.step
        return {"step": step, **{k if k.startswith("#") else _OPT_STATE + k: v for k, v in leaves.items()}}


class EqxForm(JaxForm):
    """equinox records: an `eqx.Module` (`EqxModule`: its arrays by path,
    `layers.0.weight`) under an optax `JaxOptimizer` whose state holds the same paths.
    equinox keeps torch's layouts: a 2-D `weight` is a dense kernel `[out, in]` (or an
    embedding), a 3-5-D one a conv kernel `(out, in, *spatial)`, a 1-D one a norm's scale;
    a `bias` of shape `(out, 1, ...)` (`eqx.nn.Conv`) reads as `[out]`."""

    name = "equinox"
    kinds = ("equinox",)
    _moment_prefix = ""

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        return tensors_of(model.item, f"{role}.model")

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        path, _, leaf = name.rpartition(".")
        rank = len(shape)
        if leaf == "weight":
            return out_in_weight(path, shape)
        if leaf == "bias":
            return [Neutral(path, "bias", shape=(int(np.prod(shape)),) if rank > 1 else None)]
        return []

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        return []


FORM = JaxForm()
NNX_FORM = NnxForm()
EQX_FORM = EqxForm()
