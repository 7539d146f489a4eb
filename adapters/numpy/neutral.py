"""The neutral form of the numpy reference adapter's records (`trainrec.convert.NeutralForm`).

Parameters: the `MLP`'s `layers.{i}.weight` ([out, in]: `dense.kernel` of module
`layers.{i}`, transposed) and `layers.{i}.bias` (`bias`). Optimizers: `SGD` (its
`momentum_buffer` is the neutral `momentum`; no step count), `Adam` / `AdamW` (`exp_avg`,
`exp_avg_sq`, per-parameter `step`s, which must agree); their `hyper` gives the update's
`MATHS` (torch's formulas: L2 weight decay for SGD and Adam, decoupled for AdamW; no
clipping), the scheduler the rate at its count. Schedulers: the position is `count`, stepped by the caller; the rate at it, for
the next step, is held as data where the schedule is one of this adapter's (its
configuration is in the record), so a target that keeps the rate (torch) needs no `lr=`.
A `ConstantLr` has no position that matters. The learning rate of a numpy target comes
from its own scheduler: `convert(lr=...)` is refused for it.
"""

from __future__ import annotations

from typing import Any

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
    as_map,
    tensors_of,
)

__all__ = ["FORM", "NumpyForm"]

_ALGORITHMS = {"trainrec.numpy.SGD": "sgd", "trainrec.numpy.Adam": "adam", "trainrec.numpy.AdamW": "adam"}
_MOMENTS = {"momentum_buffer": "momentum", "exp_avg": "first_moment", "exp_avg_sq": "second_moment"}


_NO_RATE = "the rate comes from a scheduler that is not one of this adapter's (or none: the caller's code)"


def _maths(kind: str, algo: str, hyper: dict[str, Item]) -> dict[str, Item]:
    """The update's `MATHS` (`trainrec.convert`) but the rate: torch's formulas (L2 weight
    decay for SGD and Adam, decoupled for AdamW), no clipping."""
    def number(key: str, default: float) -> Item:
        value = hyper.get(key, default)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    if not algo:
        return {}
    out: dict[str, Item] = {"maximize": False, "clip_norm": None, "clip_value": None,
                            "weight_decay": number("weight_decay", 0.0)}
    if algo == "sgd":
        out.update(momentum=number("momentum", 0.0), nesterov=bool(hyper.get("nesterov", False)),
                   dampening=number("dampening", 0.0), decoupled_weight_decay=False)
    else:
        out.update(b1=number("beta1", 0.9), b2=number("beta2", 0.999), eps=number("eps", 1e-8), amsgrad=False,
                   decoupled_weight_decay=kind == "trainrec.numpy.AdamW")
    return out


def _rate_at(scheduler: StateRecord, count: int) -> float | None:
    """The rate the numpy scheduler `scheduler` gives for the step at `count`, or None."""
    from . import schedulers

    kinds = {cls.kind: cls for cls in (schedulers.ConstantLr, schedulers.StepLr,
                                       schedulers.CosineAnnealingLr, schedulers.LinearWarmupCosineLr)}
    cls = kinds.get(scheduler.kind)
    item = scheduler.item
    config = item.get("config") if isinstance(item, dict) else None
    if cls is None or not isinstance(config, dict):
        return None
    live = cls.__new__(cls)
    live.config = {k: v for k, v in config.items() if isinstance(v, (int, float))}
    live.count = count
    try:
        return float(live.lr_at(count))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


