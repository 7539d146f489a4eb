"""`TorchModule`: an `nn.Module`'s parameters and buffers as a record, and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainrec import RecordMismatchError, StateRecord, TensorData
from trainrec.adapter_kit import Item, check_tensor_map, expect_kind

from .backend import TorchBackend, from_torch_dtype, numpy_to_tensor
from .state_values import _BACKEND
from .wrappers import named_parameters, named_state, refuse_dtensors

# -- module -------------------------------------------------------------------------------


class TorchModule:
    """A native `nn.Module` as an `AutodiffModule`."""

    kind = "torch.nn.Module"

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected torch.nn.Module, got {type(module).__name__}")
        self.module = module

    @property
    def backend(self) -> TorchBackend:
        return _BACKEND

    def param_ids(self) -> list[str]:
        return [name for name, _ in named_parameters(self.module)]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in named_parameters(self.module)}

    def _live(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Unique state tensors by name, and aliases (tied names) -> the name kept.
        `RecorderError` for sharded (DTensor) state."""
        unique: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[int, str] = {}
        state = named_state(self.module)
        refuse_dtensors(state, "state tensor")
        for name, t in state:
            if id(t) in seen:
                aliases[name] = seen[id(t)]
            else:
                seen[id(t)] = name
                unique[name] = t
        return unique, aliases

    def into_record(self) -> StateRecord:
        unique, aliases = self._live()
        tensors: dict[str, Item] = {
            k: TensorData.from_array(_BACKEND.to_host(v), copy=False) for k, v in unique.items()
        }
        aliases_item: dict[str, Item] = dict(aliases)
        params = named_parameters(self.module)
        refuse_dtensors([(n, p.grad) for n, p in params], "the gradient of")
        grads: dict[str, Item] = {
            name: TensorData.from_array(_BACKEND.to_host(p.grad), copy=False)
            for name, p in params
            if p.grad is not None
        }
        return StateRecord(self.kind, {"tensors": tensors, "aliases": aliases_item, "grads": grads})

    def _checked(
        self, record: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, TensorData], dict[str, TensorData]]:
        item = expect_kind(record, self.kind, "model")
        if not isinstance(item, dict) or set(item) != {"tensors", "aliases", "grads"}:
            raise RecordMismatchError(
                "torch module record must be {tensors, aliases, grads}", key="model"
            )
        unique, aliases = self._live()
        if item["aliases"] != aliases:
            raise RecordMismatchError(
                f"tied parameters differ: record {item['aliases']!r}, live {aliases}", key="model.aliases"
            )
        expected = {k: (tuple(v.shape), from_torch_dtype(v.dtype)) for k, v in unique.items()}
        params = {k: (tuple(p.shape), from_torch_dtype(p.dtype)) for k, p in named_parameters(self.module)}
        return (
            unique,
            check_tensor_map(item["tensors"], expected, "model"),
            check_tensor_map(item["grads"], params, "model.grads", allow_subset=True),
        )

    def check_record(self, record: Any) -> None:
        self._checked(record)

    def load_record(self, record: Any, device: Any) -> None:
        live, tensors, grads = self._checked(record)
        staged = {k: numpy_to_tensor(t.array).to(live[k].dtype) for k, t in tensors.items()}
        params = dict(named_parameters(self.module))
        staged_grads = {
            k: numpy_to_tensor(t.array).to(device=params[k].device, dtype=params[k].dtype)
            for k, t in grads.items()
        }
        with torch.no_grad():
            for k, v in staged.items():
                live[k].copy_(v)
        for k, p in params.items():
            p.grad = staged_grads.get(k)


def _torch_module(module: Any) -> nn.Module:
    if isinstance(module, TorchModule):
        return module.module
    if isinstance(module, nn.Module):
        return module
    raise TypeError(f"the torch optimizer binding needs a torch model, got {type(module).__name__}")
