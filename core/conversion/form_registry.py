"""Finding a record's neutral form: the forms given to `register_neutral_form`, then the
entry points of the group `trainrec.neutral`, then core's own Burn form (the order is in
`trainrec.conversion.convert`'s docstring); the aliases of form names.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from ..training.record import TrainingRecord
from .forms import ConversionError, NeutralForm

ENTRY_POINT_GROUP = "trainrec.neutral"
# adapters' names (and other common names) of neutral forms, for rules' `from` / `to`
FORM_ALIASES: dict[str, str] = {"flax": "jax", "flax.linen": "jax", "linen": "jax", "nnx": "flax.nnx",
                                "eqx": "equinox", "numpy": "trainrec.numpy", "pytorch": "torch"}


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
