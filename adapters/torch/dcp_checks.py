"""`DCPRecorder`'s checks of the live objects and of what a checkpoint holds against them,
each raising `TypeError`, `RecorderError` or `RecordMismatchError` before anything live
changes: the objects passed, gradients no checkpoint can keep, the param groups and
hyperparameters DCP read, the facts DCP saved against the manifest, tensor shapes and dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainrec import CorruptRecordError, RecorderError, RecordMismatchError
from trainrec.adapter_kit import Item, field_changes, kind_mismatches, settle

from .bindings import encode
from .dcp_layout import _META, MANIFEST
from .identity import hyperparameter_fields
from .wrappers import is_dtensor, named_parameters


def refuse_unsynced_gradients(model: nn.Module) -> None:
    """Raise `RecorderError` when an FSDP2 module holds gradients accumulated with
    `set_requires_gradient_sync(False)`: they live unsharded inside FSDP, where no public
    API reads or writes them, so no checkpoint can keep them."""
    for name, module in model.named_modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if (getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
                    or (unsharded is not None and unsharded.grad is not None)):
                raise RecorderError(
                    f"FSDP module {name or '<root>'!r} holds gradients accumulated with "
                    "set_requires_gradient_sync(False): they stay unsharded inside FSDP, and no "
                    "public API reads or restores them, so a checkpoint would lose them. "
                    "Checkpoint after the window's last (synced) backward, or accumulate with "
                    "gradient sync on (the default: each micro-step's gradient is "
                    "reduce-scattered into the sharded .grad, which DCPRecorder saves)",
                    key=f"model.{name}")


def _groups(osd: Any) -> list[list[str]]:
    """The parameter names of each param group of `get_state_dict`'s optimizer state dict."""
    return [sorted(str(n) for n in g.get("params", ())) for g in osd.get("param_groups", ())]


def _check_param_groups(loaded: dict[str, Any], live: list[dict[str, Any]], path: Path) -> None:
    """`RecordMismatchError` for the first param group entry DCP read (`optim.param_groups.
    {i}.{key}`) that set_state_dict would give the live optimizer although it does not fit:
    a `params` list other than the live group's (the group's hyperparameters would go to
    other parameters) or a hyperparameter of another kind than the live one's (an lr that
    is a str)."""
    prefix = "optim.param_groups."
    for name, value in sorted(loaded.items()):
        if not name.startswith(prefix):
            continue
        index, _, key = name.removeprefix(prefix).partition(".")
        at = f"optimizer.param_groups.{index}.{key}"
        group = live[int(index)] if index.isdigit() and int(index) < len(live) else None
        if group is None or key not in group:
            continue  # DCP reads only the live state dict's keys: one inside a nested value
        if key == "params":
            fits = isinstance(value, list) and sorted(map(str, value)) == sorted(
                map(str, group[key]))
            problems = [] if fits else [f"{at}: {value!r:.200} in the checkpoint, "
                                        f"{group[key]!r:.200} live"]
        else:
            try:
                like = encode(group[key], key)
            except (TypeError, ValueError, RecorderError):
                continue  # a live value that is no plain data: nothing to compare with
            try:
                problems = kind_mismatches(encode(value, key), like, at)
            except (TypeError, ValueError, RecorderError) as e:
                problems = [f"{at}: {type(value).__name__} in the checkpoint ({e})"]
        if problems:
            raise RecordMismatchError(
                f"the optimizer's param group entry does not fit the live optimizer: "
                f"{'; '.join(problems)}", key=at, source=str(path))


