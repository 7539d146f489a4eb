"""A conversion rule and its language: `Rule` (a source pattern, a target template with
backreferences, a layout change), its index forms and its fields' checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import einops

# einops' own parser of a pattern's sides: a pattern is checked when its rule is made
from einops.parsing import ParsedExpression

from .transforms import TRANSFORMS

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