class NumpyForm:
    """trainrec.numpy records: `MLP`, `SGD` / `Adam` / `AdamW`, the reference schedulers."""

    name = "trainrec.numpy"
    kinds = ("trainrec.numpy",)
    keeps_rate = False
    rng_markers: frozenset[str] = frozenset()

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        return tensors_of(model.item, f"{role}.model")

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2:
            return [Neutral(path, "dense.kernel", (1, 0))]
        return [Neutral(path, "bias")] if leaf == "bias" and len(shape) == 1 else []

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        return []

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        opt = record.optimizer
        item = as_map(opt.item, f"{role}.optimizer")
        hyper = as_map(item.get("hyper"), f"{role}.optimizer.hyper")
        state = as_map(item.get("state"), f"{role}.optimizer.state")
        algo = _ALGORITHMS.get(opt.kind, "")
        problems = [] if algo else [f"optimizer {opt.kind} has no neutral form here"]
        settings = _maths(opt.kind, algo, hyper)
        steps = set()
        moments: dict[str, dict[str, TensorData]] = {}
        for pid, value in state.items():
            entry = as_map(value, f"{role}.optimizer.state.{pid}")
            step = entry.get("step")
            if isinstance(step, (int, float)) and not isinstance(step, bool):
                steps.add(int(step))
            elif step is not None:
                raise ConversionError(f"{role}.optimizer.state.{pid}.step: expected a number, got {step!r}")
            for key, which in _MOMENTS.items():
                moment = entry.get(key)
                if isinstance(moment, TensorData):
                    moments.setdefault(pid, {})[which] = moment
        if len(steps) > 1:
            problems.append(f"per-parameter step counts disagree ({sorted(steps)}); the neutral form keeps one count")
        lr = None
        sched = record.scheduler
        if sched is not None and isinstance(sched.item, dict) and "count" in sched.item:
            lr = _rate_at(sched, as_count(sched.item["count"], f"{role}.scheduler.count"))
        unknown = {}
        if lr is None:
            unknown["lr"] = _NO_RATE
        else:
            settings["lr"] = lr
        step_count = max(steps) if steps else (None if algo == "sgd" else 0)
        return NeutralOptimizer(algo, step_count, moments, settings, lr, problems, unknown)

    def read_schedule(self, record: TrainingRecord[Any], role: str, problems: list[str]) -> list[ScheduleCount]:
        sched = record.scheduler
        if sched is None or (role == "source" and sched.kind == "trainrec.numpy.ConstantLr"):
            return []
        where = f"{role}.scheduler.count"
        return [ScheduleCount(where, as_count(as_map(sched.item, f"{role}.scheduler").get("count"), where), False)]

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        return {k: params.get(k, v) for k, v in as_map(template.item, "template.model").items()}

    def write_state(self, template: TrainingRecord[Any], state: TargetState) -> tuple[Item, StateRecord | None]:
        item = as_map(template.optimizer.item, "template.optimizer")
        hyper = as_map(item.get("hyper"), "template.optimizer.hyper")
        params = self.parameters(template.model, "template")
        algo = _ALGORITHMS.get(template.optimizer.kind, "")
        out: dict[str, Item] = {}
        for pid, like in params.items():
            at = f"optimizer.state.{pid}"
            if algo == "sgd" and hyper.get("momentum"):
                buf = state.moment(pid, "momentum", like, f"{at}.momentum_buffer")
                if buf is not None:
                    out[pid] = {"momentum_buffer": buf}
            elif algo == "adam":
                m = state.moment(pid, "first_moment", like, f"{at}.exp_avg")
                v = state.moment(pid, "second_moment", like, f"{at}.exp_avg_sq")
                if m is not None and v is not None:
                    out[pid] = {"step": float(state.step), "exp_avg": m, "exp_avg_sq": v}
        scheduler = template.scheduler
        if scheduler is not None:
            sched_item = dict(as_map(scheduler.item, "template.scheduler"))
            sched_item["count"] = state.position
            scheduler = StateRecord(scheduler.kind, sched_item)
        rate = None if scheduler is None else _rate_at(scheduler, state.position)
        if rate is None:
            state.unknown["lr"] = _NO_RATE
        else:
            state.values["lr"] = rate
        return {"hyper": dict(hyper), "state": out}, scheduler


FORM = NumpyForm()
