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
This module holds `convert` and `convert_with_report`; the rest lives one idea per module
beside it, and every name is importable from here too (`trainrec.convert` is an alias):
`forms` (the vocabulary and `NeutralForm`), `form_registry` (finding a form), `report`
(`ConversionReport`), `tensor_plans` (parameters) and `maths` (the maths and the position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item, check_item, map_tree
from ..precision import (
    NativePrecisionSettings,
    is_lossless,  # noqa: F401
)
from ..training.gradients import GradientsParamsRecord
from ..training.record import TrainingRecord
from ..training.records import StateRecord
from .form_registry import (  # noqa: F401
    _BUILTIN,
    ENTRY_POINT_GROUP,
    FORM_ALIASES,
    _claims,
    _load,
    _loaded,
    _registered,
    form_for,
    form_names,
    framework_of,
    register_neutral_form,
)

# every name this module held before its split, from its new home (tests and users import them)
from .forms import (  # noqa: F401
    FIELDS,
    MATHS,
    MOMENTS,
    ROLES,
    SETTINGS,
    ConversionError,
    Neutral,
    NeutralForm,
    NeutralOptimizer,
    ScheduleCount,
    TargetState,
    as_count,
    as_list,
    as_map,
    out_in_weight,
    tensors_of,
)
from .maths import (  # noqa: F401
    _RTOL,
    _decays,
    _maths,
    _position,
    _same,
    _shown,
)
from .report import (  # noqa: F401
    ConversionReport,
)
from .rules import TRANSFORMS, Plan, Rule, RulesResult, _forms_named, apply_rules, load_rules  # noqa: F401
from .tensor_plans import (  # noqa: F401
    _apply,
    _plan,
    _relayout,
    _rule_lines,
    _run,
)

__all__ = ["ConversionError", "Rule", "load_rules", "convert", "framework_of", "TRANSFORMS",
           "NeutralForm", "Neutral", "NeutralOptimizer", "out_in_weight", "ScheduleCount", "TargetState",
           "ROLES", "MOMENTS", "SETTINGS", "MATHS", "FIELDS", "register_neutral_form", "form_for", "as_map",
           "as_list", "as_count", "tensors_of", "ConversionReport", "convert_with_report", "form_names",
           "FORM_ALIASES"]


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


def _refusal(heading: str, problems: list[str], hint: str = "") -> str:
    return heading + ":\n  " + "\n  ".join(problems) + (f"\n({hint})" if hint else "")


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
