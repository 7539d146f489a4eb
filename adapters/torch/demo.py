"""PyTorch workloads for `trainrec demo` and the exact-continuation tests.

- `default`: MLP with dropout, AdamW, OneCycleLR;
- `conv`: conv net with BatchNorm, SGD nesterov + weight decay, CosineAnnealingWarmRestarts;
- `bf16`: bf16 MLP whose gradients are accumulated in f32 (`accumulate_with_dtype`).

Batches and dropout masks come from torch's global CPU generator, whose state the
caller's record carries (`TorchRngRecord`). `device` is "cpu" unless
`TRAINREC_DEMO_DEVICE` says otherwise (e.g. "cuda:0").
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

import trainrec
from trainrec import FloatDType, Recorder
from trainrec.adapter_kit import Parts, Workload

from .grads import grads_from, set_grads
from .recorder import TorchFileRecorder
from .rng import TorchRngRecord

__all__ = ["TorchDemoState", "TorchWorkload", "WORKLOADS", "WORKLOAD"]


@trainrec.record
class TorchDemoState:
    micro: int
    losses: list[float]
    rng: TorchRngRecord | None = None


class TorchWorkload(Workload):
    name = "torch"
    ref = "trainrec.adapters.torch.demo:WORKLOAD"
    state_type = TorchDemoState
    recorders: ClassVar[dict[str, Recorder]] = {
        "torch": TorchFileRecorder(trainrec.NativePrecisionSettings()),
        "torch-full": TorchFileRecorder(),
    }

    def __init__(self, variant: str = "default") -> None:
        self.variant = variant
        self.device = os.environ.get("TRAINREC_DEMO_DEVICE", "cpu")
        if variant != "default":
            self.ref = f"trainrec.adapters.torch.demo:WORKLOADS_{variant.upper()}"

    def build(self, seed: int) -> Parts:
        torch.set_num_threads(1)  # one thread: the same float summation order in every process
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        model: nn.Module
        if self.variant == "conv":
            model = nn.Sequential(
                nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
            )
        else:
            model = nn.Sequential(
                nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                nn.Dropout(0.1), nn.Linear(32, 4),
            )
        if self.variant == "bf16":
            model = model.to(torch.bfloat16)
        model = model.to(self.device)
        opt: torch.optim.Optimizer
        sched: Any
        if self.variant == "conv":
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                  weight_decay=1e-4)
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=50)
        return Parts(model, opt, sched, TorchDemoState(0, []))

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.variant == "conv":
            x = torch.randn(6, 2, 5, 5)
            y = torch.stack([x.mean((1, 2, 3)), x.std((1, 2, 3)), x[:, 0, 2, 2]], dim=1)
        else:
            x = torch.randn(8, 16)
            y = torch.tanh(x[:, :4] * 2.0)
        dtype = torch.bfloat16 if self.variant == "bf16" else torch.float32
        return x.to(self.device, dtype), y.to(self.device, dtype)

    def micro_step(self, parts: Parts) -> None:
        x, y = self._batch()
        parts.model.train()
        loss = nn.functional.mse_loss(parts.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        grads = grads_from(parts.model)
        if self.variant == "bf16":
            parts.accumulator.accumulate_with_dtype(parts.model, grads, FloatDType.F32)
        else:
            parts.accumulator.accumulate(parts.model, grads)
        parts.state.losses.append(float(loss.detach().float()))

    def apply_window(self, parts: Parts, window: int) -> None:
        grads = parts.accumulator.grads()
        for _, g in grads.items():
            g.div_(window)
        set_grads(parts.model, grads)
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = TorchRngRecord.capture()

    def native_grads(self, parts: Parts) -> dict[str, np.ndarray[Any, Any]] | None:
        """Each parameter's `.grad`, where one is pending."""
        return {n: p.grad.detach().cpu().float().numpy() for n, p in parts.model.named_parameters()
                if p.grad is not None}

    def set_native_grads(self, parts: Parts, grads: dict[str, np.ndarray[Any, Any]]) -> None:
        for n, p in parts.model.named_parameters():
            p.grad = torch.from_numpy(grads[n]).to(p.device, p.dtype) if n in grads else None

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()


WORKLOADS = {name: TorchWorkload(name) for name in ("default", "conv", "bf16")}
WORKLOAD = WORKLOADS["default"]
WORKLOADS_CONV, WORKLOADS_BF16 = WORKLOADS["conv"], WORKLOADS["bf16"]
