"""The neutral form of torch records (`trainrec.convert.NeutralForm`); imports no torch.

Parameters (a module's leaf names; `M` is the module path):

| torch                          | neutral role                 | layout                    |
| ------------------------------ | ---------------------------- | ------------------------- |
| `M.weight` 1-D (LayerNorm, BN) | `norm.scale`                 | as is                     |
| `M.weight` 2-D (Linear)        | `dense.kernel`, `embedding`  | [out,in] transposed; as is|
| `M.weight` 3-5-D (ConvNd OI*)  | `conv.kernel`                | (*spatial, in, out)       |
| `M.bias`                       | `bias`                       | as is                     |
| `M.running_mean` / `_var`      | `norm.mean` / `norm.var`     | as is                     |
| `M.num_batches_tracked`        | `counter` (the template's)   |                           |

BatchNorm conventions differ between frameworks and are not converted: flax momentum
0.99 is torch momentum 0.1, flax keeps the biased running variance and torch the unbiased
one; the running values are copied as they are. LayerNorm eps: torch 1e-5, flax 1e-6.

Optimizers: `SGD` (its `momentum_buffer` is the neutral `momentum`; no step count),
`Adam` / `AdamW` (`exp_avg`, `exp_avg_sq`, `step`: first and second moments, the step).
Their maths (`trainrec.convert.MATHS`) are the param groups' values now, those of the next
update: `lr`, `betas`, `eps`, `momentum`, `nesterov`, `dampening`, `amsgrad`, `maximize`,
`weight_decay` (L2 added to the gradient for SGD and Adam, decoupled for AdamW or
`decoupled_weight_decay=True`), per group where the groups differ; no clipping (torch's
optimizers clip nothing). Refused (unless forced): another optimizer, per-parameter step
counts that disagree, complex parameters, gradients held in `.grad` (native accumulation).
The one `lr` of the param groups is the rate held as data.

Schedulers: the position is `last_epoch` (stepped by the caller, so it may differ from
the optimizer's step: a scheduler stepped per epoch, or with an offset). Schedulers that
keep more than `last_epoch` (SequentialLR, ChainedScheduler, CosineAnnealingWarmRestarts,
ReduceLROnPlateau) are refused. A torch target keeps the rate at the position (every
group's `lr`, the scheduler's `_last_lr`), which no record gives where the schedule moves
(it is code): `convert(lr=...)`, or a rate the source holds as data; without either, the
rate at the position is unknown. A OneCycleLR target with `cycle_momentum` sets the
momentum (or Adam's beta1) at the position, computed from its state as its `get_lr` does,
which the engine compares with the source's (a CyclicLR's cycled one is unknown).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainrec.adapter_kit import (
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
    as_list,
    as_map,
    out_in_weight,
    tensors_of,
)

__all__ = ["FORM", "TorchForm"]

# torch schedulers whose whole position is `last_epoch` (and `_step_count`); the others
# (SequentialLR, ChainedScheduler, CosineAnnealingWarmRestarts, ReduceLROnPlateau) keep more
POSITIONAL = frozenset(f"torch.optim.lr_scheduler.{name}" for name in (
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
    "PolynomialLR", "CosineAnnealingLR", "OneCycleLR", "CyclicLR"))
_MOMENTS = {"momentum_buffer": "momentum", "exp_avg": "first_moment", "exp_avg_sq": "second_moment"}


def _algorithm(kind: str) -> str:
    k = kind.lower()
    return "sgd" if k.endswith(".sgd") else "adam" if k.endswith((".adam", ".adamw")) else ""


def _collapsed(values: list[Item]) -> Item:
    """One value for every param group, or the list of them where they differ."""
    return values[0] if all(v == values[0] for v in values) else values


def _maths(kind: str, algo: str, groups: list[dict[str, Item]]) -> dict[str, Item]:
    """The update's `MATHS` (`trainrec.convert`), as the param groups hold them now: the
    values of the next update (a scheduler sets `lr`, and `momentum` or `betas` where it
    cycles them); per group where the groups differ. torch's optimizers clip nothing
    (`clip_grad_norm_` is the caller's code)."""
    def each(key: str, default: Item = None) -> Item:
        return _collapsed([_plain(g.get(key, default)) for g in groups]) if groups else default

    if not algo:
        return {}
    out: dict[str, Item] = {"lr": each("lr"), "maximize": each("maximize", False), "clip_norm": None,
                            "clip_value": None, "weight_decay": each("weight_decay", 0.0)}
    if algo == "sgd":
        out.update(momentum=each("momentum", 0.0), nesterov=each("nesterov", False),
                   dampening=each("dampening", 0.0), decoupled_weight_decay=False)
    else:
        betas = [g.get("betas") for g in groups]
        firsts = [b[0] if isinstance(b, list) and len(b) == 2 else None for b in betas]
        seconds = [b[1] if isinstance(b, list) and len(b) == 2 else None for b in betas]
        decoupled = kind.lower().endswith(".adamw")
        out.update(b1=_collapsed([_plain(v) for v in firsts]), b2=_collapsed([_plain(v) for v in seconds]),
                   eps=each("eps"), amsgrad=each("amsgrad", False),
                   decoupled_weight_decay=True if decoupled else each("decoupled_weight_decay", False))
    return out


def _plain(value: Item) -> Item:
    """A group's number as a float (a tensor lr or beta too), other values as they are."""
    if isinstance(value, TensorData) and value.shape in ((), (1,)):
        return float(value.array.reshape(()))
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


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
        g = as_map(group, f"template.optimizer.param_groups.{gi}")
        start_step = 0.0
        for i, phase in enumerate(phases):
            ph = as_map(phase, f"template.scheduler._schedule_phases.{i}")
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


class TorchForm:
    """torch records (`torch.nn.Module`, `torch.optim.*`, `torch.optim.lr_scheduler.*`)."""

    name = "torch"
    kinds = ("torch",)
    keeps_rate = True
    rng_markers = frozenset({"torch_cpu"})  # TorchRngRecord

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        return tensors_of(as_map(model.item, f"{role}.model").get("tensors"), f"{role}.model.tensors")

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        path, _, leaf = name.rpartition(".")
        if leaf == "weight":
            return out_in_weight(path, shape)
        role = {"bias": "bias", "running_mean": "norm.mean", "running_var": "norm.var",
                "num_batches_tracked": "counter"}.get(leaf)
        return [Neutral(path, role)] if role else []

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        return []

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        opt = record.optimizer
        item = as_map(opt.item, f"{role}.optimizer")
        groups = as_list(item.get("param_groups"), f"{role}.optimizer.param_groups")
        state = as_map(item.get("state"), f"{role}.optimizer.state")
        algo = _algorithm(opt.kind)
        problems = [] if algo else [f"optimizer {opt.kind} has no neutral form here (SGD, Adam, AdamW)"]
        if role == "source":
            native = record.model.item.get("grads") if isinstance(record.model.item, dict) else None
            if native:
                problems.append("the torch model holds gradients in .grad (native accumulation); move "
                                "them into the accumulator, or force=True to drop them")
        settings = _maths(opt.kind, algo, [as_map(g, f"{role}.optimizer.param_groups.{gi}")
                                           for gi, g in enumerate(groups)])
        rates = {g.get("lr") for g in groups if isinstance(g, dict)}
        steps = set()
        moments: dict[str, dict[str, TensorData]] = {}
        for pid, value in state.items():
            entry = as_map(value, f"{role}.optimizer.state.{pid}")
            step = entry.get("step")
            if isinstance(step, TensorData):
                if step.shape not in ((), (1,)) or step.dtype.numpy.kind not in "iuf":
                    raise ConversionError(f"{role}.optimizer.state.{pid}.step: expected one real number, "
                                          f"got a {step.dtype.value} tensor of shape {step.shape}")
                steps.add(int(float(step.array.reshape(()))))
            elif isinstance(step, (int, float)) and not isinstance(step, bool):
                steps.add(int(step))
            elif step is not None:
                raise ConversionError(f"{role}.optimizer.state.{pid}.step: expected a number, got {step!r}")
            for key, neutral in _MOMENTS.items():
                moment = entry.get(key)
                if isinstance(moment, TensorData):
                    if np.iscomplexobj(moment.array):
                        problems.append(f"{pid}: complex parameters")
                    moments.setdefault(pid, {})[neutral] = moment
        if len(steps) > 1:
            problems.append(f"per-parameter step counts disagree ({sorted(steps)}); the neutral form keeps one count")
        rate = rates.pop() if len(rates) == 1 else None
        lr = float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None
        step_count = max(steps) if steps else (None if algo == "sgd" else 0)
        return NeutralOptimizer(algo, step_count, moments, settings, lr, problems)

    def read_schedule(self, record: TrainingRecord[Any], role: str, problems: list[str]) -> list[ScheduleCount]:
        sched = record.scheduler
        if sched is None:
            return []
        item = as_map(sched.item, f"{role}.scheduler")
        if sched.kind not in POSITIONAL:
            problems.append(f"{role}.scheduler: a {sched.kind} keeps more than its last_epoch; "
                            "its position does not carry")
        where = f"{role}.scheduler.last_epoch"
        if role == "template":
            value = item.get("last_epoch")
            return [ScheduleCount(where, value if isinstance(value, int) else None, False)]
        return [ScheduleCount(where, as_count(item.get("last_epoch"), where), False)]

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        t_model = as_map(template.item, "template.model")
        return {"tensors": dict(params), "aliases": t_model.get("aliases"), "grads": {}}

    def write_state(self, template: TrainingRecord[Any], state: TargetState) -> tuple[Item, StateRecord | None]:
        item = as_map(template.optimizer.item, "template.optimizer")
        raw_groups = as_list(item.get("param_groups"), "template.optimizer.param_groups")
        rate = state.lr if state.lr is not None else state.source_lr
        lrs = None if rate is None else _rates(rate, len(raw_groups))
        scheduler, momenta = self._scheduler(template, state, raw_groups, lrs)
        key = "b1" if _algorithm(template.optimizer.kind) == "adam" else "momentum"
        if lrs is not None:
            state.values["lr"] = _collapsed(list(lrs))
        if momenta is not None:
            state.values[key] = _collapsed(list(momenta))
        groups: list[Item] = []
        for gi, group in enumerate(raw_groups):
            g = dict(as_map(group, f"template.optimizer.param_groups.{gi}"))
            if lrs is not None:
                g["lr"] = lrs[gi]
            if momenta is not None:
                betas = g.get("betas")
                if isinstance(betas, list) and betas:
                    g["betas"] = [momenta[gi], *betas[1:]]
                else:
                    g["momentum"] = momenta[gi]
            groups.append(g)
        target_params = self.parameters(template.model, "template")
        sgd = _algorithm(template.optimizer.kind) == "sgd"
        out: dict[str, Item] = {}
        for gi, group in enumerate(groups):
            where = f"template.optimizer.param_groups.{gi}.params"
            for pid in as_list(as_map(group, where).get("params"), where):
                if not isinstance(pid, str) or pid not in target_params:
                    raise ConversionError(f"{where}: {pid!r} is not a parameter of the template's model")
                like = target_params[pid]
                at = f"optimizer.state.{pid}"
                if sgd:
                    buf = state.moment(pid, "momentum", like, f"{at}.momentum_buffer")
                    if buf is not None:
                        out[pid] = {"momentum_buffer": buf}
                    continue
                m = state.moment(pid, "first_moment", like, f"{at}.exp_avg")
                v = state.moment(pid, "second_moment", like, f"{at}.exp_avg_sq")
                if m is not None and v is not None:
                    out[pid] = {"step": TensorData.from_array(np.asarray(float(state.step), np.float32)),
                                "exp_avg": m, "exp_avg_sq": v}
        return {"state": out, "param_groups": groups}, scheduler

    def _scheduler(self, template: TrainingRecord[Any], state: TargetState, groups: list[Item],
                   lrs: list[float] | None) -> tuple[StateRecord | None, list[float] | None]:
        """The template's scheduler at `state.position`, and the momentum a OneCycleLR sets there."""
        sched = template.scheduler
        if sched is None:
            return None, None
        item = dict(as_map(sched.item, "template.scheduler"))
        momenta = None
        momentum_key = "b1" if _algorithm(template.optimizer.kind) == "adam" else "momentum"
        if sched.kind not in POSITIONAL:
            return sched, None  # read_schedule said so
        position = state.position
        if position != item.get("last_epoch") and lrs is None:
            state.unknown["lr"] = (f"a {sched.kind} at last_epoch {position}: its rate there is code, "
                                   "which the records do not hold")
            state.problems.append(
                f"template.scheduler: a {sched.kind} at last_epoch {position} keeps each group's "
                "learning rate there, which the records do not give (the schedule is code); pass "
                f"lr= (the source schedule's rate at {position})")
        if (sched.kind.endswith(".OneCycleLR") and item.get("cycle_momentum")
                and position != item.get("last_epoch")):
            found = _one_cycle_momenta(item, groups, position)
            if isinstance(found, str):
                state.problems.append(f"template.scheduler: {found}: the momentum at {position} is unknown")
                state.unknown[momentum_key] = found
            else:
                momenta = found
        elif (sched.kind.endswith(".CyclicLR") and item.get("cycle_momentum")
                and position != item.get("last_epoch")):
            state.unknown[momentum_key] = (f"a CyclicLR cycles it: its value at {position} is its scale_fn's, "
                                           "which the records do not hold")
        item["last_epoch"], item["_step_count"] = position, position + 1
        if lrs is not None:
            item["_last_lr"] = list(lrs)
        return StateRecord(sched.kind, item), momenta


FORM = TorchForm()
