"""The neutral vocabulary conversion speaks (roles, moments, the maths fields) and what an
adapter's `NeutralForm` declares in it: `Neutral` tensors, `NeutralOptimizer`,
`ScheduleCount`, `TargetState`; with `ConversionError` and the record readers forms share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item
from ..training.record import TrainingRecord
from ..training.records import StateRecord
from .rule_syntax import Rule

# parameter roles, with their neutral layout (see spec/ADAPTERS.md, "Neutral forms")
ROLES = {
    "dense.kernel": "[in, out]; attention projections too, heads merged as (heads, head_dim)",
    "conv.kernel": "[*spatial, in, out]",
    "bias": "[out]",
    "norm.scale": "[features]",
    "embedding": "[num, dim]",
    "norm.mean": "[features] (batch-norm running mean)",
    "norm.var": "[features] (batch-norm running variance)",
    "counter": "never converted: the target keeps its template's",
}
MOMENTS = {"sgd": ("momentum",), "adam": ("first_moment", "second_moment")}
# what defines an optimizer's update (`NeutralOptimizer.settings`): each value is the one of
# the update at the schedule position; a list holds one value per param group where they differ
MATHS: dict[str, str] = {
    "lr": "the learning rate of the update at the position",
    "b1": "Adam's beta1 at the position (a schedule may cycle it: torch OneCycleLR's cycle_momentum)",
    "b2": "Adam's beta2",
    "eps": "Adam's epsilon, added to the square root of the second moment",
    "amsgrad": "Adam with AMSGrad's running maximum of the second moment",
    "momentum": "SGD's momentum at the position (0.0: none)",
    "nesterov": "SGD's nesterov momentum",
    "dampening": "SGD's dampening",
    "maximize": "the update ascends the objective",
    "weight_decay": "the weight decay factor (0.0: none); text where it is not one factor for every "
                    "parameter (optax's mask)",
    "decoupled_weight_decay": "True: decoupled from the gradient (torch AdamW, optax add_decayed_weights "
                              "after the algorithm's transform), False: L2 added to the gradient (torch Adam "
                              "and SGD, optax add_decayed_weights before it); compared where a side decays",
    "clip_norm": "the global norm the gradients are clipped to (None: none)",
    "clip_value": "the value each gradient element is clipped to (None: none)",
}
# the fields of each algorithm's update that a form must state (or say why it cannot)
FIELDS: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", "momentum", "nesterov", "dampening", "weight_decay", "decoupled_weight_decay", "maximize",
            "clip_norm", "clip_value"),
    "adam": ("lr", "b1", "b2", "eps", "amsgrad", "weight_decay", "decoupled_weight_decay", "maximize",
             "clip_norm", "clip_value"),
}
# their value where a form states none (forms written before the other fields were compared)
SETTINGS: dict[str, Item] = {"nesterov": False, "dampening": 0.0, "amsgrad": False, "maximize": False}


class ConversionError(RecorderError):
    """The record cannot be converted as asked; the message lists every problem."""


# -- the neutral vocabulary ------------------------------------------------------------------


@dataclass(frozen=True)
class Neutral:
    """A candidate neutral name for one of a form's tensors: the module `path` (dotted,
    "" for the model itself) and `role` (a key of `ROLES`), and how the tensor becomes the
    role's layout: `perm` (axes: neutral = own.transpose(perm); None keeps them), then
    `shape` (a reshape merging axes; None keeps the shape)."""

    path: str
    role: str
    perm: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown neutral role {self.role!r}; known: {sorted(ROLES)}")

    def _permuted(self, own: tuple[int, ...]) -> tuple[int, ...]:
        return own if self.perm is None else tuple(own[i] for i in self.perm)

    def neutral_shape(self, own: tuple[int, ...]) -> tuple[int, ...]:
        return self._permuted(own) if self.shape is None else self.shape

    def to_neutral(self, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if self.perm is not None:
            a = a.transpose(self.perm)
        return a if self.shape is None else a.reshape(self.shape)

    def from_neutral(self, a: np.ndarray[Any, Any], own: tuple[int, ...]) -> np.ndarray[Any, Any]:
        a = a.reshape(self._permuted(own))
        return a if self.perm is None else a.transpose(np.argsort(self.perm))



def out_in_weight(path: str, shape: tuple[int, ...]) -> list[Neutral]:
    """The candidates of a `weight` stored out-features first, as torch and equinox store
    it: 1-D a norm's scale, 2-D a dense kernel `[out, in]` (or an embedding), 3-5-D a conv
    kernel `(out, in, *spatial)`; none for other ranks."""
    rank = len(shape)
    if rank == 1:
        return [Neutral(path, "norm.scale")]
    if rank == 2:
        return [Neutral(path, "dense.kernel", (1, 0)), Neutral(path, "embedding")]
    if 3 <= rank <= 5:
        return [Neutral(path, "conv.kernel", (*range(2, rank), 1, 0))]
    return []

@dataclass
class NeutralOptimizer:
    """An optimizer record in neutral terms. `algorithm`: "sgd", "adam" (Adam and AdamW
    keep the same state) or "" (none this converts); `step`: the updates taken, None where
    the record keeps no count (SGD); `moments`: by the form's parameter name, the buffers
    of `MOMENTS[algorithm]` (a parameter without state yet is absent); `settings`: what
    defines the update, the `FIELDS[algorithm]` of `MATHS`, each at the record's schedule
    position (a list: one per param group, where they differ); `unknown`: a field the
    record cannot give, with why (a rate a caller's schedule function computes);
    `tolerance`: a field's absolute error where the form computes it less exactly than
    the framework does (an optax schedule, which optax computes in float32); `lr`: the
    learning rate of the next update where the record holds it as data (None: it holds
    none, or several), which a target that keeps the rate takes; `problems`: what the
    source's record says that the neutral form cannot (refused unless forced)."""

    algorithm: str
    step: int | None = None
    moments: dict[str, dict[str, TensorData]] = field(default_factory=dict)
    settings: dict[str, Item] = field(default_factory=dict)
    lr: float | None = None
    problems: list[str] = field(default_factory=list)
    unknown: dict[str, str] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ScheduleCount:
    """A schedule position a record keeps: `where` (the key, for messages), `value` (None
    where a template does not hold one yet) and whether it `counts_updates` (it advances
    with each optimizer update by construction, as an optax schedule inside the optimizer
    state) or is stepped by the caller (a torch scheduler)."""

    where: str
    value: int | None
    counts_updates: bool


@dataclass
class TargetState:
    """What the engine hands a target form's `write_state`: the algorithm (the template's
    fresh state is kept where it is "" or the moments were dropped), the update count
    `step`, the schedule `position`, the caller's `lr` (one rate or one per group, for a
    form that `keeps_rate`) and the source's `source_lr` (a rate held as data). The form
    appends what it cannot place to `problems` (refused unless `force`) and gets each
    parameter's moment from `moment`. In `values` it sets what the target will use at the
    position for the `MATHS` fields a schedule drives there (`lr`; `b1` or `momentum`
    where its schedule cycles them), in `unknown` those it cannot say, with why, and in
    `tolerance` their absolute error where it computes them less exactly than the
    framework does: the engine compares them with the source's. In `notes` it says what
    its files will not keep that the caller must know (Burn's optimizer settings, which
    the Burn program gives): the report's `unchecked` lines, shown without asking."""

    algorithm: str
    step: int
    position: int
    lr: float | Sequence[float] | None
    source_lr: float | None
    force: bool
    problems: list[str]
    _moment: Callable[[str, str, TensorData | None, str], TensorData | None]
    values: dict[str, Item] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # what the target's files will not keep: in the report

    def moment(self, param: str, which: str, like: TensorData | None, where: str) -> TensorData | None:
        """The source's moment `which` (a `MOMENTS` name) for the target parameter `param`,
        planned and cast to `like`'s dtype (lazily), or None where the source has none
        (it keeps no state before a parameter's first step: keep the template's)."""
        return self._moment(param, which, like, where)


@runtime_checkable
class NeutralForm(Protocol):
    """An adapter's records in the neutral vocabulary, both ways (spec/ADAPTERS.md,
    "Neutral forms"). `name`: the form's (and its entry point's) name; `kinds`: the model
    kind prefixes it claims; `keeps_rate`: True where a target keeps the learning rate
    at the schedule position as data (torch's param groups), so `convert(lr=...)` is for
    it; `rng_markers`: keys that mark a map in the caller's state as this framework's RNG
    state, which no other framework can use."""

    name: str
    kinds: tuple[str, ...]
    keeps_rate: bool
    rng_markers: frozenset[str]

    def parameters(self, model: StateRecord, role: str) -> dict[str, TensorData]:
        """The model record's tensors by name; `ConversionError` naming `role`.model... for
        a malformed one."""
        ...

    def candidates(self, name: str, shape: tuple[int, ...]) -> Sequence[Neutral]:
        """The neutral names tensor `name` may have, most likely first ([] for none)."""
        ...

    def preset_rules(self, source: str, target: str) -> Sequence[Rule]:
        """Rules this form adds when converting from form `source` to form `target` (one
        of them is this form), tried after the user's and before neutral names."""
        ...

    def read_optimizer(self, record: TrainingRecord[Any], role: str, force: bool) -> NeutralOptimizer:
        """The optimizer of `record` (the source, or the template) in neutral terms."""
        ...

    def read_schedule(self, record: TrainingRecord[Any], role: str,
                      problems: list[str]) -> list[ScheduleCount]:
        """The schedule positions `record` keeps (a template: the places it keeps one);
        appends to `problems` where a position does not say it all."""
        ...

    def write_model(self, template: StateRecord, params: dict[str, TensorData]) -> Item:
        """The template's model item with `params` (every template tensor, by name)."""
        ...

    def write_state(self, template: TrainingRecord[Any],
                    state: TargetState) -> tuple[Item, StateRecord | None]:
        """The template's optimizer item and scheduler record carrying `state`."""
        ...


def as_map(value: Item, key: str) -> dict[str, Item]:
    """`value` when it is a map; else `ConversionError` naming `key` (for forms)."""
    if not isinstance(value, dict):
        raise ConversionError(f"{key}: expected a map, got {type(value).__name__}")
    return value


def as_list(value: Item, key: str) -> list[Item]:
    """`value` when it is a list; else `ConversionError` naming `key`."""
    if not isinstance(value, list):
        raise ConversionError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def as_count(value: Item, key: str) -> int:
    """An integer count held as an int or a 0-d (or 1-element) integer tensor."""
    if isinstance(value, TensorData) and value.dtype.numpy.kind in "iu" and value.shape in ((), (1,)):
        return int(value.array.reshape(()))
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConversionError(f"{key}: expected an integer count, got {value!r}")


def tensors_of(item: Item, key: str) -> dict[str, TensorData]:
    """The tensors of a flat map of tensors (other values skipped)."""
    return {k: v for k, v in as_map(item, key).items() if isinstance(v, TensorData)}
