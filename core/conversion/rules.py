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

Its names live one idea per module beside it, and every one is importable from here as
before (`trainrec.rules` is an alias): `transforms` (registered transforms), `rule_syntax`
(`Rule` and its language), `rule_files` (`load_rules`, the presets) and `rule_plans`
(`apply_rules`, `Plan`).
"""

from __future__ import annotations

from ..errors import RecorderError  # noqa: F401
from ..storage.files import open_regular  # noqa: F401
from .rule_files import (  # noqa: F401
    PRESETS,
    _presets,
    _rule_from,
    _rules_from,
    load_rules,
)
from .rule_files import _forms_named as _forms_named  # imported from here by trainrec itself
from .rule_plans import (  # noqa: F401
    Plan,
    RulesResult,
    _bind,
    _layout,
    _misfit,
    _plan_fn,
    _sources,
    apply_rules,
    plan_rules,
)
from .rule_syntax import (  # noqa: F401
    _ESCAPE,
    _OTHER_KEYS,
    _OTHER_KINDS,
    _RULE_KEYS,
    _TO_DOTTED,
    _TO_FLAX,
    INDICES,
    Rule,
    _expand,
    _parse_template,
    _Ref,
    _reindexed,
    _split_pattern,
)

# every name this module held before its split, from its new home (tests and users import them)
from .transforms import (  # noqa: F401
    _SHAPES,
    TRANSFORMS,
    HostArray,
    Shape,
    Transform,
    _dummy,
    _transpose2,
    register_transform,
)

__all__ = ["Plan", "Rule", "RulesResult", "TRANSFORMS", "PRESETS", "INDICES", "register_transform", "load_rules",
           "plan_rules", "apply_rules"]
