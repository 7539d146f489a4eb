"""Applying rules: which target tensor each rule makes from which sources (`apply_rules`,
`plan_rules`), as `Plan`s whose layouts are checked against the target's shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import einops
import numpy as np

# einops' own parser of a pattern's sides: a pattern is checked when its rule is made
from einops.parsing import ParsedExpression

from .rule_syntax import Rule, _expand
from .transforms import _SHAPES, TRANSFORMS, HostArray, Shape, Transform, _dummy


@dataclass(frozen=True)
class Plan:
    """How one target tensor is made from source tensors."""

    target: str  # target tensor name
    sources: tuple[str, ...]  # source tensor names (>= 1), in the order fn takes them
    shape: Shape  # the shape fn returns (the target's)
    fn: Callable[[Sequence[HostArray]], HostArray]  # source arrays -> target array
    why: str  # for messages: which rule, which operation
    rule: Rule | None = field(default=None, compare=False)  # the rule that made it (None: neutral names)


# -- planning -------------------------------------------------------------------------------


def _bind(output: ParsedExpression, shape: Shape) -> dict[str, int]:
    """Axis sizes of the pattern's output side that stand alone in a dimension: the
    target's sizes there (axes before an ellipsis count from the front, after it from the
    back)."""
    groups = list(output.composition)
    bound: dict[str, int] = {}
    cut = groups.index("…") if "…" in groups else len(groups)
    placed = list(zip(groups[:cut], shape)) + list(zip(groups[cut + 1:][::-1], shape[::-1]))
    for group, size in placed:
        if isinstance(group, list) and len(group) == 1 and isinstance(group[0], str):
            bound[group[0]] = size
    return bound


def _layout(rule: Rule, shape: Shape, want: Shape) -> tuple[Transform, Shape] | str:
    """The rule's operation on an array of `shape` for a result of shape `want`, and the
    shape it gives; or why it cannot be applied."""
    if rule.rearrange is not None:
        assert rule._output is not None
        axes = {**_bind(rule._output, want), **rule.axes}
        pattern = rule.rearrange
        try:
            got = einops.rearrange(_dummy(shape), pattern, **axes).shape
        except einops.EinopsError as e:
            reason = " ".join(str(e).split())
            return reason[reason.find("Additional info"):] if "Additional info" in reason else reason
        return (lambda a: einops.rearrange(a, pattern, **axes)), tuple(got)
    if rule.reshape:
        if math.prod(shape) != math.prod(want):
            return f"reshape: {math.prod(shape)} elements, the target has {math.prod(want)}"
        return (lambda a: a.reshape(want)), want
    fn = TRANSFORMS[rule.transform]
    try:
        got = _SHAPES[rule.transform](shape) if rule.transform in _SHAPES else fn(_dummy(shape)).shape
        got = tuple(got)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in got):
            raise TypeError(f"{got!r} is not a shape")
    except Exception as e:  # a user's function failing on this shape: its reason, in the problem
        return f"transform {rule.transform!r} fails on this shape ({type(e).__name__}: {e})"
    return fn, tuple(int(d) for d in got)


def _plan_fn(op: Transform, count: int, part: int | None) -> Callable[[Sequence[HostArray]], HostArray]:
    def fn(arrays: Sequence[HostArray]) -> HostArray:
        if len(arrays) != count:
            raise ValueError(f"expected {count} source arrays, got {len(arrays)}")
        out = op(arrays[0] if count == 1 else np.stack(arrays))
        return np.asarray(out if part is None else out[part], order="C")  # keeps 0-d (ascontiguousarray: 1-d)

    return fn


def _sources(rule: Rule, name: str, which: int, source: Mapping[str, Shape], taken: set[str],
             index: dict[tuple[int, tuple[tuple[str, str], ...]], list[str]]) -> list[str] | tuple[str, bool]:
    """The sources of a many-to-one rule that `name` (matching `rule.match[which]`) belongs
    to, in order; or why they are not (and whether that is the rule's fault: sources it
    cannot tell apart)."""
    def key(m: re.Match[str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((g, v or "") for g, v in m.groupdict().items()))

    if not index:  # built on first use: one pass over the source names per rule
        for other in source:
            for k, regex in enumerate(rule._regexes):
                m = regex.fullmatch(other)
                if m is not None and rule._values(m) is not None:
                    index.setdefault((k, key(m)), []).append(other)
    m = rule._regexes[which].fullmatch(name)
    assert m is not None
    names = []
    for k, regex in enumerate(rule._regexes):
        found = index.get((k, key(m)), [])
        if len(found) > 1:
            return (f"sources[{k}] matches {found} alike: name the parts of the names that "
                    "differ with named groups"), True
        if not found:
            return f"needs sources[{k}] {regex.pattern!r} too, which the source does not have", False
        if found[0] in taken:
            return f"needs sources[{k}] {found[0]}, which another rule took", False
        names.append(found[0])
    return names


@dataclass
class RulesResult:
    """What rules decided (`apply_rules`): `plans` by target name; `problems`; `dropped`
    (source name -> the drop rule) and `kept` (template name -> the keep rule); `unused`:
    (index, rule, why) for the rules that apply to the frameworks and decided no tensor
    (an optional rule is not listed); `skipped`: (index, rule) of those for other
    frameworks (`from` / `to`)."""

    plans: dict[str, Plan] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    dropped: dict[str, Rule] = field(default_factory=dict)
    kept: dict[str, Rule] = field(default_factory=dict)
    unused: list[tuple[int, Rule, str]] = field(default_factory=list)
    skipped: list[tuple[int, Rule]] = field(default_factory=list)


def plan_rules(rules: Sequence[Rule], source: Mapping[str, Shape], target: Mapping[str, Shape], *,
               frameworks: tuple[str, str] | None = None,
               strict: bool = True) -> tuple[dict[str, Plan], list[str]]:
    """Plans by target name for the source tensors the rules match, and every problem.

    `source` and `target` map tensor names to shapes. Rules are tried in order and the
    first that matches a source name wins for it (`frameworks=(source, target)` leaves out
    the rules whose `from_` / `to` name others). With `strict` (user rules), a matching
    rule whose target name is not in `target`, whose other sources are missing, or whose
    operation cannot give the target's shape is a problem naming the source, the target
    and both shapes; without it (built-in presets) such a rule is passed over and the next
    one tried. Two plans for one target, and sources that a many-to-one rule cannot tell
    apart, are problems either way. Sources no rule matches are in no plan. (The plans
    and problems of `apply_rules`, which also says what drop and keep rules did and which
    rules decided nothing.)
    """
    done = apply_rules(rules, source, target, frameworks=frameworks, strict=strict)
    return done.plans, done.problems


def apply_rules(rules: Sequence[Rule], source: Mapping[str, Shape], target: Mapping[str, Shape], *,
                frameworks: tuple[str, str] | None = None, strict: bool = True) -> RulesResult:
    """`plan_rules`, saying everything the rules did (`RulesResult`). A drop rule decides
    a source name as a map rule does (the first rule that matches decides); a keep rule
    keeps the template tensors it matches that no map rule makes (with `strict`, one a map
    rule makes too is a problem)."""
    out = RulesResult()
    active = [(i, r) for i, r in enumerate(rules) if r.applies(frameworks)]
    out.skipped = [(i, r) for i, r in enumerate(rules) if not r.applies(frameworks)]
    decided: set[int] = set()
    taken: set[str] = set()
    indexes: dict[int, dict[tuple[int, tuple[tuple[str, str], ...]], list[str]]] = {}
    for name in source:
        if name in taken:
            continue
        for i, rule in active:
            if rule.kind == "keep":
                continue
            found = rule._find(name)
            if found is None:
                continue
            which, values = found
            why = rule.describe(i)
            if rule.kind == "drop":
                out.dropped[name] = rule
                decided.add(i)
                taken.add(name)
                break
            names = [name]
            if len(rule._regexes) > 1:
                got = _sources(rule, name, which, source, taken, indexes.setdefault(i, {}))
                if isinstance(got, tuple):
                    text, ambiguous = got
                    if strict or ambiguous:
                        out.problems.append(f"{name}: {why} {text}")
                        decided.add(i)
                        break
                    continue
                names = got
                first = rule._values(rule._regexes[0].fullmatch(names[0]))  # type: ignore[arg-type]
                assert first is not None  # indexed only where `names` lists its values
                values = first  # the template's groups are those of the first expression
            fits: list[tuple[list[str], tuple[Transform, Shape] | str]] = []
            for alternative in rule._alternatives(values, rule._regexes[0]):
                outs = [_expand(t, alternative) for t in rule._targets]
                fits.append((outs, _misfit(rule, why, names, outs, source, target)))
                if not isinstance(fits[-1][1], str):
                    break
            outs, misfit = fits[-1]
            if isinstance(misfit, str):
                if strict:
                    # the alternative whose targets exist says the most
                    named = [f for f in fits if all(t in target for t in f[0])]
                    out.problems.append(str((named or fits)[0][1]))
                    decided.add(i)
                    break
                continue
            op, want = misfit
            decided.add(i)
            for part, made in enumerate(outs):
                if made in out.plans:
                    other = out.plans[made]
                    out.problems.append(f"{made}: made by {other.why} from {', '.join(other.sources)} "
                                        f"and by {why} from {', '.join(names)}")
                    continue
                out.plans[made] = Plan(made, tuple(names), want,
                                       _plan_fn(op, len(names), part if len(outs) > 1 else None), why, rule)
            taken.update(names)
            break
    keeps = [(i, r) for i, r in active if r.kind == "keep"]
    for name in target if keeps else ():
        for i, rule in keeps:
            if rule._find(name) is None:
                continue
            decided.add(i)
            if name in out.plans:
                if strict:
                    out.problems.append(f"{name}: made by {out.plans[name].why} from "
                                        f"{', '.join(out.plans[name].sources)} and kept by {rule.describe(i)}")
            else:
                out.kept[name] = rule
            break
    for i, rule in active:
        if i in decided or rule.optional:
            continue
        pool = target if rule.kind == "keep" else source
        matched = [n for n in pool if rule._find(n) is not None]
        side = "template" if rule.kind == "keep" else "source"
        why = (f"it matches {', '.join(matched[:3])}{', ...' if len(matched) > 3 else ''}, which "
               f"{'a map rule makes' if rule.kind == 'keep' else 'earlier rules decided'}" if matched
               else f"it matches no {side} tensor")
        out.unused.append((i, rule, why))
    return out


def _misfit(rule: Rule, why: str, names: list[str], outs: list[str], source: Mapping[str, Shape],
            target: Mapping[str, Shape]) -> tuple[Transform, Shape] | str:
    """(the operation on the stacked sources, the target's shape), or why the rule cannot
    make these targets from these sources."""
    missing = [t for t in outs if t not in target]
    if missing:
        return f"{names[0]}: {why} maps it to {', '.join(missing)}, which the target does not have"
    shapes = [tuple(source[s]) for s in names]
    wants = [tuple(target[t]) for t in outs]
    text = (", ".join(f"{s} {list(sh)}" for s, sh in zip(names, shapes)) + " -> "
            + ", ".join(f"{t} {list(sh)}" for t, sh in zip(outs, wants)))
    if len(set(shapes)) > 1 or len(set(wants)) > 1:
        return f"{text}: {why}: the {'sources' if len(set(shapes)) > 1 else 'targets'} differ in shape"
    given = (len(names), *shapes[0]) if len(names) > 1 else shapes[0]
    want = (len(outs), *wants[0]) if len(outs) > 1 else wants[0]
    done = _layout(rule, given, want)
    if isinstance(done, str):
        return f"{text}: {why} cannot make it: {done}"
    if done[1] != want:
        return f"{text}: {why} gives {list(done[1])}" + (f" (stacked: {list(given)} -> {list(want)})"
                                                          if len(names) > 1 or len(outs) > 1 else "")
    return done[0], wants[0]
