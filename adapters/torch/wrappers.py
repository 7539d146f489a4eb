"""Wrappers are transparent: a model's ParamIds are the names inside its wrappers.

`torch.compile(model)` (an `OptimizedModule`, which prefixes `_orig_mod.`),
`DistributedDataParallel` and `nn.DataParallel` (which prefix `module.`) hold the very
parameter objects of the model they wrap, so its ParamIds, state and optimizer state
are the wrapped model's, under the wrapped model's names. Wrappers are peeled at the
root, nested in any order (`torch.compile(DDP(model))`), and inside the model too (a
block compiled on its own, `model.blocks[0] = torch.compile(block)`): every name
component that only enters a wrapper is dropped. A record captured through wrappers
restores into the plain model and the reverse.

FSDP2 (`fully_shard`) renames nothing, but its parameters are `DTensor`s sharded
across ranks: `refuse_dtensors` says so, clearly, wherever trainrec would copy one, and
points to `DCPRecorder`, which saves them through `torch.distributed.checkpoint`.

Wrapper types are found without importing what the caller has not imported
(`torch._dynamo`, `torch.distributed.tensor`): a type whose module is not loaded
cannot have instances.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from trainrec import RecorderError

__all__ = ["unwrap", "named_parameters", "named_state", "refuse_dtensors", "is_dtensor"]


def _wrapped_attr(module: nn.Module) -> str | None:
    """The child name under which `module`, when it is a wrapper, holds the model."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        return "_orig_mod"
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return "module"
    return None


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside `torch.compile`, `DistributedDataParallel` and `nn.DataParallel`
    wrappers, nested in any order; `module` itself when it is none of them."""
    while (attr := _wrapped_attr(module)) is not None:
        module = module._modules[attr]  # type: ignore[assignment]  # a wrapper always holds it
    return module


def _has_inner_wrappers(root: nn.Module) -> bool:
    return any(_wrapped_attr(m) is not None for m in root.modules())


def _clean(root: nn.Module, name: str) -> str:
    """`name` (a dotted path from `root`) without the components that enter a wrapper."""
    out: list[str] = []
    mod: nn.Module | None = root
    for part in name.split("."):
        if mod is not None and _wrapped_attr(mod) == part:
            mod = mod._modules[part]
            continue
        out.append(part)
        mod = None if mod is None else mod._modules.get(part)
    return ".".join(out)


def _renamed(root: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    if not _has_inner_wrappers(root):
        yield from pairs
        return
    for name, t in pairs:
        yield _clean(root, name), t


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`named_parameters()` of the model inside any wrappers, by ParamId (the names the
    plain model gives them)."""
    root = unwrap(module)
    return list(_renamed(root, root.named_parameters()))  # type: ignore[arg-type]


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`state_dict(keep_vars=True)` of the model inside any wrappers, by the plain
    model's names. `TypeError` for an entry that is not a tensor."""
    root = unwrap(module)
    items = []
    for name, t in root.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entry {name!r} is {type(t).__name__}, not a tensor")
        items.append((name, t))
    return list(_renamed(root, items))


def is_dtensor(t: object) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (a sharded or replicated
    tensor of FSDP2 / tensor parallelism)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def refuse_dtensors(named: Iterable[tuple[str, object]], what: str) -> None:
    """Raise `RecorderError` when any of `named` is a `DTensor`: a record holds whole
    tensors of one process, and copying a shard as if it were the tensor would lose the
    other ranks' parts."""
    for name, t in named:
        if is_dtensor(t):
            raise RecorderError(
                f"{what} {name!r} is a DTensor (sharded by FSDP2's fully_shard, or by tensor "
                "parallelism): a TrainingRecord holds one process's whole tensors, and a "
                "shard is not one. Save sharded training with "
                "trainrec.adapters.torch.DCPRecorder (torch.distributed.checkpoint: model, "
                "optimizer and pending gradients, resharded on load); for data parallelism "
                "with whole parameters on every rank use DistributedDataParallel with "
                "trainrec.adapters.torch.DistributedRecorder",
                key=f"model.{name}")
