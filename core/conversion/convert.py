"""Converting a `TrainingRecord` between any two adapters, through neutral forms.

Conversion works on records, never on live objects, and needs no framework: the source
record, and a *template* record of the target, captured from a freshly built target run
(its model, optimizer and scheduler), which decides names, layouts, dtypes and the
optimizer's state structure, as transformers' pytorch<->flax conversion does.

Each adapter declares a `NeutralForm`: how its records read in a framework-neutral
vocabulary (parameter roles and layouts, optimizer algorithm, moments and step, schedule
position, a learning rate held as data) and how a template of its own takes neutral
values back. N adapters need N forms, not N^2 converters. The vocabulary, and what a
form must promise, are in `spec/ADAPTERS.md` ("Neutral forms"); the torch and JAX
forms (`trainrec.adapters.torch.neutral`, `trainrec.adapters.jax.neutral`) document
their own layouts and refusals.

Forms are found by the model kind of a record (`NeutralForm.kinds`, dotted prefixes):
first those given to `register_neutral_form` (newest first), then the entry points of the
group `trainrec.neutral`, whose name is the form's name (`acme =
"trainrec_acme.neutral:FORM"`; the bundled torch, JAX and numpy adapters declare theirs
there too), together with core's own Burn form (`_BUILTIN`; an entry point of the same
name replaces it): those whose name is a dotted prefix of the kind, longest first,
then the others. Loading a form imports no framework.

Parameters: every target tensor gets one `Plan` (`trainrec.conversion.rules`): user rules first
(a rule that matches but does not fit is a problem, and so is one that decides no tensor,
unless optional; drop rules drop source tensors, keep rules keep template tensors), then
the preset rules of the source and target forms (`NeutralForm.preset_rules`; a preset
that does not fit is skipped), then neutral names: a form gives candidate neutral names for each of its tensors (a torch
2-D `weight` may be a dense kernel or an embedding: the record does not say); the first
candidate the target also has, with the same shape in the neutral layout, wins.
Optimizer moments and pending gradients go through the same plans (a plan made from
several sources needs each one's moment). Tensors of role `counter` are never converted:
the target keeps its template's.

Optimizers: the source's and the template's algorithms ("sgd", "adam") must agree, else a
`ConversionError` unless `force=True` (which keeps the template's fresh state). The
update's maths must match: every `MATHS` field (`FIELDS[algorithm]`: rate, betas, eps,
momentum, nesterov, dampening, AMSGrad, maximize, weight decay and whether it is
decoupled, clipping), each at the schedule position, the target's as its form computes
it there (`TargetState.values`); a difference, or a value a side cannot give, is refused
naming the field and both values, unless the caller lists the field in `use_template`
(then the template's value is used, and the `ConversionReport` says so). `force=True`
never passes over the maths.

Schedules: the position goes to the places the target keeps one. A position that its
optimizer's steps cannot confirm (a scheduler the caller steps, while the template's
schedule counts updates), a position the target has no place for, or a target schedule
without a source position are refused unless `force=True`. The values a schedule drives
at the position (the rate; beta1 or momentum where it cycles them) are maths fields.

Dtypes: values are cast to the template's dtypes (pending gradients to the template's
pending dtype, else its parameter's); where a cast changes a value (f32 weights into a
bfloat16 template; checked exactly, `precision.is_lossless`), conversion refuses unless
`allow_lossy=True`. The caller's state comes back typed as the source's `state_type`,
else the template's, where it rebuilds as one.

A malformed record is a `ConversionError` naming the key; a malformed rules file a
`ValueError` naming the rule (CLI: exit 3). Framework RNG states cannot be converted: a
caller state holding one is refused unless `drop_rng=True`, which replaces it by None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item, check_item, map_tree
from ..precision import NativePrecisionSettings, is_lossless
from ..training.gradients import GradientsParamsRecord
from ..training.record import TrainingRecord
from ..training.records import StateRecord
from .rules import TRANSFORMS, Plan, Rule, RulesResult, _forms_named, apply_rules, load_rules

__all__ = ["ConversionError", "Rule", "load_rules", "convert", "framework_of", "TRANSFORMS",
           "NeutralForm", "Neutral", "NeutralOptimizer", "out_in_weight", "ScheduleCount", "TargetState",
           "ROLES", "MOMENTS", "SETTINGS", "MATHS", "FIELDS", "register_neutral_form", "form_for", "as_map",
           "as_list", "as_count", "tensors_of", "ConversionReport", "convert_with_report", "form_names",
           "FORM_ALIASES"]

ENTRY_POINT_GROUP = "trainrec.neutral"

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
_RTOL = 1e-6  # numbers agree to float32's precision (with room for libraries' cos and pow in the last bits)
# adapters' names (and other common names) of neutral forms, for rules' `from` / `to`
FORM_ALIASES: dict[str, str] = {"flax": "jax", "flax.linen": "jax", "linen": "jax", "nnx": "flax.nnx",
                                "eqx": "equinox", "numpy": "trainrec.numpy", "pytorch": "torch"}


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


# -- finding forms ---------------------------------------------------------------------------

_registered: list[NeutralForm] = []
_loaded: dict[str, NeutralForm] = {}
# core's own form (Burn's records, which core reads and writes itself), after every
# registered and entry-point form; the bundled adapters' forms are entry points (pyproject)
_BUILTIN: dict[str, str] = {
    "burn": "trainrec.conversion.burn_neutral:FORM",
}


def register_neutral_form(form: NeutralForm) -> None:
    """Make `form` the first candidate for records whose model kind it claims."""
    if not isinstance(form, NeutralForm):
        raise TypeError("a neutral form needs name, kinds, keeps_rate, rng_markers and the methods "
                        "of trainrec.conversion.convert.NeutralForm")
    _registered.insert(0, form)


def _claims(form: NeutralForm, kind: str) -> bool:
    return any(kind == p or kind.startswith(p + ".") for p in form.kinds)


def _load(ep: Any) -> NeutralForm:
    if ep.name not in _loaded:
        loaded = ep.load()
        form = loaded() if isinstance(loaded, type) else loaded
        if not isinstance(form, NeutralForm):
            raise TypeError(f"entry point {ep.name} = {ep.value} in {ENTRY_POINT_GROUP} is not a NeutralForm")
        _loaded[ep.name] = form
    return _loaded[ep.name]


def form_for(record: TrainingRecord[Any], role: str = "record") -> NeutralForm:
    """The neutral form claiming `record`'s model kind (see the module docstring for the
    order); `ConversionError` naming the kinds where none does."""
    kind = record.model.kind
    for form in _registered:
        if _claims(form, kind):
            return form
    eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    eps += [metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in _BUILTIN.items()
            if name not in {ep.name for ep in eps}]
    prefixes = sorted((ep for ep in eps if kind == ep.name or kind.startswith(ep.name + ".")),
                      key=lambda ep: -len(ep.name))
    for ep in prefixes + [ep for ep in eps if ep not in prefixes]:
        found = _load(ep)
        if _claims(found, kind):
            return found
    kinds = [record.model.kind, record.optimizer.kind] + ([record.scheduler.kind] if record.scheduler else [])
    raise ConversionError(
        f"no conversion for models of kind {kind!r}: no neutral form claims the {role}'s kinds {kinds}; "
        f"register one with trainrec.register_neutral_form(form), or declare it in the entry-point "
        f"group {ENTRY_POINT_GROUP!r} (name = the form's name), as spec/ADAPTERS.md (Neutral forms) says")


def form_names() -> set[str]:
    """The names of the neutral forms there are: registered, entry points, built in."""
    return ({f.name for f in _registered} | {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
            | set(_BUILTIN))


def framework_of(record: TrainingRecord[Any]) -> str:
    """The name of the neutral form of `record` ("torch", "jax", "trainrec.numpy", ...)."""
    return form_for(record).name


# -- plans -----------------------------------------------------------------------------------


def _relayout(src: Neutral, dst: Neutral, dst_shape: tuple[int, ...]) -> Callable[[Sequence[Any]], Any]:
    return lambda arrays: dst.from_neutral(src.to_neutral(arrays[0]), dst_shape)


@dataclass
class ConversionReport:
    """What a conversion did (`convert_with_report`; `trainrec convert --explain`).

    `source`, `target`: the forms' names. `tensors`: (target tensor, its sources, how) for
    every template tensor made, by a rule (its file and index) or by neutral names;
    `dropped`: source tensor -> the drop rule; `kept`: template tensor -> why it keeps the
    template's value (a keep rule, or a `counter`); `rules`: one line per rule given or
    preset, saying what it did; `template_values`: the `MATHS` fields where the template's
    value is used (`use_template`), with both values; `unchecked`: what nothing could
    check (an `lr=` the source cannot confirm); `forced`: what `force=True` converted
    anyway; `rounded`: what `allow_lossy=True` rounded; `state`: how the caller's state is
    typed."""

    source: str
    target: str
    tensors: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    rules: list[str] = field(default_factory=list)
    template_values: dict[str, str] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)
    forced: list[str] = field(default_factory=list)
    rounded: list[str] = field(default_factory=list)
    state: str = ""

    def notes(self) -> list[str]:
        """The lines a caller should see even without asking: the template's values used,
        what was not checked, forced and rounded."""
        out = [f"{k}: the template's value is used ({v})" for k, v in self.template_values.items()]
        out += [f"{k}: {v}" for k, v in self.unchecked.items()]
        out += [f"forced: {line}" for line in self.forced]
        out += [f"rounded: {line}" for line in self.rounded]
        return out

    def lines(self) -> list[str]:
        """The whole report, one fact a line."""
        out = [f"{self.source} -> {self.target}"]
        out += [f"rule {line}" for line in self.rules]
        for target, sources, how in self.tensors:
            out.append(f"{target} <- {', '.join(sources)}: {how}")
        out += [f"dropped {name}: {why}" for name, why in self.dropped.items()]
        out += [f"kept {name}: {why}" for name, why in self.kept.items()]
        out += self.notes()
        if self.state:
            out.append(f"state: {self.state}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _rule_lines(done: RulesResult, rules: Sequence[Rule], frameworks: tuple[str, str], preset: bool) -> list[str]:
    made: dict[int, list[str]] = {}
    index = {id(r): i for i, r in enumerate(rules)}
    for plan in done.plans.values():
        if plan.rule is not None and id(plan.rule) in index:
            made.setdefault(index[id(plan.rule)], []).append(f"{plan.target} <- {', '.join(plan.sources)}")
    for name, rule in done.dropped.items():
        made.setdefault(index[id(rule)], []).append(f"dropped {name}")
    for name, rule in done.kept.items():
        made.setdefault(index[id(rule)], []).append(f"kept {name}")
    unused = {i: why for i, _, why in done.unused}
    out = []
    skipped = {i for i, _ in done.skipped}
    for i, rule in enumerate(rules):
        what = rule.describe(i)
        if i in made:
            out.append(f"{what}: " + "; ".join(made[i]))
        elif i in skipped:
            if not preset:
                out.append(f"{what}: not for {frameworks[0]} -> {frameworks[1]} (from {rule.from_ or 'any'}, "
                           f"to {rule.to or 'any'})")
        elif i in unused:
            out.append(f"{what}: decided no tensor ({unused[i]})")
        elif not preset:
            out.append(f"{what}: decided no tensor (optional)")
    return out


def _plan(src: NeutralForm, dst: NeutralForm, source: dict[str, TensorData], target: dict[str, TensorData],
          rules: Sequence[Rule], problems: list[str], report: ConversionReport) -> dict[str, Plan]:
    """One plan per target tensor that is not a `counter` or kept; what does not map goes
    to `problems`, what was decided how to `report`."""
    src_shapes = {k: t.shape for k, t in source.items()}
    dst_shapes = {k: t.shape for k, t in target.items()}
    frameworks = (src.name, dst.name)
    done = apply_rules(rules, src_shapes, dst_shapes, frameworks=frameworks, strict=True)
    problems += done.problems
    problems += [f"{rule.describe(i)} decided no tensor: {why} (mark it \"optional\": true where that is "
                 "expected)" for i, rule, why in done.unused]
    report.rules += _rule_lines(done, rules, frameworks, preset=False)
    at = {id(r): i for i, r in enumerate(rules)}
    report.dropped.update({k: r.describe(at[id(r)]) for k, r in done.dropped.items()})
    report.kept.update({k: r.describe(at[id(r)]) for k, r in done.kept.items()})
    plans = dict(done.plans)
    presets = [*src.preset_rules(src.name, dst.name), *dst.preset_rules(src.name, dst.name)]
    if presets:
        used = {s for p in plans.values() for s in p.sources} | set(done.dropped)
        more = apply_rules(presets, {k: v for k, v in src_shapes.items() if k not in used},
                           {k: v for k, v in dst_shapes.items() if k not in plans and k not in done.kept},
                           frameworks=frameworks, strict=False)
        problems += more.problems
        report.rules += [f"(preset) {line}" for line in _rule_lines(more, presets, frameworks, preset=True)]
        plans.update(more.plans)
    used = {s for p in plans.values() for s in p.sources} | set(done.dropped)
    counters = set()
    index: dict[tuple[str, str], list[tuple[str, Neutral]]] = {}
    for name, shape in dst_shapes.items():
        for c in dst.candidates(name, shape):
            if c.role == "counter":
                counters.add(name)
            elif name not in plans and name not in done.kept:
                index.setdefault((c.path, c.role), []).append((name, c))
    for name, shape in src_shapes.items():
        if name in used:
            continue
        cands = list(src.candidates(name, shape))
        if any(c.role == "counter" for c in cands):
            continue
        mismatched = []
        placed = False
        for c in cands:
            have = c.neutral_shape(shape)
            for t, tc in index.get((c.path, c.role), []):
                if t in plans:
                    continue
                want = tc.neutral_shape(dst_shapes[t])
                if have == want:
                    plans[t] = Plan(t, (name,), dst_shapes[t], _relayout(c, tc, dst_shapes[t]),
                                    f"{name} -> {c.role} of {c.path or 'the model'!r} -> {t}")
                    placed = True
                    break
                mismatched.append(f"{name} -> {t}: shape {have} as {c.role}, target has {want}")
            if placed:
                break
        if not placed:
            named = [f"{c.role} of {c.path or 'the model'!r}" for c in cands]
            problems.extend(mismatched or [f"{name}: no target among {named or 'its neutral names (none)'}"
                                           " (a {\"drop\": ...} rule drops it)"])
    for name in dst_shapes:
        if name not in plans and name not in counters and name not in done.kept:
            problems.append(f"target {name}: no source tensor maps to it (a {{\"keep\": ...}} rule keeps "
                            "the template's)")
    for name in sorted(counters - set(plans)):
        report.kept[name] = "a counter (never converted)"
    if problems and done.skipped:
        problems.append(f"{len(done.skipped)} of the rules given are not for {src.name} -> {dst.name} and were "
                        "not tried: " + ", ".join(f"{r.describe(i)} (from {r.from_ or 'any'}, to {r.to or 'any'})"
                                                  for i, r in done.skipped))
    for name, plan in plans.items():
        report.tensors.append((name, plan.sources, plan.why if plan.rule is not None else "neutral names"))
    return plans


def _apply(plan: Plan, tensors: Sequence[TensorData], like: TensorData | None = None,
           lossy: list[str] | None = None, where: str = "") -> TensorData:
    """`plan` applied to `tensors` (and cast to `like`'s dtype), lazily: the work happens
    when the tensor is read, so a writer streams a conversion tensor by tensor. A cast to
    another dtype is checked now (the sources read once): where it changes values, `where`
    goes to `lossy`."""
    dtype = like.dtype if like is not None else tensors[0].dtype
    if lossy is not None and any(t.dtype is not dtype for t in tensors):
        out = TensorData.from_array(_run(plan, tensors, where), copy=False)
        if not is_lossless(out, dtype):
            lossy.append(f"{where} ({tensors[0].dtype.value} -> {dtype.value})")

    def load() -> np.ndarray[Any, Any]:
        arr = _run(plan, tensors, where)
        return arr.astype(dtype.numpy) if arr.dtype != dtype.numpy else arr

    return TensorData(dtype, plan.shape, load)


def _run(plan: Plan, tensors: Sequence[TensorData], where: str) -> np.ndarray[Any, Any]:
    """`plan.fn` on the sources' values, checked: a transform that fails, or returns
    anything but a numeric array of the target's shape, is a `ConversionError` naming the
    target and the rule, never a wrongly shaped tensor written under the target's name."""
    try:
        out = plan.fn([t.read() for t in tensors])
    except RecorderError:
        raise
    except Exception as e:  # a user's transform failing on real values
        raise ConversionError(f"{where or plan.target}: {plan.why} failed ({type(e).__name__}: {e})") from e
    if not isinstance(out, np.ndarray) or out.dtype.kind in "OSUmM" or tuple(out.shape) != plan.shape:
        got = (f"{out.dtype} {list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ConversionError(f"{where or plan.target}: {plan.why} gave {got}, the target is "
                              f"{list(plan.shape)}")
    return np.asarray(out, order="C")  # C order, and a 0-d array stays 0-d


def _sourced(plan: Plan, found: dict[str, TensorData], what: str, problems: list[str],
             where: str) -> list[TensorData] | None:
    """The tensors of `plan`'s sources in `found`; None where none has one, or where some
    lack it (then a problem)."""
    have = [s for s in plan.sources if s in found]
    if not have:
        return None
    if len(have) < len(plan.sources):
        missing = [s for s in plan.sources if s not in found]
        problems.append(f"{where}: {plan.target} is made from {list(plan.sources)}, and {missing} "
                        f"have no {what}")
        return None
    return [found[s] for s in plan.sources]


# -- the conversion --------------------------------------------------------------------------


def _drop_rng(item: Item, drop: bool, markers: frozenset[str], framework: str, path: str = "state") -> Item:
    def visit(where: str, node: Any) -> Any:
        if isinstance(node, dict) and markers & set(node):
            if not drop:
                raise ConversionError(
                    f"{where} holds {framework} RNG state, which the target framework cannot use; "
                    "convert with drop_rng=True (--drop-rng) to drop it")
            return None
        return node

    dropped: Item = map_tree(item, visit, path)
    return dropped


def _position(src: NeutralForm, counts: list[ScheduleCount], places: list[ScheduleCount],
              step: int | None, problems: list[str]) -> int:
    """The schedule position for the target; what does not carry goes to `problems`."""
    if not counts:
        if places and (step or 0) > 0:
            problems.append(f"the template schedules its learning rate ({', '.join(p.where for p in places)}), "
                            f"the source has no schedule position after {step} steps")
        return step or 0
    found = {c.where: c.value for c in counts if c.value is not None}
    if not found:
        return step or 0
    if len(set(found.values())) > 1:
        problems.append(f"the source's schedule counts disagree ({found})")
    position = max(found.values())
    where = min(k for k, v in found.items() if v == position)
    caller_stepped = not any(c.counts_updates for c in counts if c.where == where)
    updates_counted = [p.where for p in places if p.counts_updates]
    if caller_stepped and updates_counted and position != step:
        took = (f"the optimizer took {step} steps" if step is not None
                else "the optimizer keeps no step count to confirm it (SGD)")
        problems.append(f"{where} = {position} but {took} (the {src.name} scheduler is not stepped once "
                        f"per update, or cannot be shown to be), and the template's schedule counts updates "
                        f"({', '.join(updates_counted)}): its rates would differ")
    if not places and position > 0:
        problems.append(f"{where} = {position}: the template has no schedule to carry it")
    return position


def _refusal(heading: str, problems: list[str], hint: str = "") -> str:
    return heading + ":\n  " + "\n  ".join(problems) + (f"\n({hint})" if hint else "")


def _same(a: Item, b: Item, atol: float = 0.0) -> bool:
    """Whether two `MATHS` values agree: numbers to `_RTOL` relative (and `atol`), a list
    per param group element by element (a single value agrees with a list of it)."""
    if isinstance(a, list) or isinstance(b, list):
        xs = a if isinstance(a, list) else [a] * (len(b) if isinstance(b, list) else 1)
        ys = b if isinstance(b, list) else [b] * len(xs)
        return len(xs) == len(ys) and all(_same(x, y, atol) for x, y in zip(xs, ys))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= _RTOL * max(abs(a), abs(b)) + atol
    return a == b


def _decays(value: Item) -> bool:
    if isinstance(value, list):
        return any(_decays(v) for v in value)
    return value is not None and value != 0


def _shown(value: Item) -> str:
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "] (per param group)"
    return repr(value)


def _maths(algorithm: str, src: NeutralOptimizer, dst: NeutralOptimizer, state: TargetState,
           caller_lr: bool, use_template: Sequence[str], position: int | None,
           report: ConversionReport) -> list[tuple[str | None, str]]:
    """Where the update the target will make at `position` differs from the source's, or
    cannot be shown to agree: (the field `use_template` takes, or None, and the line), one
    per `MATHS` field (`use_template` fields: in the report instead). `position`: the
    schedule's, None where neither side schedules."""
    def stated(opt: NeutralOptimizer | TargetState, base: dict[str, Item], key: str) -> tuple[bool, Item, str]:
        if key in opt.unknown or "*" in opt.unknown:
            return False, None, opt.unknown.get(key, opt.unknown.get("*", ""))
        if key in base:
            return True, base[key], ""
        if key in SETTINGS:
            return True, SETTINGS[key], ""
        return False, None, "its neutral form does not say"

    target = {**dst.settings, **state.values}
    unknown_dst = {**dst.unknown, **state.unknown}
    for k in state.values:
        if k not in state.unknown:
            unknown_dst.pop(k, None)
    dst_view = NeutralOptimizer(dst.algorithm, settings=target, unknown=unknown_dst)
    tolerance = {**dst.tolerance, **state.tolerance}
    out: list[tuple[str | None, str]] = []
    # coupled or decoupled matters where both decay (else weight_decay differs, and says it)
    decays = all(_decays(o.settings.get("weight_decay")) for o in (src, dst_view))
    for key in FIELDS.get(algorithm, ()):
        if key == "decoupled_weight_decay" and not decays:
            continue
        have_a, a, why_a = stated(src, src.settings, key)
        have_b, b, why_b = stated(dst_view, target, key)
        label = f"{key} at position {position}" if key in ("lr", "b1", "momentum") and position is not None else key
        at = f" at position {position}" if position is not None else ""
        if have_a and have_b and _same(a, b, max(src.tolerance.get(key, 0.0), tolerance.get(key, 0.0))):
            continue
        if key == "lr" and caller_lr and not have_a:
            report.unchecked["lr"] = (f"the rate lr= gives, {_shown(b)}, is not checked (the source does not "
                                      f"say its rate{at}: {why_a})")
            continue
        if key == "lr" and caller_lr:
            out.append((None, f"{label}: lr= gives {_shown(b)}, the source's is {_shown(a)}: give the source's "
                              "rate (lr= is for a rate the source cannot give)"))
            continue
        text = (f"the source's {_shown(a) if have_a else f'is unknown ({why_a})'}, "
                f"the template's {_shown(b) if have_b else f'is unknown ({why_b})'}")
        if key in use_template:
            report.template_values[key] = text
        else:
            out.append((key, f"{label}: {text}"))
    return out


def convert(source: TrainingRecord[Any], template: TrainingRecord[Any], *,
            rules: list[Rule] | None = None, force: bool = False,
            drop_rng: bool = False, lr: float | Sequence[float] | None = None,
            allow_lossy: bool = False, use_template: Sequence[str] = ()) -> TrainingRecord[Any]:
    """`source` converted into the framework, layout and structure of `template`; its
    caller's state typed as the source's `state_type` (else the template's) where one
    was given and the state rebuilds as it.

    Every template tensor is made by a rule (user `rules` first, then the forms' presets)
    or by neutral names; a tensor neither side can place is refused, and so is a user rule
    that decides no tensor (unless it is `optional`). `{"drop": ...}` rules drop source
    tensors, `{"keep": ...}` rules keep template tensors (spec/CONVERSION.md).

    The optimizer's maths must match (`MATHS`: algorithm, learning rate, betas, eps,
    momentum and nesterov, weight decay coupled or decoupled and its factor, AMSGrad,
    clipping): any difference, or a value one side cannot give, is refused naming the
    field and both values, unless the field is in `use_template` (then the template's value
    is used; `convert_with_report` says so). The values a schedule drives (the learning
    rate; beta1 or momentum where it cycles them) are compared at the converted position.

    The learning-rate schedule's position (a torch `last_epoch`, a scheduler's count, or
    the count of a schedule inside optax) goes to the target's schedule. A target that
    keeps the rate itself (torch: each group's `lr`, the scheduler's `_last_lr`) takes it
    from `lr` (one rate, or one per param group: the value the target's own scheduler
    has at the position), else from a rate the source holds as data; an `lr` that
    disagrees with the rate the source gives at the position is refused.

    Raises `ConversionError` listing every problem (unmapped or mismatched tensors,
    optimizer maths that differ, a schedule position the target cannot hold or whose
    rate is not given, narrowing casts, RNG state) at once; `force=True` converts anyway
    where the algorithms or the schedule's position differ (never the maths: those are
    `use_template`'s). A template dtype narrower than the source's (f32 weights, moments
    or pending gradients into a bfloat16 template) is refused where the cast changes a
    value (checked exactly, `trainrec.precision.is_lossless`) unless `allow_lossy=True`,
    which rounds them; pending gradients take the template's pending dtype, else its
    parameter's. `ValueError` for an `lr` that is not a rate per group, or given for a
    target that computes its rate from the schedule position, for a `use_template` field
    that is not one of `MATHS`, and for rules naming no neutral form (`from` / `to`).
    `TypeError` for `rules` that are not a list of `Rule`s (a path or a preset's name:
    `load_rules` reads it).
    """
    return convert_with_report(source, template, rules=rules, force=force, drop_rng=drop_rng, lr=lr,
                               allow_lossy=allow_lossy, use_template=use_template)[0]


def convert_with_report(source: TrainingRecord[Any], template: TrainingRecord[Any], *,
                        rules: list[Rule] | None = None, force: bool = False,
                        drop_rng: bool = False, lr: float | Sequence[float] | None = None,
                        allow_lossy: bool = False,
                        use_template: Sequence[str] = ()) -> tuple[TrainingRecord[Any], ConversionReport]:
    """`convert`, and the `ConversionReport` of what it did (which rule made which tensor,
    what was dropped and kept, the template's values used, what was forced or rounded)."""
    if rules is not None and (isinstance(rules, (str, Rule)) or not all(isinstance(r, Rule) for r in rules)):
        raise TypeError(f"rules must be a list of trainrec.conversion.rules.Rule, got {rules!r:.80}; "
                        "load_rules(path or preset name) reads a rules file")
    if isinstance(use_template, str) or not all(isinstance(f, str) for f in use_template):
        raise TypeError(f"use_template must be a list of field names, got {use_template!r:.80}")
    unknown_fields = sorted(set(use_template) - set(MATHS))
    if unknown_fields:
        raise ValueError(f"use_template: {unknown_fields} are not fields of the optimizer's maths; "
                         f"known: {sorted(MATHS)}")
    user_rules = _forms_named(list(rules or []), "rules")
    src, dst = form_for(source, "source"), form_for(template, "template")
    if src.name == dst.name:
        raise ConversionError(f"both records are {src.name}: nothing to convert")
    if lr is not None and not dst.keeps_rate:
        raise ValueError(f"lr is for torch targets (and others that keep the rate as data): {dst.name} "
                         "computes its rate from the schedule count")
    report = ConversionReport(src.name, dst.name)
    refusals: list[str] = []  # never forced
    forceable: list[str] = []
    src_params = src.parameters(source.model, "source")
    dst_params = dst.parameters(template.model, "template")
    param_problems: list[str] = []
    plans = _plan(src, dst, src_params, dst_params, user_rules, param_problems, report)
    if param_problems:
        refusals.append(_refusal("parameters do not map", param_problems))
    lossy: list[str] = []
    new_params = {name: _apply(plan, [src_params[s] for s in plan.sources], dst_params[name], lossy,
                               f"model.{name}") for name, plan in plans.items()}
    params = {name: new_params.get(name, t) for name, t in dst_params.items()}  # counters, kept: the template's

    src_opt = src.read_optimizer(source, "source", force)
    dst_opt = dst.read_optimizer(template, "template", force)
    if src_opt.problems:
        forceable.append(_refusal("the source does not convert as it is", src_opt.problems,
                                  "force=True converts anyway"))
    algorithm, moments = src_opt.algorithm, src_opt.moments
    same_algorithm = bool(algorithm) and dst_opt.algorithm == algorithm
    if moments and dst_opt.algorithm != algorithm:
        forceable.append(f"the source optimizer keeps {algorithm or 'unconvertible'} state, the template's "
                         f"({template.optimizer.kind}) {dst_opt.algorithm or 'no state this converts'}: build "
                         "the target with the same algorithm (force=True keeps the template's fresh state)")
        algorithm, moments = dst_opt.algorithm, {}

    schedule: list[str] = []
    counts = src.read_schedule(source, "source", schedule)
    places = dst.read_schedule(template, "template", schedule)
    position = _position(src, counts, places, src_opt.step, schedule)
    state_problems: list[str] = []

    def moment(param: str, which: str, like: TensorData | None, where: str) -> TensorData | None:
        plan = plans.get(param)
        if plan is None:
            return None  # unmapped (listed above), or kept
        found = {s: m[which] for s, m in moments.items() if which in m}
        tensors = _sourced(plan, found, which, state_problems, where)
        return None if tensors is None else _apply(plan, tensors, like, lossy, where)

    step = src_opt.step if src_opt.step is not None else position
    state = TargetState(algorithm, step, position, lr, src_opt.lr, force, schedule, moment)
    opt_item, scheduler = dst.write_state(template, state)
    report.unchecked.update(state.notes)
    if same_algorithm:
        maths = _maths(algorithm, src_opt, dst_opt, state, lr is not None, use_template,
                       position if counts or places else None, report)
        if maths:
            fields = sorted({f for f, _ in maths if f is not None})
            hint = f"use_template={fields!r} converts with the template's values" if fields else ""
            refusals.append(_refusal("the optimizer's maths differ between the source and the template",
                                     [line for _, line in maths], hint))
    if schedule:
        forceable.append(_refusal("the learning-rate schedule does not carry over", schedule,
                                  "force=True converts anyway: the template's rates, the position where it fits"))
    model_item = dst.write_model(template.model, params)

    by_source: dict[str, list[str]] = {}
    for name, plan in plans.items():
        for s in plan.sources:
            by_source.setdefault(s, []).append(name)
    pending_like = dict(template.grads.grads)
    grads: dict[str, TensorData] = {}
    for pid in source.grads.grads:
        if pid in report.dropped:
            continue  # dropped with its tensor (the report lists it)
        if pid not in by_source:
            state_problems.append(f"pending gradient {pid} has no target parameter")
        for name in by_source.get(pid, []):
            if name not in grads:
                tensors = _sourced(plans[name], dict(source.grads.grads), "pending gradient", state_problems,
                                   f"grads.{name}")
                if tensors is not None:
                    like = pending_like.get(name, dst_params[name])  # the target's accumulation dtype
                    grads[name] = _apply(plans[name], tensors, like, lossy, f"grads.{name}")
    if state_problems:
        refusals.append(_refusal("optimizer state and pending gradients do not map", state_problems))
    if lossy and not allow_lossy:
        refusals.append(_refusal("the template's dtypes are narrower and would change these values", lossy,
                                 "allow_lossy=True converts anyway, rounding them"))
    whole = source.into_item(NativePrecisionSettings())
    if not isinstance(whole, list):
        raise ConversionError(f"source: expected a list, got {type(whole).__name__}")
    try:
        state_item = _drop_rng(whole[4], drop_rng, src.rng_markers, src.name)
    except ConversionError as e:
        refusals.append(str(e))
    if refusals or (forceable and not force):
        raise ConversionError("\n".join(refusals + ([] if force else forceable)))
    report.forced = [line.strip() for text in forceable for line in text.split("\n")
                     if not line.startswith("(force=True")]
    report.rounded = list(lossy)
    state_type = _state_type(state_item, [source._state_type, template._state_type], report)
    return TrainingRecord(
        StateRecord(template.model.kind, check_item(model_item)),
        StateRecord(template.optimizer.kind, check_item(opt_item)),
        scheduler,
        GradientsParamsRecord(grads),
        state_item,
        state_type,
    ), report


def _state_type(item: Item, types: list[type[Any] | None], report: ConversionReport) -> type[Any] | None:
    """The first of `types` (the source's, the template's) the caller's state rebuilds as."""
    tried: list[type[Any]] = []
    why = ""
    for t in types:
        if t is None or t in tried:
            continue
        tried.append(t)
        try:
            t.from_item(item, None)
        except (RecorderError, TypeError, ValueError, KeyError) as e:
            why += f"not {t.__qualname__} ({e}); "
            continue
        report.state = f"{t.__qualname__}"
        return t
    report.state = (why + "left untyped") if tried else "untyped (neither record has a state type)"
    return None
