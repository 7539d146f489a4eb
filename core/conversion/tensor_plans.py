"""Parameters: one `Plan` per target tensor (user rules, then presets, then neutral names),
and running the plans over tensors and optimizer moments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..precision import is_lossless
from .forms import ConversionError, Neutral, NeutralForm
from .report import ConversionReport
from .rules import Plan, Rule, RulesResult, apply_rules

# -- plans -----------------------------------------------------------------------------------


def _relayout(src: Neutral, dst: Neutral, dst_shape: tuple[int, ...]) -> Callable[[Sequence[Any]], Any]:
    return lambda arrays: dst.from_neutral(src.to_neutral(arrays[0]), dst_shape)


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
