"""Conversion rules: source tensor names to target tensor names, as `Plan`s.

Minimal version (the agreed interface only): `Rule` (a regex `match`, its `replace`
and a named `transform` from `TRANSFORMS`), `load_rules` (a JSON rules file) and
`plan_rules`, which turns rules into one `Plan` per target tensor they reach.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Plan", "Rule", "TRANSFORMS", "load_rules", "plan_rules"]


@dataclass(frozen=True)
class Plan:
    """How one target tensor is made: `fn` takes the arrays of `sources` (in that order)
    and returns the target's array, of `shape`; `why` says which rule or form chose it."""

    target: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    fn: Callable[[Sequence[np.ndarray[Any, Any]]], np.ndarray[Any, Any]]
    why: str


def _transpose2(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.T if a.ndim == 2 else a


TRANSFORMS: dict[str, Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]] = {
    "none": lambda a: a,
    "transpose": _transpose2,
    "oihw_to_hwio": lambda a: a.transpose(2, 3, 1, 0),
    "hwio_to_oihw": lambda a: a.transpose(3, 2, 0, 1),
    "oiw_to_wio": lambda a: a.transpose(2, 1, 0),
    "wio_to_oiw": lambda a: a.transpose(2, 1, 0),
}


@dataclass(frozen=True)
class Rule:
    """A user rule: source names matching `match` (a regex, full match) map to
    `re.sub(match, replace, name)` in the target, with `transform` applied."""

    match: str
    replace: str
    transform: str = "none"

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")
        re.compile(self.match)


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a JSON file `{"rules": [{"match", "replace", "transform"?}, ...]}`.
    Raises `ValueError` naming every rule that is not such a map of strings, whose
    `match` is not a regular expression or whose `transform` is unknown."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{path}: expected {{\"rules\": [...]}}")
    rules, problems = [], []
    for i, r in enumerate(data["rules"]):
        where = f"{path}: rules[{i}]"
        if not isinstance(r, dict):
            problems.append(f"{where}: expected a map {{\"match\", \"replace\", \"transform\"?}}, "
                            f"got {type(r).__name__}")
            continue
        unknown = sorted(set(r) - {"match", "replace", "transform"})
        missing = [k for k in ("match", "replace") if k not in r]
        wrong = [k for k in ("match", "replace", "transform") if k in r and not isinstance(r[k], str)]
        if unknown or missing or wrong:
            problems.append(f"{where}: " + "; ".join(
                [f"missing {k!r}" for k in missing] + [f"unknown key {k!r}" for k in unknown]
                + [f"{k!r} must be a string" for k in wrong]))
            continue
        try:
            rules.append(Rule(r["match"], r["replace"], r.get("transform", "none")))
        except re.error as e:
            problems.append(f"{where}: match {r['match']!r} is not a regular expression ({e})")
        except ValueError as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ValueError("bad conversion rules: " + "; ".join(problems))
    return rules


def _one(transform: str) -> Callable[[Sequence[np.ndarray[Any, Any]]], np.ndarray[Any, Any]]:
    return lambda arrays: TRANSFORMS[transform](arrays[0])


def plan_rules(rules: Sequence[Rule], source: Mapping[str, tuple[int, ...]],
               target: Mapping[str, tuple[int, ...]], *, frameworks: tuple[str, str] | None = None,
               strict: bool = True) -> tuple[dict[str, Plan], list[str]]:
    """(target name -> `Plan`, problems) for the source tensors a rule matches (the first
    rule whose `match` fully matches a name). `strict`: a matched source whose target is
    missing, taken, or of another shape after the transform is a problem; otherwise the
    rule does not apply and the tensor is left to the next stage."""
    plans: dict[str, Plan] = {}
    problems: list[str] = []
    for name, shape in source.items():
        rule = next((r for r in rules if re.fullmatch(r.match, name)), None)
        if rule is None:
            continue
        to = re.sub(rule.match, rule.replace, name)
        after = tuple(TRANSFORMS[rule.transform](np.empty(shape, np.uint8)).shape)
        if to not in target or to in plans:
            if strict:
                problems.append(f"{name}: no target among {[to]}")
            continue
        if after != tuple(target[to]):
            if strict:
                problems.append(f"{name} -> {to}: shape {after} after {rule.transform}, "
                                f"target has {tuple(target[to])}")
            continue
        plans[to] = Plan(to, (name,), after, _one(rule.transform),
                         f"rule {rule.match!r} -> {rule.replace!r} ({rule.transform})")
    return plans, problems
