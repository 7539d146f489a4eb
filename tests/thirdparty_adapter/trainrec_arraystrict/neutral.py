"""The neutral form of this adapter's records, so that they convert to and from every
other adapter's (declared in pyproject.toml, entry-point group `trainrec.neutral`).

`Linear`'s `w` ([in, out]) is the model's `dense.kernel`, `b` its `bias`; `SGD` keeps
torch's momentum formula without dampening, nesterov or weight decay, and no step count;
the `StepSchedule`'s `count` is its position (the caller steps it; its rate is not in the
record, so a torch target needs `lr=`, and a target whose rate the engine would compare
needs `use_template=["lr"]`).
"""

from __future__ import annotations

from typing import Any

from trainrec import StateRecord, TensorData, TrainingRecord
from trainrec.adapter_kit import (
    Item,
    Neutral,
    NeutralOptimizer,
    Rule,
    ScheduleCount,
    TargetState,
    as_count,
    as_map,
    tensors_of,
)

ROLES = {"w": "dense.kernel", "b": "bias"}
_NO_RATE = "the StepSchedule's rate is not in its record (its count is)"


class ArrayStrictForm:
    name = "arraystrict"
    kinds = ("arraystrict",)
    keeps_rate = False
    rng_markers: frozenset[str] = frozenset()

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        return tensors_of(model.item, f"{role}.model")

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[Neutral]:
        return [Neutral("", ROLES[name])] if name in ROLES else []

    def preset_rules(self, source: str, target: str) -> list[Rule]:
        return []

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        item = as_map(record.optimizer.item, f"{role}.optimizer")
        buffers = tensors_of(item.get("buffers"), f"{role}.optimizer.buffers")
        momentum = item.get("momentum")
        maths: dict[str, Item] = {"nesterov": False, "dampening": 0.0, "maximize": False, "weight_decay": 0.0,
                                  "clip_norm": None, "clip_value": None,
                                  "momentum": float(momentum) if isinstance(momentum, (int, float)) else momentum}
        return NeutralOptimizer("sgd", None, {pid: {"momentum": t} for pid, t in buffers.items()}, maths,
                                unknown={"lr": _NO_RATE})

    def read_schedule(self, record: TrainingRecord[Any], role: str, problems: list[str]) -> list[ScheduleCount]:
        if record.scheduler is None:
            return []
        where = f"{role}.scheduler.count"
        return [ScheduleCount(where, as_count(as_map(record.scheduler.item, f"{role}.scheduler").get("count"),
                                              where), False)]

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        return {k: params.get(k, v) for k, v in as_map(template.item, "template.model").items()}

    def write_state(self, template: TrainingRecord[Any], state: TargetState) -> tuple[Item, StateRecord | None]:
        item = as_map(template.optimizer.item, "template.optimizer")
        buffers: dict[str, Item] = {}
        for pid, like in self.parameters(template.model, "template").items():
            buf = state.moment(pid, "momentum", like, f"optimizer.buffers.{pid}")
            if buf is not None:
                buffers[pid] = buf
        scheduler = template.scheduler
        if scheduler is not None:
            scheduler = StateRecord(scheduler.kind, {**as_map(scheduler.item, "template.scheduler"),
                                                     "count": state.position})
        state.unknown["lr"] = _NO_RATE
        return {"momentum": item.get("momentum"), "buffers": buffers}, scheduler


FORM = ArrayStrictForm()