def _check_hyperparameters(loaded: dict[str, Any], live: list[dict[str, Any]], allow: frozenset[str],
                           kind: str, path: Path) -> frozenset[str]:
    """The hyperparameters DCP read (`optim.param_groups.{i}.{key}`) against the live
    groups', as `TorchOptimizer` compares them: the paths `allow` allows to differ;
    `RecordMismatchError` for any other difference."""
    prefix = "optim.param_groups."
    recorded: dict[int, dict[str, Item]] = {}
    for name, value in loaded.items():
        index, _, key = name.removeprefix(prefix).partition(".")
        if name.startswith(prefix) and index.isdigit() and key and "." not in key and key != "params":
            recorded.setdefault(int(index), {})[key] = encode(value, key)
    recorded_fields: dict[str, Item] = {}
    live_fields: dict[str, Item] = {}
    for gi, group in enumerate(live):
        at = f"optimizer.param_groups.{gi}"
        live_item = {k: encode(v, k) for k, v in group.items() if k != "params"}
        recorded_fields.update(hyperparameter_fields(recorded.get(gi, {}), at))
        live_fields.update(hyperparameter_fields(live_item, at))
    try:
        return settle(field_changes(recorded_fields, live_fields),
                      set(recorded_fields) | set(live_fields), allow,
                      f"the hyperparameters of the live {kind}",
                      "Build the optimizer with the hyperparameters of the run that saved it.")
    except RecordMismatchError as e:
        raise RecordMismatchError(str(e).removesuffix(f" (key {e.key!r})"), key=e.key,
                                  source=str(path)) from None


def _check_meta(meta: Any, manifest: dict[str, Any], path: Path) -> None:
    """Raise `CorruptRecordError` unless the facts saved inside the DCP checkpoint are the
    manifest's (the same save, the same pending gradients, optimizer state or none)."""
    try:
        doc = json.loads(meta)
        saved = {k: doc[k] for k in ("save_id", "grads", "optimizer_state", "optimizer",
                                     "param_groups")}
    except (TypeError, ValueError, KeyError):
        raise CorruptRecordError(f"the DCP checkpoint's {_META!r} entry is malformed",
                                 source=str(path / manifest["dcp"]), key=_META) from None
    for key in ("save_id", "grads", "optimizer_state", "optimizer"):
        if saved[key] != manifest[key]:
            raise CorruptRecordError(
                f"the DCP checkpoint says {key} {saved[key]!r}, {MANIFEST} says "
                f"{manifest[key]!r}: the manifest was edited, or the {manifest['dcp']}/ "
                "directory is another save's", source=str(path), key=key)


def _refuse_plain_gradients(model: nn.Module) -> None:
    """Raise `RecorderError` when, at world size > 1, a pending `.grad` is a plain tensor
    (DistributedDataParallel, or a model that is not sharded): DCP takes a plain tensor for
    the same on every rank and writes it once, but inside a `no_sync()` window each rank's
    partial sum is its own, so every rank would get one rank's back."""
    for name, p in named_parameters(model):
        if p.grad is not None and not is_dtensor(p.grad):
            raise RecorderError(
                f"the pending gradient of {name!r} is a plain tensor, not a sharded DTensor: "
                "DCP saves a plain tensor once, as if it were the same on every rank, but "
                "each rank's gradients inside an accumulation window (DDP's no_sync) are its "
                "own. Save a DistributedDataParallel run with trainrec.adapters.torch."
                "DistributedRecorder (each rank's pending gradients kept), or with "
                "DCPRecorder after the optimizer step (no pending .grad)",
                key=f"grads.{name}")


def _check_objects(model: Any, optimizer: Any, scheduler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ours = {id(p) for p in model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in ours for p in group["params"]):
            raise TypeError(f"param group {i} of the optimizer holds a parameter that is not "
                            "in the model: build the optimizer from model.parameters()")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise TypeError(f"scheduler must be a torch LR scheduler or None, got {type(scheduler).__name__}")


def _check_shapes(metadata: Any, target: dict[str, Any], path: Path) -> None:
    """`RecordMismatchError` naming the first model parameter or pending gradient whose
    saved shape or dtype is not the live one's (DCP's own error is a traceback per rank)."""
    saved = metadata.state_dict_metadata
    for group in ("model", "grads"):
        for name, t in target[group].items():
            meta = saved.get(f"{group}.{name}")
            if not isinstance(t, torch.Tensor) or meta is None:
                continue  # DCP names a missing key itself
            if not isinstance(meta, TensorStorageMetadata):
                raise RecordMismatchError(f"{group}.{name} is not a tensor in the checkpoint",
                                          key=f"{group}.{name}", source=str(path))
            if tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
                raise RecordMismatchError(
                    f"{group}.{name} is {str(meta.properties.dtype).removeprefix('torch.')}"
                    f"{list(meta.size)} in the checkpoint, "
                    f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} in the live model: "
                    "build the model the run that saved it had", key=f"{group}.{name}",
                    source=str(path))
