"""Reading rules: a rules file (JSON) and the bundled presets (`PRESETS`), each rule's
fields and its forms' names checked, `ValueError` naming the rule.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import RecorderError
from ..storage.files import open_regular
from .rule_syntax import _OTHER_KEYS, _OTHER_KINDS, _RULE_KEYS, Rule


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
    from .form_registry import FORM_ALIASES, form_names

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


# -- presets --------------------------------------------------------------------------------


def _presets() -> dict[str, list[Rule]]:
    out: dict[str, list[Rule]] = {}
    for path in sorted((Path(__file__).parent / "presets").glob("*.json")):
        # the forms' names are checked by tests/test_rules.py (the forms import this module)
        out[path.stem] = _rules_from(json.loads(path.read_text()), f"preset {path.stem!r}", check_forms=False)
    return out


PRESETS: dict[str, list[Rule]] = _presets()
