"""The schedule and hyperparameter check of `TrainingRecord.restore`, for the integrations
whose framework restores the optimizers and schedulers from its own checkpoint
(Accelerate's `optimizer.bin` / `scheduler.bin`, Lightning's `optimizer_states` /
`lr_schedulers`): their native state dicts against the live objects, with the
identities `ExactResume` saved beside them (`schedules_of`), before the framework loads
anything.

`check_native` raises the `RecordMismatchError` `TrainingRecord.restore` would (each
field with both values) or returns a `Kept`: the live values of the fields
`allow_changes` allowed, which `Kept.into_states` writes into the state dicts the
framework is about to load (Lightning) and `Kept.apply` into the live objects after it
loaded them (Accelerate).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainrec.adapter_kit import Change, Item, field_changes, settle, unchecked

from .bindings import TorchLrScheduler, encode, take_live
from .identity import IDENTITY_KEY, hyperparameter_fields, identity_of, take_live_hyperparameters

__all__ = ["Kept", "check_native", "schedules_of"]


def schedules_of(schedulers: Sequence[Any]) -> list[Item]:
    """What identifies each scheduler beyond its state dict (`identity.identity_of`)."""
    return [identity_of(s) for s in schedulers]


@dataclass
class Kept:
    """The live values of the allowed fields: per optimizer, (group index, live group
    copy, allowed paths); per scheduler, (live state dict copy, allowed paths)."""

    optimizers: list[tuple[str, list[dict[str, Any]], frozenset[str]]] = field(default_factory=list)
    schedulers: list[tuple[str, dict[str, Any], frozenset[str]]] = field(default_factory=list)

    def into_states(self, optimizer_states: Sequence[Any], scheduler_states: Sequence[Any]) -> None:
        """Write the kept live values into the state dicts a framework will load."""
        for (at, live_groups, accepted), sd in zip(self.optimizers, optimizer_states):
            for gi, (group, live) in enumerate(zip(sd["param_groups"], live_groups)):
                take_live_hyperparameters(group, live, accepted, f"{at}.{gi}")
        for (at, live_sd, accepted), sd in zip(self.schedulers, scheduler_states):
            for path in accepted:
                take_live(sd, live_sd, path.removeprefix(at + ".").split("."))

    def apply(self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> None:
        """Write the kept live values into the live objects, once the framework loaded the
        recorded state into them."""
        for (at, live_groups, accepted), opt in zip(self.optimizers, optimizers):
            for gi, (group, live) in enumerate(zip(opt.param_groups, live_groups)):
                take_live_hyperparameters(group, live, accepted, f"{at}.{gi}")
        for (at, live_sd, accepted), sched in zip(self.schedulers, schedulers):
            if accepted:
                sd = sched.state_dict()
                for path in accepted:
                    take_live(sd, live_sd, path.removeprefix(at + ".").split("."))
                sched.load_state_dict(sd)


def check_native(optimizers: Sequence[torch.optim.Optimizer], optimizer_states: Sequence[Any],
                 schedulers: Sequence[Any], scheduler_states: Sequence[Any],
                 identities: Sequence[Any] | None, allow: frozenset[str], source: str) -> Kept:
    """Compare the native state dicts a framework will load with the live optimizers and
    schedulers (see the module docstring); `identities`: `schedules_of` at the save, or
    None for a checkpoint saved without them (the functions then go unchecked, with an
    `UncheckedIdentityWarning`). A count or structure that differs is left to the
    framework's own load, which refuses it."""
    changes: list[Change] = []
    fields: set[str] = set()
    kept = Kept()
    several = len(optimizers) > 1
    opt_paths: list[str] = []
    for i, (opt, sd) in enumerate(zip(optimizers, optimizer_states)):
        at = f"optimizer.{i}.param_groups" if several else "optimizer.param_groups"
        opt_paths.append(at)
        groups = sd.get("param_groups") if isinstance(sd, dict) else None
        if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
            continue
        recorded: dict[str, Item] = {}
        live: dict[str, Item] = {}
        for gi, (g, live_g) in enumerate(zip(groups, opt.param_groups)):
            if isinstance(g, dict):
                recorded.update(hyperparameter_fields(
                    {k: encode(v, k) for k, v in g.items() if k != "params"}, f"{at}.{gi}"))
            live.update(hyperparameter_fields(
                {k: encode(v, k) for k, v in live_g.items() if k != "params"}, f"{at}.{gi}"))
        changes += field_changes(recorded, live)
        fields |= set(recorded) | set(live)
    unknown: set[str] = set()
    compared: list[tuple[str, dict[str, Any]]] = []
    for j, (sched, sd) in enumerate(zip(schedulers, scheduler_states)):
        at = f"scheduler.{j}" if len(schedulers) > 1 else "scheduler"
        item = encode(sd)
        if not isinstance(item, dict):
            continue
        identity = identities[j] if identities is not None and j < len(identities) else None
        if identity is not None:
            item[IDENTITY_KEY] = identity
        _, live_sd, found, compared_fields, only_identity = TorchLrScheduler(sched).compare(item, at)
        changes += found
        fields |= compared_fields
        unknown |= only_identity
        compared.append((at, copy.deepcopy(live_sd)))
    if unknown:
        unchecked(sorted({".".join(p.split(".")[:2]) for p in unknown}), allow,
                  f"the schedulers of {source}")
    accepted = settle(changes, fields | unknown, allow,
                      f"the fields of the live optimizers and schedulers (against {source})",
                      "Build them as the run that saved it did.")
    for at, opt in zip(opt_paths, optimizers):
        kept.optimizers.append((at, copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                   for g in opt.param_groups]),
                                frozenset(p for p in accepted if p.startswith(at + "."))))
    for at, live_sd in compared:
        kept.schedulers.append((at, live_sd, frozenset(p for p in accepted if p.startswith(at + "."))))
    return kept
