"""The optimizer's maths and the schedule's position: the source's and the target's update
must agree field by field (`MATHS`) at the position, or the conversion is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..items.tree import Item
from .forms import FIELDS, SETTINGS, NeutralForm, NeutralOptimizer, ScheduleCount, TargetState
from .report import ConversionReport

_RTOL = 1e-6  # numbers agree to float32's precision (with room for libraries' cos and pow in the last bits)


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
