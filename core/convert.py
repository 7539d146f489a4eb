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
`ScaleByAdamState` (`count`, `mu`, `nu`); moments get their parameter's transform.
Conversion refuses (unless `force=True`) where the maths differ: AMSGrad, SGD
dampening, `maximize`, per-parameter step counts that disagree, complex parameters.

Schedulers: the position (torch `last_epoch`, optax/JaxLrScheduler `count`) is carried.
The closed forms differ: torch's CosineAnnealingLR is periodic past T_max while optax's
cosine decay clamps; OneCycle phase boundaries differ by one step. Use a target schedule
that reproduces the source's values.

A parameter without optimizer state in the source (torch creates it at a parameter's
first step) keeps the template's, which a freshly built target holds at zero. Pending
gradients get their parameter's transform. Framework RNG states cannot be
converted: a caller state holding one is refused unless `drop_rng=True`, which replaces
it by None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import RecorderError
from .gradients import GradientsParamsRecord
from .items import Item, check_item
from .precision import NativePrecisionSettings
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
    """Rules from a JSON file `{"rules": [{"match", "replace", "transform"?}, ...]}`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{path}: expected {{\"rules\": [...]}}")
    return [Rule(r["match"], r["replace"], r.get("transform", "none")) for r in data["rules"]]


def framework_of(record: TrainingRecord[Any]) -> str:
    kind = record.model.kind
    if kind.startswith("torch"):
        return "torch"
    if kind.startswith("jax"):
        return "jax"
    raise ConversionError(f"no conversion for models of kind {kind!r}")


# -- flat views of each framework's records ------------------------------------------------


def _torch_params(model: StateRecord) -> dict[str, TensorData]:
    item = model.item
    assert isinstance(item, dict) and isinstance(item.get("tensors"), dict)
    return dict(item["tensors"])  # type: ignore[arg-type]


def _jax_params(model: StateRecord) -> dict[str, TensorData]:
    assert isinstance(model.item, dict)
    return {k: v for k, v in model.item.items() if isinstance(v, TensorData)}


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


def _apply(t: TensorData, transform: str, like: TensorData | None = None) -> TensorData:
    """`t` transformed (and cast to `like`'s dtype), lazily: the work happens when the
    tensor is read, so a writer streams a conversion tensor by tensor."""
    dtype = like.dtype if like is not None else t.dtype
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
    item = opt.item
    assert isinstance(item, dict)
    groups, state = item["param_groups"], item["state"]
    assert isinstance(groups, list) and isinstance(state, dict)
    kind = opt.kind.lower()
    algo = "sgd" if kind.endswith(".sgd") else "adam" if kind.endswith((".adam", ".adamw")) else ""
    problems = [] if algo else [f"optimizer {opt.kind} has no optax counterpart here (SGD, Adam, AdamW)"]
    for g in groups:
        assert isinstance(g, dict)
        if g.get("amsgrad"):
            problems.append("AMSGrad: optax keeps the max of the bias-corrected nu, torch of the raw one")
        if g.get("maximize"):
            problems.append("maximize=True has no optax counterpart")
        if algo == "sgd" and g.get("dampening", 0):
            problems.append(f"SGD dampening={g['dampening']!r}: optax's trace has no dampening")
    steps = set()
    m: dict[str, TensorData] = {}
    v: dict[str, TensorData] = {}
    for pid, entry in state.items():
        assert isinstance(entry, dict)
        step = entry.get("step")
        if isinstance(step, TensorData):
            steps.add(int(float(step.array)))
        elif isinstance(step, (int, float)):
            steps.add(int(step))
        for src, dst in (("exp_avg", m), ("momentum_buffer", m), ("exp_avg_sq", v)):
            value = entry.get(src)
            if isinstance(value, TensorData):
                if np.iscomplexobj(value.array):
                    problems.append(f"{pid}: complex parameters")
                dst[pid] = value
    if len(steps) > 1:
        problems.append(f"per-parameter step counts disagree ({sorted(steps)}); optax keeps one count")
    if problems and not force:
        raise ConversionError("the optimizer's maths differ between the frameworks:\n  "
                              + "\n  ".join(problems) + "\n(force=True converts anyway)")
    return _Neutral(algo or "adam", max(steps) if steps else 0, m, v)


def _jax_optimizer(opt: StateRecord) -> _Neutral:
    assert isinstance(opt.item, dict)
    leaves = opt.item
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
    step = 0
    if count_key is not None:
        c = leaves[count_key]
        step = int(c.array) if isinstance(c, TensorData) else int(c)  # type: ignore[arg-type]
    if trace and not m:
        return _Neutral("sgd", step, trace, {})
    return _Neutral("adam", step, m, v)


def _to_jax_optimizer(n: _Neutral, template: StateRecord, inverse: dict[str, tuple[str, str]]) -> Item:
    assert isinstance(template.item, dict)
    out: dict[str, Item] = {}
    problems = []
    for key, like in template.item.items():
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
                    out[key] = _apply(source[src[0]], src[1], like if isinstance(like, TensorData) else None)
                break
        else:
            if key.endswith("count") and isinstance(like, TensorData):
                out[key] = TensorData.from_array(np.asarray(n.step, like.dtype.numpy))  # 0-d
            else:
                out[key] = like  # hyperparameters and empty states: the target's own
    if problems:
        raise ConversionError("optimizer state does not map:\n  " + "\n  ".join(problems))
    return out


def _to_torch_optimizer(n: _Neutral, template: StateRecord, inverse: dict[str, tuple[str, str]],
                        target_params: dict[str, TensorData]) -> Item:
    item = template.item
    assert isinstance(item, dict)
    groups = item["param_groups"]
    assert isinstance(groups, list)
    sgd = template.kind.lower().endswith(".sgd")
    state: dict[str, Item] = {}
    for g in groups:
        assert isinstance(g, dict) and isinstance(g["params"], list)
        for pid in g["params"]:
            assert isinstance(pid, str)
            src = inverse.get(pid)
            if src is None or src[0] not in n.m:
                continue  # no state yet for this parameter
            like = target_params[pid]
            if sgd:
                state[pid] = {"momentum_buffer": _apply(n.m[src[0]], src[1], like)}
            else:
                state[pid] = {"step": TensorData.from_array(np.asarray(float(n.step), np.float32)),
                              "exp_avg": _apply(n.m[src[0]], src[1], like),
                              "exp_avg_sq": _apply(n.v[src[0]], src[1], like)}
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


def _position(s: StateRecord | None) -> int | None:
    if s is None or not isinstance(s.item, dict):
        return None
    for key in ("last_epoch", "count"):
        value = s.item.get(key)
        if isinstance(value, int):
            return value
    return None


def _scheduler(source: StateRecord | None, template: StateRecord | None) -> StateRecord | None:
    if template is None:
        return None
    position = _position(source)
    if position is None:
        return template
    assert isinstance(template.item, dict)
    item = dict(template.item)
    if "count" in item:
        item["count"] = position
    else:
        item["last_epoch"] = position
        item["_step_count"] = position + 1
    return StateRecord(template.kind, item)


# -- the conversion ------------------------------------------------------------------------


def convert(source: TrainingRecord[Any], template: TrainingRecord[Any], *,
            rules: list[Rule] | None = None, force: bool = False,
            drop_rng: bool = False) -> TrainingRecord[Any]:
    """`source` converted into the framework, layout and structure of `template`.
    Raises `ConversionError` listing every problem (unmapped or mismatched tensors,
    optimizer maths that differ, RNG state) at once."""
    src_fw, dst_fw = framework_of(source), framework_of(template)
    if src_fw == dst_fw:
        raise ConversionError(f"both records are {src_fw}: nothing to convert")
    to_flax = dst_fw == "jax"
    src_params = _torch_params(source.model) if src_fw == "torch" else _jax_params(source.model)
    dst_params = _jax_params(template.model) if to_flax else _torch_params(template.model)
    mapping = _match_params(src_params, dst_params, to_flax, rules or [])
    new_params = {name: _apply(src_params[s], tr, dst_params[name]) for name, (s, tr) in mapping.items()}
    for name, t in dst_params.items():
        new_params.setdefault(name, t)  # num_batches_tracked: the template's
    if src_fw == "torch":
        native = source.model.item.get("grads") if isinstance(source.model.item, dict) else None
        if native and not force:
            raise ConversionError("the torch model holds gradients in .grad (native accumulation); "
                                  "move them into the accumulator, or force=True to drop them")
    if to_flax:
        model_item: Item = {k: new_params.get(k, v) for k, v in template.model.item.items()}  # type: ignore[union-attr]
        neutral = _torch_optimizer(source.optimizer, force)
        opt_item = _to_jax_optimizer(neutral, template.optimizer, mapping)
    else:
        t_item = template.model.item
        assert isinstance(t_item, dict)
        model_item = {"tensors": {k: new_params[k] for k in dst_params}, "aliases": t_item["aliases"],
                      "grads": {}}
        opt_item = _to_torch_optimizer(_jax_optimizer(source.optimizer), template.optimizer, mapping,
                                       dst_params)
    inverse_src = {s: (t, tr) for t, (s, tr) in mapping.items()}
    grads = {}
    for pid, g in source.grads.grads.items():
        if pid not in inverse_src:
            raise ConversionError(f"pending gradient {pid} has no target parameter")
        target_name, tr = inverse_src[pid]
        grads[target_name] = _apply(g, tr)
    whole = source.into_item(NativePrecisionSettings())
    assert isinstance(whole, list)
    state_item = _drop_rng(whole[4], drop_rng)
    return TrainingRecord(
        StateRecord(template.model.kind, check_item(model_item)),
        StateRecord(template.optimizer.kind, check_item(opt_item)),
        _scheduler(source.scheduler, template.scheduler),
        GradientsParamsRecord(grads),
        state_item,
        None,
    )

