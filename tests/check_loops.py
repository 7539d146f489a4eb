"""PyTorch loops for `trainrec check` (tests/test_check.py): the README's loop as a
`trainrec.Workload`, and broken variants of it, each with one mistake people make.

Each is importable as `check_loops:NAME` in the check's fresh processes (this directory is
on their import path, as it is on the tests').
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import trainrec
import trainrec.adapters.torch as trt
from trainrec import GradientsAccumulator, Parts


@trainrec.record
class State:  # what trainrec cannot guess: your counters and your RNG states
    micro: int
    rng: trt.TorchRngRecord | None = None


class ReadmeLoop(trainrec.Workload):
    """The README's PyTorch loop: windows of 4 micro-batches, clipping, cosine schedule."""

    state_type = State
    window = 4

    def build(self, seed: int) -> Parts:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
        return Parts(model, optimizer, scheduler, State(micro=0))

    def batch(self, parts: Parts) -> torch.Tensor:
        return torch.randn(16, 8)  # the data and the dropout masks come from torch's RNG

    def micro_step(self, parts: Parts) -> None:
        x = self.batch(parts)
        parts.report_batch(x)
        loss = nn.functional.mse_loss(parts.model(x), x.sum(1, keepdim=True)) / self.window
        loss.backward()
        parts.accumulator.accumulate(parts.model, trt.grads_from(parts.model))

    def apply_window(self, parts: Parts, window: int) -> None:
        trt.set_grads(parts.model, parts.accumulator.grads())
        nn.utils.clip_grad_norm_(parts.model.parameters(), max_norm=1.0)
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = trt.TorchRngRecord.capture()

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()


class RngNotApplied(ReadmeLoop):
    """The RNG is recorded, but the resume never puts it back."""

    def after_restore(self, parts: Parts) -> None:
        pass


class NewAccumulator(ReadmeLoop):
    """The resume starts a new accumulator: the window's pending gradients are lost."""

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()
        parts.accumulator = GradientsAccumulator()


class OptimizerRebuilt(ReadmeLoop):
    """The resume builds a new optimizer over the restored model (moments lost)."""

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()
        parts.optimizer = torch.optim.AdamW(parts.model.parameters(), lr=1e-2)
        parts.scheduler.optimizer = parts.optimizer


class SchedulerRebuilt(ReadmeLoop):
    """The resume builds a new LR scheduler: the schedule starts over."""

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()
        parts.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(parts.optimizer, T_max=6)


class GeneratorNotRecorded(ReadmeLoop):
    """The batches come from a `torch.Generator` of the loop's own, which the state lacks."""

    def build(self, seed: int) -> Parts:
        parts = super().build(seed)
        parts.extras["data_gen"] = torch.Generator().manual_seed(seed + 1)
        return parts

    def batch(self, parts: Parts) -> torch.Tensor:
        return torch.randn(16, 8, generator=parts.extras["data_gen"])


class CursorOutside(ReadmeLoop):
    """A dataset read in order, with its cursor kept beside the recorded state."""

    def build(self, seed: int) -> Parts:
        parts = super().build(seed)
        parts.extras["data"] = torch.randn(64 * 16, 8, generator=torch.Generator().manual_seed(7))
        parts.extras["cursor"] = 0
        return parts

    def micro_step(self, parts: Parts) -> None:
        start = parts.extras["cursor"]
        parts.extras["cursor"] = start + 16
        ids = list(range(start, start + 16))
        parts.report_batch(ids)
        x = parts.extras["data"][ids]
        loss = nn.functional.mse_loss(parts.model(x), x.sum(1, keepdim=True)) / self.window
        loss.backward()
        parts.accumulator.accumulate(parts.model, trt.grads_from(parts.model))


class ScalerNotRecorded(ReadmeLoop):
    """A GradScaler (its scale doubles every window) that the state does not carry."""

    def build(self, seed: int) -> Parts:
        parts = super().build(seed)
        parts.extras["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
        return parts

    def micro_step(self, parts: Parts) -> None:
        x = self.batch(parts)
        parts.report_batch(x)
        loss = nn.functional.mse_loss(parts.model(x), x.sum(1, keepdim=True)) / self.window
        parts.extras["scaler"].scale(loss).backward()
        parts.accumulator.accumulate(parts.model, trt.grads_from(parts.model))

    def apply_window(self, parts: Parts, window: int) -> None:
        scaler: Any = parts.extras["scaler"]
        trt.set_grads(parts.model, parts.accumulator.grads())
        scaler.step(parts.optimizer)
        scaler.update()
        parts.scheduler.step()
        parts.optimizer.zero_grad()


README_LOOP = ReadmeLoop()
