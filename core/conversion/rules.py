"""Conversion rules: which target tensors are made from which source tensors, and how.

A rule matches source tensor names with a regular expression (a full match) and names its
target with backreferences, optionally through a name map (`q` -> `query`); an einops
pattern (`"(h d) i -> i h d"`, axis sizes read from the target's shape), a reshape to the
target's shape or a registered transform changes the layout. One source may make several
targets (a packed `in_proj_weight` -> query, key and value kernels) and several sources
one target (the inverse). The language is specified in `spec/CONVERSION.md`.

`plan_rules` turns rules and the two sides' shapes into `Plan`s, one per target tensor: a
conversion engine applies each plan's `fn` to parameters, to optimizer moments (which
share their parameter's layout) and to pending gradients alike.

Resolution order: for each source name, in the order given, the rules are tried in the
order given; the first rule that matches the name (and applies to the frameworks) decides
it. A source that an earlier plan already took (one of several sources of a many-to-one
rule) is not tried again. Transforms are found by name in `TRANSFORMS`, which holds the
built-in ones and those given to `register_transform`; built-in rule sets are `PRESETS`,
read from the JSON files in `trainrec/conversion/presets/` (their file names are their names).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import einops
import numpy as np

# einops' own parser of a pattern's sides: a pattern is checked when its rule is made
from einops.parsing import ParsedExpression

from ..errors import RecorderError
from ..storage.files import open_regular

__all__ = ["Plan", "Rule", "RulesResult", "TRANSFORMS", "PRESETS", "INDICES", "register_transform", "load_rules",
           "plan_rules", "apply_rules"]

HostArray = np.ndarray[Any, Any]
Shape = tuple[int, ...]
Transform = Callable[[HostArray], HostArray]


@dataclass(frozen=True)
class Plan:
    """How one target tensor is made from source tensors."""

    target: str  # target tensor name
    sources: tuple[str, ...]  # source tensor names (>= 1), in the order fn takes them
    shape: Shape  # the shape fn returns (the target's)
    fn: Callable[[Sequence[HostArray]], HostArray]  # source arrays -> target array
    why: str  # for messages: which rule, which operation
    rule: Rule | None = field(default=None, compare=False)  # the rule that made it (None: neutral names)


# -- transforms -----------------------------------------------------------------------------


def _transpose2(a: HostArray) -> HostArray:
    return a.T if a.ndim == 2 else a


TRANSFORMS: dict[str, Transform] = {
    "none": lambda a: a,
    "transpose": _transpose2,
    "oihw_to_hwio": lambda a: a.transpose(2, 3, 1, 0),
    "hwio_to_oihw": lambda a: a.transpose(3, 2, 0, 1),
    "oiw_to_wio": lambda a: a.transpose(2, 1, 0),
    "wio_to_oiw": lambda a: a.transpose(2, 1, 0),
}
_SHAPES: dict[str, Callable[[Shape], Shape]] = {}


def register_transform(name: str, fn: Transform, *,
                       shape: Callable[[Shape], Shape] | None = None) -> None:
    """Make `fn` (a host array -> a host array, pure) usable as `"transform": name` in rules.

    `shape` maps a source shape to the shape `fn` returns; without it, the shape is found
    by calling `fn` on a read-only array of that shape whose elements all share one byte.
    Raises `TypeError` for a name that is not a string or an `fn` / `shape` that is not
    callable, `ValueError` for an empty name or one already registered (a transform is
    never replaced: a rule file means the same thing all run long).
    """
    if not isinstance(name, str):
        raise TypeError(f"a transform's name must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError("a transform's name must not be empty")
    if not callable(fn):
        raise TypeError(f"transform {name!r}: fn must be callable, got {type(fn).__name__}")
    if shape is not None and not callable(shape):
        raise TypeError(f"transform {name!r}: shape must be callable, got {type(shape).__name__}")
    if name in TRANSFORMS:
        raise ValueError(f"transform {name!r} is already registered")
    TRANSFORMS[name] = fn
    if shape is not None:
        _SHAPES[name] = shape


def _dummy(shape: Shape) -> HostArray:
    """A read-only array of `shape` that takes one byte: for finding result shapes."""
    return np.broadcast_to(np.zeros((), np.uint8), shape)


# -- templates: replacement strings with backreferences ------------------------------------

_ESCAPE = re.compile(r"\\(?:g<([^>]*)>|(\d{1,2})|(.)|$)", re.S)
_Ref = str | int  # a group's name or number


def _parse_template(template: str, pattern: re.Pattern[str]) -> list[str | tuple[_Ref]]:
    """Literal text and group references (as 1-tuples); `ValueError` for an escape other
    than `\\N`, `\\g<N>`, `\\g<name>` and `\\\\`, or a group the pattern lacks."""
    parts: list[str | tuple[_Ref]] = []
    pos = 0
    for m in _ESCAPE.finditer(template):
        parts.append(template[pos:m.start()])
        pos = m.end()
        name, number, other = m.groups()
        if other == "\\":
            parts.append("\\")
            continue
        if name is None and number is None:
            raise ValueError(f"bad escape {m.group(0)!r} at {m.start()}")
        ref: _Ref = int(name or number) if (name or number or "").isdigit() else name
        if isinstance(ref, int) and ref > pattern.groups or isinstance(ref, str) and ref not in pattern.groupindex:
            raise ValueError(f"{m.group(0)!r}: no such group in the pattern")
        parts.append((ref,))
    parts.append(template[pos:])
    return [p for p in parts if p != ""]


def _expand(parts: Sequence[str | tuple[_Ref]], values: Mapping[_Ref, str]) -> str:
    return "".join(p if isinstance(p, str) else values[p[0]] for p in parts)


# -- rules ----------------------------------------------------------------------------------

_RULE_KEYS = ("match", "sources", "replace", "targets", "transform", "rearrange", "reshape", "axes",
              "names", "indices", "from", "to", "optional", "comment")
_OTHER_KINDS = ("drop", "keep")  # {"drop": regex} / {"keep": regex}, with from, to, optional, comment
_OTHER_KEYS = ("from", "to", "optional", "comment")
# how `indices` writes a module path's list indices: torch and nnx `blocks.0.`, flax linen `blocks_0.`
INDICES = {"flax": "list indices as flax linen names them: `blocks.0.` -> `blocks_0.`",
           "dotted": "list indices as torch and flax nnx name them: `blocks_0.` -> `blocks.0.`"}
_TO_FLAX = re.compile(r"(?<=[^.])\.(\d+)(?=\.|$)")
_TO_DOTTED = re.compile(r"(?<=[^._])_(\d+)(?=\.|$)")


def _reindexed(value: str, how: str) -> str:
    """`value` (a module path) with its list indices written `how` (a key of `INDICES`)."""
    if how == "flax":
        while True:  # `layers.0.1` -> `layers_0_1`: one index at a time
            new = _TO_FLAX.sub(r"_\1", value)
            if new == value:
                return new
            value = new
    return _TO_DOTTED.sub(r".\1", value)


def _split_pattern(pattern: str) -> tuple[ParsedExpression, ParsedExpression]:
    if pattern.count("->") != 1:
        raise ValueError("expected one '->'")
    left, right = (ParsedExpression(side.strip()) for side in pattern.split("->"))
    only = {str(a) for a in left.identifiers ^ right.identifiers}
    if only:
        raise ValueError(f"axes only on one side: {sorted(only)}")
    return left, right


@dataclass(frozen=True)
class Rule:
    """Source names fully matching `match` make the target named by `replace`.

    `match` is one regular expression, or several (many-to-one: the sources are stacked on
    a new leading axis in this order; they belong together when their named groups capture
    the same values). `replace` is one target name template (`\\1`, `\\g<name>`), or
    several (one-to-many: the result's leading axis is split across them). `names` maps a
    group's captured values to other names before they are substituted (a value it does not
    list: the rule does not match). At most one layout operation: `rearrange` (an einops
    pattern; axis sizes come from the target's shape, then from `axes`), `reshape` (to the
    target's shape) or `transform` (a name in `TRANSFORMS`; "none" is no operation).
    `indices` writes a group's captured module path with its list indices the target's
    way (`{"m": "flax"}`: `blocks.0.` -> `blocks_0.`; `"dotted"`: the reverse), trying the
    path as captured where that names no target. `from_` / `to` restrict the rule to a
    source / target framework (a neutral form's name). `kind` "drop" drops the source
    tensors `match` names (`replace` ""), "keep" keeps the template tensors it names
    (the template's values). `optional`: the rule may decide no tensor at all (else a
    conversion refuses a rule that decided none).
    Raises `ValueError` naming every field that is wrong.
    """

    match: str | tuple[str, ...]
    replace: str | tuple[str, ...]
    transform: str = "none"
    rearrange: str | None = None
    reshape: bool = False
    axes: Mapping[str, int] = field(default_factory=dict, hash=False)
    names: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    from_: str | None = None
    to: str | None = None
    kind: str = "map"
    optional: bool = False
    indices: Mapping[str, str] = field(default_factory=dict, hash=False)
    origin: str = field(default="", compare=False)  # where it was read, for messages
    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False, hash=False)
    _targets: tuple[list[str | tuple[_Ref]], ...] = field(init=False, repr=False, compare=False, hash=False)
    _output: ParsedExpression | None = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        matches = (self.match,) if isinstance(self.match, str) else tuple(self.match)
        replaces = (self.replace,) if isinstance(self.replace, str) else tuple(self.replace)
        field_of = ("match",) if isinstance(self.match, str) else tuple(
            f"sources[{i}]" for i in range(len(matches)))
        target_of = ("replace",) if isinstance(self.replace, str) else tuple(
            f"targets[{i}]" for i in range(len(replaces)))
        if not isinstance(self.match, str) and len(matches) < 2:
            problems.append("'sources' needs two regular expressions or more (one: use 'match')")
        if not isinstance(self.replace, str) and len(replaces) < 2:
            problems.append("'targets' needs two names or more (one: use 'replace')")
        if len(matches) > 1 and len(replaces) > 1:
            problems.append("'sources' and 'targets' together: a rule makes one target from many "
                            "sources, or many targets from one")
        regexes: list[re.Pattern[str]] = []
        for where, regex in zip(field_of, matches):
            if not isinstance(regex, str):
                problems.append(f"{where!r} must be a string")
                continue
            try:
                regexes.append(re.compile(regex))
            except re.error as e:
                problems.append(f"{where} {regex!r} is not a regular expression ({e})")
        if len(regexes) == len(matches) > 1:
            groups = [set(r.groupindex) for r in regexes]
            if any(g != groups[0] for g in groups):
                problems.append(f"'sources' must all have the same named groups, got {[sorted(g) for g in groups]}")
        targets: list[list[str | tuple[_Ref]]] = []
        for where, template in zip(target_of, replaces):
            if not isinstance(template, str):
                problems.append(f"{where!r} must be a string")
            elif regexes:
                try:
                    targets.append(_parse_template(template, regexes[0]))
                except ValueError as e:
                    problems.append(f"{where} {template!r}: {e}")
        if not isinstance(self.names, Mapping):
            problems.append("'names' must be a map {group: {captured: name}}")
        else:
            for group, table in self.names.items():
                if not isinstance(group, str):
                    problems.append(f"names: {group!r} must be a group's name or number as a string")
                elif not (isinstance(table, Mapping) and all(
                        isinstance(k, str) and isinstance(v, str) for k, v in table.items())):
                    problems.append(f"names[{group!r}] must be a map of strings to strings")
                elif regexes and not (group in regexes[0].groupindex
                                      or group.isdigit() and 0 < int(group) <= regexes[0].groups):
                    problems.append(f"names[{group!r}]: no such group in {field_of[0]}")
        if not isinstance(self.transform, str):
            problems.append("'transform' must be a string")
        elif self.transform not in TRANSFORMS:
            problems.append(f"unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")
        if not isinstance(self.reshape, bool):
            problems.append("'reshape' must be true or false")
        operations = [op for op, given in (("rearrange", self.rearrange is not None),
                                           ("reshape", self.reshape is True),
                                           ("transform", self.transform != "none")) if given]
        if len(operations) > 1:
            problems.append(f"{' and '.join(repr(op) for op in operations)} together: at most one")
        output = None
        if self.rearrange is not None:
            if not isinstance(self.rearrange, str):
                problems.append("'rearrange' must be a string")
            else:
                try:
                    output = _split_pattern(self.rearrange)[1]
                except (ValueError, einops.EinopsError) as e:
                    problems.append(f"rearrange {self.rearrange!r} is not an einops pattern ({e})")
        if not isinstance(self.axes, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in self.axes.items()):
            problems.append("'axes' must be a map of axis names to sizes > 0")
        elif self.axes and self.rearrange is None:
            problems.append("'axes' without 'rearrange'")
        elif output is not None and set(self.axes) - output.identifiers:
            problems.append(f"axes {sorted(set(self.axes) - output.identifiers)} are not in the pattern")
        for key, value in (("from", self.from_), ("to", self.to)):
            if value is not None and not (isinstance(value, str) and value):
                problems.append(f"{key!r} must be a framework name")
        if not isinstance(self.optional, bool):
            problems.append("'optional' must be true or false")
        if not isinstance(self.indices, Mapping):
            problems.append("'indices' must be a map {group: 'flax' or 'dotted'}")
        else:
            for group, how in self.indices.items():
                if how not in INDICES:
                    problems.append(f"indices[{group!r}]: {how!r} is not one of {sorted(INDICES)}")
                elif regexes and not (isinstance(group, str) and (
                        group in regexes[0].groupindex or group.isdigit() and 0 < int(group) <= regexes[0].groups)):
                    problems.append(f"indices[{group!r}]: no such group in {field_of[0]}")
        if self.kind not in ("map", *_OTHER_KINDS):
            problems.append(f"kind {self.kind!r} is not 'map', 'drop' or 'keep'")
        elif self.kind == "map" and "" in replaces:
            problems.append("'replace' must name a target (a rule that drops its sources is {\"drop\": ...})")
        elif self.kind != "map":
            if len(matches) != 1:
                problems.append(f"a {self.kind} rule names its tensors with one regular expression")
            given = [k for k, v in (("replace", self.replace != ""), ("names", bool(self.names)),
                                    ("indices", bool(self.indices))) if v] + operations
            if given:
                problems.append(f"a {self.kind} rule takes no {', '.join(repr(k) for k in given)}")
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "_regexes", tuple(regexes))
        object.__setattr__(self, "_targets", tuple(targets))
        object.__setattr__(self, "_output", output)

    def applies(self, frameworks: tuple[str, str] | None) -> bool:
        """Whether the rule is for converting between these (source, target) frameworks."""
        return frameworks is None or ((self.from_ in (None, frameworks[0])) and (self.to in (None, frameworks[1])))

    def describe(self, index: int) -> str:
        """The rule for messages: where it comes from and its layout operation."""
        if self.kind != "map":
            return f"{self.origin or f'rule {index}'} ({self.kind})"
        op = (f" {self.rearrange!r}" if self.rearrange is not None else " reshape" if self.reshape
              else f" transform {self.transform!r}" if self.transform != "none" else "")
        return f"{self.origin or f'rule {index}'}{op}"

    def _values(self, m: re.Match[str]) -> dict[_Ref, str] | None:
        """The match's groups (by name and number), through `names`; None where `names`
        does not list a captured value."""
        values: dict[_Ref, str] = {i: v or "" for i, v in enumerate(m.groups(), 1)}
        values[0] = m.group(0)
        values.update({k: v or "" for k, v in m.groupdict().items()})
        for group, table in self.names.items():
            ref = int(group) if group.isdigit() else group
            if values[ref] not in table:
                return None
            values[ref] = table[values[ref]]
            if isinstance(ref, str):
                values[m.re.groupindex[ref]] = values[ref]
            else:
                for name, number in m.re.groupindex.items():
                    if number == ref:
                        values[name] = values[ref]
        return values

    def _alternatives(self, values: dict[_Ref, str], regex: re.Pattern[str]) -> list[dict[_Ref, str]]:
        """`values` with the `indices` groups rewritten, then as captured (where they differ)."""
        if not self.indices:
            return [values]
        new = dict(values)
        for group, how in self.indices.items():
            ref: _Ref = int(group) if group.isdigit() else group
            new[ref] = _reindexed(values[ref], how)
            aliases: list[_Ref] = ([n for g, n in regex.groupindex.items() if g == ref] if isinstance(ref, str)
                                   else [g for g, n in regex.groupindex.items() if n == ref])
            for other in aliases:  # the same group by its number and by its name
                new[other] = new[ref]
        return [new] if new == values else [new, values]

    def _find(self, name: str) -> tuple[int, dict[_Ref, str]] | None:
        """(which of `match` the name matches, its group values), or None."""
        for i, regex in enumerate(self._regexes):
            m = regex.fullmatch(name)
            if m is not None:
                values = self._values(m)
                if values is not None:
                    return i, values
        return None


def _rule_from(entry: Any) -> Rule:
    """A `Rule` from one JSON entry; `ValueError` naming every wrong key."""
    if not isinstance(entry, dict):
        raise ValueError(f"expected a map {{\"match\", \"replace\", ...}}, got {type(entry).__name__}")
    kinds = [k for k in _OTHER_KINDS if k in entry]
    if kinds:
        kind = kinds[0]
        problems = [f"unknown key {k!r} (a {kind} rule holds {kind!r}, 'from', 'to', 'optional', 'comment')"
                    for k in sorted(set(entry) - {kind, *_OTHER_KEYS})]
        if not isinstance(entry[kind], str):
            problems.append(f"{kind!r} must be a string (a regular expression)")
    else:
        kind = "map"
        problems = [f"unknown key {k!r}" for k in sorted(set(entry) - set(_RULE_KEYS))]
        for one, many in (("match", "sources"), ("replace", "targets")):
            if one in entry and many in entry:
                problems.append(f"{one!r} and {many!r} together: give one")
            elif one not in entry and many not in entry:
                problems.append(f"missing {one!r} (or {many!r}, or a rule of kind 'drop' or 'keep')")
            elif one in entry and not isinstance(entry[one], str):
                problems.append(f"{one!r} must be a string")
            elif many in entry and not (isinstance(entry[many], list) and all(isinstance(s, str) for s in entry[many])):
                problems.append(f"{many!r} must be a list of strings")
    for key in ("transform", "rearrange", "from", "to", "comment"):
        if key in entry and not isinstance(entry[key], str):
            problems.append(f"{key!r} must be a string")
    if "optional" in entry and not isinstance(entry["optional"], bool):
        problems.append("'optional' must be true or false")
    if problems:
        raise ValueError("; ".join(problems))
    common = {"from_": entry.get("from"), "to": entry.get("to"), "optional": entry.get("optional", False)}
    if kind != "map":
        return Rule(entry[kind], "", kind=kind, **common)
    match = entry["match"] if "match" in entry else tuple(entry["sources"])
    replace = entry["replace"] if "replace" in entry else tuple(entry["targets"])
    return Rule(match, replace, entry.get("transform", "none"), entry.get("rearrange"),
                entry.get("reshape", False), entry.get("axes", {}), entry.get("names", {}),
                indices=entry.get("indices", {}), **common)


def _forms_named(rules: list[Rule], where: str) -> list[Rule]:
    """`rules` with `from` / `to` names resolved to neutral forms' names (an adapter's
    name is an alias of its form: `form_registry.FORM_ALIASES`); `ValueError` naming each rule
    whose name no form has, and the known names."""
    from .form_registry import FORM_ALIASES, form_names  # forms imports this module

    known = form_names()
    out, problems = [], []
    for i, rule in enumerate(rules):
        names: dict[str, str | None] = {}
        for key, value in (("from_", rule.from_), ("to", rule.to)):
            if value is None or value in known:
                names[key] = value
            elif value in FORM_ALIASES:
                names[key] = FORM_ALIASES[value]
            else:
                label = "from" if key == "from_" else "to"
                problems.append(f"{rule.origin or f'{where}: rules[{i}]'}: {label!r}: {value!r} names no neutral "
                                f"form; known: {sorted(known)}, or an adapter's name for its form "
                                f"({', '.join(f'{a} = {f}' for a, f in sorted(FORM_ALIASES.items()))})")
        if len(names) == 2 and (names["from_"], names["to"]) != (rule.from_, rule.to):
            rule = dataclasses.replace(rule, from_=names["from_"], to=names["to"])
        out.append(rule)
    if problems:
        raise ValueError("bad conversion rules: " + "; ".join(problems))
    return out


def _rules_from(data: Any, where: str, *, check_forms: bool = True) -> list[Rule]:
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{where}: expected {{\"rules\": [...]}}")
    unknown = sorted(set(data) - {"rules", "description"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (a rules file holds \"rules\" and "
                         "\"description\")")
    rules, problems = [], []
    for i, entry in enumerate(data["rules"]):
        try:
            rule = _rule_from(entry)
        except ValueError as e:
            problems.append(f"{where}: rules[{i}]: {e}")
        else:
            object.__setattr__(rule, "origin", f"{where}: rules[{i}]")
            rules.append(rule)
    if problems:
        raise ValueError("bad conversion rules: " + "; ".join(problems))
    return _forms_named(rules, where) if check_forms else rules


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a JSON file `{"rules": [...], "description"?: "..."}` (spec/CONVERSION.md),
    or the built-in set `PRESETS[path]` where `path` names no file but a preset.

    Raises `ValueError` naming the file, and every rule that is wrong with its index and
    field (an unknown key, a regex that does not compile, a backreference to no group, a
    pattern einops cannot parse, two layout operations, an unknown transform, a `from` /
    `to` that names no neutral form, listing the known ones; an adapter's name, `flax`
    or `numpy`, reads as its form's, `form_registry.FORM_ALIASES`, ...);
    `OSError` where the file cannot be read.
    """
    p = Path(path)
    if not p.exists() and str(path) in PRESETS:
        return list(PRESETS[str(path)])
    try:
        with open_regular(p) as f:  # a FIFO or device would block or never end
            raw = f.read()
    except RecorderError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a rules file (JSON nested too deeply)") from None
    return _rules_from(data, str(path))


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


# -- presets --------------------------------------------------------------------------------


def _presets() -> dict[str, list[Rule]]:
    out: dict[str, list[Rule]] = {}
    for path in sorted((Path(__file__).parent / "presets").glob("*.json")):
        # the forms' names are checked by tests/test_rules.py (the forms import this module)
        out[path.stem] = _rules_from(json.loads(path.read_text()), f"preset {path.stem!r}", check_forms=False)
    return out


PRESETS: dict[str, list[Rule]] = _presets()
