"""What `DCPRecorder` reads the optimizer state into, how it writes it into the live
optimizer, and the backup a load that fails after its checks is rolled back from.

`get_state_dict` plans the optimizer's entries from the live `optimizer.state`, which is a
`defaultdict`: code that reads `opt.state[p]` before a load adds empty entries, so DCP
planned no optimizer entries and the load "succeeded" with every moment and step lost
(with one entry read, `set_state_dict` raised after the model's weights were overwritten).
And an optimizer without state gets it from `_init_optim_state`, one `step()` at lr 0 on
the live parameters (Adam's weight decay turns a -0.0 parameter into +0.0 there). Here the
optimizer's entries are planned from DCP's `.metadata`: every entry the checkpoint holds is
read into a new tensor of its saved shape and dtype (a `DTensor` sharded like its parameter
where it has the parameter's shape), whatever `optimizer.state` held, and the optimizer
takes them by its own `load_state_dict`; no optimizer step is taken, in save or load.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

from trainrec import CorruptRecordError, RecordMismatchError

from .wrappers import is_dtensor

__all__ = ["Backup", "has_state", "load_optimizer", "optimizer_target", "state_dicts"]

_STATE = "optim.state."


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state (an empty entry, made by reading `opt.state[p]`
    of the `defaultdict`, is none)."""
    return any(bool(s) for s in optimizer.state.values())


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    """`get_state_dict(model, optimizer)` without touching the live objects: its optimizer
    state holds the optimizer's non-empty entries only (the live tensors themselves), and
    `get_state_dict` never steps an optimizer without state (its `_init_optim_state` does
    when `optimizer.state` is empty: it is given a stand-in meanwhile)."""
    live = optimizer.state
    real = {p: s for p, s in live.items() if s}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stand_in: dict[Any, Any] = real or ({params[0]: {}} if params else {})
    optimizer.state = defaultdict(dict, stand_in)
    try:
        msd, osd = get_state_dict(model, optimizer)
    finally:
        optimizer.state = live
    state: Any = osd.get("state", {})
    osd["state"] = {k: v for k, v in state.items() if v}
    return msd, osd


def group_names(osd: Any) -> list[list[str]]:
    """The parameter names of each param group, in the optimizer's own order."""
    return [[str(n) for n in g.get("params", ())] for g in osd.get("param_groups", ())]


def optimizer_target(metadata: Any, osd: Any, params: dict[str, Any], path: Path) -> dict[str, Any]:
    """The optimizer state DCP reads into: for each `optim.state.<param>.<key>` entry of
    the checkpoint, a new tensor (or, for a non-tensor entry, a placeholder DCP replaces).
    `RecordMismatchError` for state of a parameter no live param group holds."""
    owned = {n for names in group_names(osd) for n in names}
    state: dict[str, Any] = {}
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if not key.startswith(_STATE):
            continue
        rest = key[len(_STATE):]
        owner, cut = None, rest.find(".")
        while cut != -1:  # a parameter's name has dots of its own: try each split
            if rest[:cut] in owned:
                owner = rest[:cut]
                break
            cut = rest.find(".", cut + 1)
        if owner is None or owner not in params:
            raise RecordMismatchError(
                f"the checkpoint holds optimizer state {key!r} of a parameter no param group of "
                "the live optimizer holds: build the optimizer as the run that saved it did",
                key=key, source=str(path))
        *inner, last = rest[len(owner) + 1:].split(".")
        entry = state.setdefault(owner, {})
        for k in inner:
            entry = entry.setdefault(k, {})
            if not isinstance(entry, dict):
                raise CorruptRecordError(f"DCP's .metadata holds {key!r} inside a value",
                                         key=key, source=str(path))
        if last in entry:
            raise CorruptRecordError(f"DCP's .metadata holds {key!r} twice", key=key,
                                     source=str(path))
        entry[last] = _new_tensor(meta, params[owner]) if isinstance(
            meta, TensorStorageMetadata) else None
    return state


def _new_tensor(meta: Any, param: Any) -> torch.Tensor:
    """A tensor to read a saved optimizer state tensor into: sharded like `param` when it
    has the parameter's shape (a moment), else a plain CPU tensor (a `step`)."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    if size and size == tuple(param.shape):
        return torch.empty_like(param.detach(), dtype=dtype)
    return torch.empty(size, dtype=dtype)


def load_optimizer(optimizer: torch.optim.Optimizer, loaded: Any, names: list[list[str]]) -> None:
    """Write the optimizer state dict DCP read (keyed by parameter name, `names` each live
    group's, in order) into `optimizer` by its own `load_state_dict`, which casts each
    state tensor as torch does; parameters without saved state get none."""
    index = {n: i for i, n in enumerate(n for group in names for n in group)}
    state = {index[n]: v for n, v in loaded.get("state", {}).items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in group]}
              for g, group in zip(loaded["param_groups"], names)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class Backup:
    """What a load changes, kept before it reads anything into the live objects: a host
    copy of the model's state tensors (DCP reads into them in place), the `.grad`
    references and the optimizer's `state` and `param_groups` (both replaced, not written
    into) and the scheduler's state. `restore()` puts them back."""

    def __init__(self, msd: dict[str, Any], params: dict[str, Any],
                 optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        seen: set[int] = set()
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in msd.values():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                local = _local(t.detach())
                self.tensors.append((local, local.to("cpu", copy=True)))
        self.grads = {n: p.grad for n, p in params.items()}
        self.params = params
        self.optimizer = optimizer
        self.optim = (optimizer.state, optimizer.param_groups)
        self.scheduler = scheduler
        self.sched = None if scheduler is None else copy.deepcopy(scheduler.state_dict())

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
        for n, p in self.params.items():
            p.grad = self.grads[n]
        self.optimizer.state, self.optimizer.param_groups = self.optim
        if self.scheduler is not None:
            self.scheduler.load_state_dict(self.sched)


def write_model(model: nn.Module, msd: dict[str, Any]) -> None:
    """The model's state dict DCP read, written by `set_model_state_dict` (the tensors are
    the live ones, already read; non-tensor entries, a module's extra state, go in here)."""
    set_model_state_dict(model, msd)
