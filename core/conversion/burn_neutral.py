"""Burn's records in the neutral vocabulary (`trainrec.conversion.convert.NeutralForm`, name `"burn"`),
and Burn's records as `TrainingRecord`s, so that `trainrec.conversion.convert` moves them to and from
every other adapter with no Burn-specific step in the engine.

Parameters (`M` is the module path, as Burn's modules name their fields):

| Burn                                  | neutral role   | layout                       |
| ------------------------------------- | -------------- | ---------------------------- |
| `M.weight` 2-D (`Linear`)             | `dense.kernel` | `[in, out]` as is            |
| `M.weight` 2-D (`Embedding`)          | `embedding`    | `[num, dim]` as is           |
| `M.weight` 3-5-D (`ConvNd`)           | `conv.kernel`  | `[out, in, *k]` -> `(*k, in, out)` |
| `M.bias`, `M.beta`                    | `bias`         | as is                        |
| `M.gamma` (`BatchNorm`, `LayerNorm`)  | `norm.scale`   | as is                        |
| `M.running_mean` / `M.running_var`    | `norm.mean` / `norm.var` | as is              |

A 2-D `weight` is a dense kernel or an embedding (the record does not say): the engine
takes the candidate the target also has. `ConvTranspose` weights (`[in, out, *k]`) read
as a convolution's and do not convert right: give a rule.

A Burn TrainingRecord (`training_record`): model `StateRecord("burn.module", item)` where
`item` is a Burn record item (`trainrec.recorders.burn`), optimizer `StateRecord("burn.optim.adam" |
"burn.optim.adamw" | "burn.optim.sgd" | "burn.optim", item)` with a Burnpack optimizer
record (Burn >= 0.22: tensors `"{param_id}.momentum.moment_1"` / `moment_2` /
`max_moment_2` and scalars `"{param_id}.momentum.time"` for Adam and AdamW,
`"{param_id}.momentum.velocity"` for SGD with momentum, `"{param_id}.__rank"`), no
scheduler, no pending gradients. Burn's moments are the same quantities as torch's and
optax's (Adam: `m`, `v` and the step count `time`; SGD: the velocity, torch's momentum
buffer), so they convert where the algorithms agree. What a Burn optimizer record does
not hold (which of Adam and AdamW, betas, epsilon, weight decay, SGD's dampening and
nesterov) is the caller's to say (`algorithm=`, `config=`); a source SGD record whose
`config` does not give dampening and nesterov is refused unless forced.

As a target with no template (`burn_template`): the source's parameters under Burn's names
(`gamma`/`beta` for a norm, whose module has a `norm.scale`, `norm.mean` or `norm.var`;
`weight`/`bias` otherwise; a 2-D weight of a module whose name says `emb`, `wte` or `wpe`
an embedding, else a dense kernel) and new ParamIds, made as Burn makes them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from ..format.header import Header
from ..items.tensor import TensorData
from ..items.tree import Item, map_leaves
from ..recorders.burn import (
    MODULE,
    OPTIMIZER,
    is_burn_item,
    module_tensors,
    new_param_id,
    param_id_value,
    split_training_item,
)
from ..training.gradients import GradientsParamsRecord
from ..training.record import TrainingRecord
from ..training.records import StateRecord
from .convert import (
    FIELDS,
    MATHS,
    ConversionError,
    Neutral,
    NeutralOptimizer,
    Rule,
    ScheduleCount,
    TargetState,
    as_map,
    form_for,
)

__all__ = ["FORM", "BurnForm", "training_record", "as_training", "burn_template", "burn_layout",
           "split_training_item", "MODEL_KIND", "OPTIMIZER_KINDS"]

MODEL_KIND = "burn.module"
OPTIMIZER_KINDS = {"adam": "burn.optim.adam", "adamw": "burn.optim.adamw", "sgd": "burn.optim.sgd",
                   None: "burn.optim"}
_EMPTY: dict[str, Item] = {"tensors": {}, "param_ids": {}, "metadata": {}, "scalars": {}, "dtypes": {}}
_ADAM = {"momentum.moment_1": "first_moment", "momentum.moment_2": "second_moment"}
_SGD = {"momentum.velocity": "momentum"}
_EMBEDDING = re.compile(r"emb|wte|wpe", re.IGNORECASE)


def _read(record: Any) -> tuple[Header | None, Item]:
    if isinstance(record, (str, os.PathLike)):
        from ..recorders.read import read_file

        return read_file(record)
    if isinstance(record, tuple) and len(record) == 2 and isinstance(record[0], Header):
        return record[0], record[1]
    return None, record


def training_record(model: Any, optimizer: Any = None, *, algorithm: str | None = None,
                    config: dict[str, Item] | None = None) -> TrainingRecord[Any]:
    """Burn's module record (a path, `read_file`'s `(Header, Item)` or the item) and, if
    given, its optimizer record (a Burnpack of Burn >= 0.22, the same ways) as one
    TrainingRecord for `trainrec.conversion.convert`. `algorithm` ("adam", "adamw", "sgd") names the
    optimizer, which Burn's record does not (without it: inferred from the state's fields,
    Adam's family or SGD's); `config` holds the settings it does not keep either
    (`{"nesterov", "dampening"}` for SGD, compared with the other side's)."""
    if algorithm not in OPTIMIZER_KINDS:
        raise ValueError(f"algorithm is one of adam, adamw, sgd (or None), got {algorithm!r}")
    header, item = _read(model)
    if header is not None and header.record_type != MODULE or not is_burn_item(item):
        raise TypeError("model is a Burn module record (Burnpack, NamedMpk or Bin)")
    opt_item: Item = dict(_EMPTY)
    if optimizer is not None:
        oh, opt_item = _read(optimizer)
        if oh is not None and oh.record_type != OPTIMIZER or not (isinstance(opt_item, dict)
                                                                  and isinstance(opt_item.get("tensors"), dict)):
            raise TypeError("optimizer is a Burn optimizer record (a Burnpack of Burn >= 0.22)")
    if config is not None:
        if not isinstance(config, dict):
            raise TypeError("config is a map of the optimizer's settings")
        opt_item = {**as_map(opt_item, "optimizer"), "config": dict(config)}
    return TrainingRecord(StateRecord(MODEL_KIND, item), StateRecord(OPTIMIZER_KINDS[algorithm], opt_item),
                          None, GradientsParamsRecord({}), None)


def as_training(header: Header, item: Item) -> TrainingRecord[Any] | None:
    """A Burn module file's record as a TrainingRecord without optimizer state (None for
    anything that is not a Burn module record)."""
    if not header.format.startswith("burn.") or header.record_type != MODULE:
        return None
    return training_record((header, item))


def _u64(pid: Item) -> int | None:
    if isinstance(pid, str):
        return param_id_value(pid)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _ids(model: StateRecord) -> dict[str, int]:
    item = as_map(model.item, "model")
    ids = item.get("param_ids") or {}
    out = {}
    for name, pid in as_map(ids, "model.param_ids").items():
        value = _u64(pid)
        if value is not None:
            out[name] = value
    return out


def _pid_of(name: str) -> tuple[int, str] | None:
    head, dot, field = name.partition(".")
    return (int(head), field) if dot and head.isdigit() and int(head) < 2**64 else None


class BurnForm:
    """Burn records: `burn.module` models, `burn.optim.*` optimizers (see the module docstring)."""

    name = "burn"
    kinds = ("burn",)
    keeps_rate = False
    rng_markers: frozenset[str] = frozenset()

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        if not is_burn_item(model.item):
            raise ConversionError(f"{role}.model: a {model.kind} record is not a Burn record item")
        return module_tensors(model.item)

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        path, _, leaf = name.rpartition(".")
        rank = len(shape)
        if leaf == "weight":
            if rank == 2:
                return [Neutral(path, "dense.kernel"), Neutral(path, "embedding")]
            if 3 <= rank <= 5:
                return [Neutral(path, "conv.kernel", (*range(2, rank), 1, 0))]
            return []
        role = {"bias": "bias", "beta": "bias", "gamma": "norm.scale", "running_mean": "norm.mean",
                "running_var": "norm.var"}.get(leaf)
        return [Neutral(path, role)] if role else []

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        return []

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        opt = record.optimizer
        item = as_map(opt.item, f"{role}.optimizer")
        tensors = as_map(item.get("tensors") or {}, f"{role}.optimizer.tensors")
        scalars = as_map(item.get("scalars") or {}, f"{role}.optimizer.scalars")
        config = as_map(item.get("config") or {}, f"{role}.optimizer.config")
        paths = as_map(item.get("metadata") or {}, f"{role}.optimizer.metadata")
        by_id = {pid: name for name, pid in _ids(record.model).items()}
        problems: list[str] = []
        fields = {f for n in tensors if (p := _pid_of(n)) for f in [p[1]]}
        kind = opt.kind
        algo = ("adam" if kind.endswith((".adam", ".adamw")) else "sgd" if kind.endswith(".sgd")
                else "adam" if fields & set(_ADAM) else "sgd" if fields & set(_SGD) else "")
        known = {"adam": {**_ADAM, "momentum.max_moment_2": ""}, "sgd": _SGD}.get(algo, {})
        moments: dict[str, dict[str, TensorData]] = {}
        for name, t in tensors.items():
            parsed = _pid_of(name)
            if parsed is None or not isinstance(t, TensorData):
                raise ConversionError(f"{role}.optimizer.tensors.{name}: Burn names optimizer state "
                                      "`{param_id}.{field}`")
            pid, field = parsed
            param = by_id.get(pid) or paths.get(str(pid))
            if field not in known:
                problems.append(f"{name}: Burn optimizer state {field!r} has no neutral form here "
                                "(Adam, AdamW: momentum.moment_1/2; SGD: momentum.velocity)")
            elif not isinstance(param, str) or param not in by_id.values():
                problems.append(f"{name}: ParamId {pid} is no parameter of the module record")
            elif known[field]:
                moments.setdefault(param, {})[known[field]] = t
        steps = set()
        for name, value in scalars.items():
            parsed = _pid_of(name)
            if parsed and parsed[1] == "momentum.time" and isinstance(value, dict):
                v = next(iter(value.values()), None)
                if isinstance(v, int) and not isinstance(v, bool):
                    steps.add(v)
        if len(steps) > 1:
            problems.append(f"per-parameter step counts disagree ({sorted(steps)}); the neutral form keeps one count")
        settings: dict[str, Item] = {"maximize": False}
        if algo == "adam":
            settings["amsgrad"] = any(n.endswith(".momentum.max_moment_2") for n in tensors)
            if settings["amsgrad"] and moments:
                problems.append("AMSGrad's max_moment_2 has no neutral form: it would be lost")
        elif algo == "sgd":
            for key in ("nesterov", "dampening"):
                if key in config:
                    settings[key] = config[key]
                elif role == "source" and moments:
                    problems.append(f"Burn's SGD record does not say its momentum's {key}: give it "
                                    "(training_record(..., config={...}))")
        unknown: dict[str, str] = {}
        if algo:
            for suffix, decoupled in {".adamw": True, ".adam": False}.items():
                if kind.endswith(suffix):
                    settings["decoupled_weight_decay"] = decoupled
                    break
            for key in FIELDS[algo]:
                if key in config:
                    settings[key] = config[key]
                elif key not in settings:
                    unknown[key] = "Burn's record keeps no settings: give the Burn program's, config={...}"
        step = max(steps) if steps else (None if algo == "sgd" else 0)
        return NeutralOptimizer(algo, step, moments, settings, None, problems, unknown)

    def read_schedule(self, record: TrainingRecord[Any], role: str, problems: list[str]) -> list[ScheduleCount]:
        if record.scheduler is not None:
            problems.append(f"{role}.scheduler: Burn schedulers do not convert here")
        return []

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        item = dict(as_map(template.item, "template.model"))
        if isinstance(item.get("tensors"), dict):
            item["tensors"] = {k: params[k] for k in as_map(item["tensors"], "template.model.tensors")
                               if k in params}
            return item
        item["item"] = map_leaves(item["item"], lambda path, v: params.get(path, v) if isinstance(v, TensorData) else v)
        return item

    def write_state(self, template: TrainingRecord[Any], state: TargetState) -> tuple[Item, StateRecord | None]:
        base = as_map(template.optimizer.item, "template.optimizer")
        ids = _ids(template.model)
        tensors: dict[str, Item] = {}
        param_ids: dict[str, Item] = {}
        scalars: dict[str, Item] = {}
        paths: dict[str, Item] = {}
        fields = _ADAM if state.algorithm == "adam" else _SGD if state.algorithm == "sgd" else {}
        for name, like in self.parameters(template.model, "template").items():
            pid = ids.get(name)
            found = {field: state.moment(name, which, like, f"optimizer.{name}.{field}")
                     for field, which in fields.items()}
            if not fields or any(v is None for v in found.values()):
                continue
            if pid is None:
                state.problems.append(f"template.model.{name} has no ParamId to key its optimizer state")
                continue
            for field, t in found.items():
                tensors[f"{pid}.{field}"] = t
                param_ids[f"{pid}.{field}"] = pid
            if state.algorithm == "adam":
                scalars[f"{pid}.momentum.time"] = {"UInt": int(state.step)}
            scalars[f"{pid}.__rank"] = {"UInt": len(like.shape)}
            paths[str(pid)] = name
        out: dict[str, Item] = {"tensors": tensors, "param_ids": param_ids, "metadata": paths,
                                "scalars": scalars, "dtypes": {}}
        if "config" in base:
            out["config"] = base["config"]
            if state.algorithm and isinstance(base["config"], dict):
                given = ", ".join(f"{k} {v!r}" for k, v in base["config"].items() if k in MATHS)
                state.notes["optimizer settings"] = (
                    "Burn's optimizer record keeps none of them: the Burn program's optimizer config must "
                    f"give {given or 'them'}")
        return out, None


FORM = BurnForm()


def _burn_name(cand: Neutral, norms: set[str]) -> str:
    path = cand.path
    leaf = {"dense.kernel": "weight", "conv.kernel": "weight", "embedding": "weight",
            "norm.scale": "gamma", "norm.mean": "running_mean", "norm.var": "running_var",
            "bias": "beta" if path in norms else "bias"}[cand.role]
    return f"{path}.{leaf}" if path else leaf


def _zeros(dtype: Any, shape: tuple[int, ...]) -> TensorData:
    return TensorData(dtype, shape, lambda: np.zeros(shape, dtype.numpy))


def burn_layout(record: Any) -> dict[str, Item] | None:
    """A Burnpack-layout Burn module item with the parameters of `record` (a TrainingRecord,
    its item, or a path or `(Header, Item)` of a file holding one) under Burn's names and
    layouts and new ParamIds, their values not yet set (zeros); None for anything else."""
    header, item = _read(record) if not isinstance(record, TrainingRecord) else (None, record)
    if isinstance(item, TrainingRecord):
        rec: TrainingRecord[Any] = item
    elif isinstance(item, list) and len(item) == 5 and (header is None or header.record_type == "TrainingRecord"):
        try:
            rec = TrainingRecord.from_item(item)
        except Exception:  # noqa: BLE001 - not a TrainingRecord item: say None
            return None
    else:
        return None
    src = form_for(rec, "source")
    params = src.parameters(rec.model, "source")
    chosen: dict[str, Neutral] = {}
    for name, t in params.items():
        cands = [c for c in src.candidates(name, t.shape) if c.role != "counter"]
        if not cands:
            continue
        first = cands[0]
        if first.role == "dense.kernel" and _EMBEDDING.search(first.path.rpartition(".")[2]):
            first = next((c for c in cands if c.role == "embedding"), first)
        chosen[name] = [c for c in cands if c.role == first.role][-1]  # flax's `name_i` also reads `name.i`
    norms = {c.path for c in chosen.values() if c.role in ("norm.scale", "norm.mean", "norm.var")}
    tensors: dict[str, Item] = {}
    ids: dict[str, Item] = {}
    for name, c in chosen.items():
        t = params[name]
        shape = c.neutral_shape(t.shape)
        if c.role == "conv.kernel":
            shape = (shape[-1], shape[-2], *shape[:-2])
        burn = _burn_name(c, norms)
        if burn in tensors:
            raise ConversionError(f"{name} and another tensor both become Burn's {burn}")
        tensors[burn] = _zeros(t.dtype, shape)
        ids[burn] = new_param_id()
    return {"tensors": tensors, "param_ids": ids, "metadata": {"format": "burnpack", "producer": "trainrec"},
            "scalars": {}, "dtypes": {}}


def burn_template(source: TrainingRecord[Any], config: dict[str, Item] | None = None) -> TrainingRecord[Any]:
    """A Burn target for `source` when no Burn record of the target exists: its parameters
    under Burn's names (`burn_layout`) and an optimizer of the source's algorithm, whose
    settings (`config`) are the source's unless given: Burn's record keeps none, so the
    conversion's report says which the Burn program must use."""
    layout = burn_layout(source)
    assert layout is not None
    try:
        found = form_for(source, "source").read_optimizer(source, "source", True)
    except ConversionError:
        found = NeutralOptimizer("")
    algo = found.algorithm
    kind = {"adam": "adamw" if found.settings.get("decoupled_weight_decay") else "adam",
            "sgd": "sgd"}.get(algo)
    if config is None:  # made for the source: its settings, which the Burn program must then use
        config = {k: found.settings[k] for k in FIELDS.get(algo, ())
                  if k in found.settings and k not in found.unknown and _plain(found.settings[k])}
    return training_record(layout, algorithm=kind, config=config if kind else None)


def _plain(value: Item) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))

