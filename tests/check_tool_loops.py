"""Loops on tools for `trainrec check` (tests/test_check.py): Accelerate with trainrec's
`ExactResume` (the tool's own `save_state` / `load_state` as the workload's
`save_checkpoint` / `load_checkpoint`), and DDP on gloo checked with `--nproc 2`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainrec
import trainrec.adapters.torch as trt
from trainrec import Parts


@trainrec.record
class AccState:  # your counters
    micro: int
    epoch: int


class AccelerateLoop(trainrec.Workload):
    """The README's Accelerate loop: `accelerator.accumulate` over windows of 4, a shuffled
    `StatefulDataLoader` of 10 batches an epoch, `ExactResume` registered for checkpointing."""

    state_type = AccState
    window = 4

    def build(self, seed: int) -> Parts:
        from accelerate import Accelerator, DataLoaderConfiguration
        from torchdata.stateful_dataloader import StatefulDataLoader

        from trainrec.adapters.torch.accelerate import ExactResume

        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(40, 8)
        data = StatefulDataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                  batch_size=4, shuffle=True)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4,
                                  dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        exact = ExactResume(accelerator, model, AccState(micro=0, epoch=0))
        accelerator.register_for_checkpointing(exact)
        return Parts(model, optimizer, None, exact.state,
                     extras={"accelerator": accelerator, "data": data, "exact": exact, "it": None})

    def _next(self, parts: Parts) -> Any:
        if parts.extras["it"] is None:
            parts.extras["it"] = iter(parts.extras["data"])
        try:
            return next(parts.extras["it"])
        except StopIteration:
            parts.state.epoch += 1
            parts.extras["it"] = iter(parts.extras["data"])
            return next(parts.extras["it"])

    def micro_step(self, parts: Parts) -> None:
        accelerator = parts.extras["accelerator"]
        x, y = self._next(parts)
        parts.report_batch(x)
        with accelerator.accumulate(parts.model):
            accelerator.backward(nn.functional.mse_loss(parts.model(x), y))
            parts.optimizer.step()  # Accelerate steps at the window's end only
            parts.optimizer.zero_grad()

    def apply_window(self, parts: Parts, window: int) -> None:
        pass  # the prepared optimizer stepped in the window's last micro-step

    def save_checkpoint(self, parts: Parts, path: Path) -> None:
        parts.extras["accelerator"].save_state(str(path))

    def load_checkpoint(self, parts: Parts, path: Path) -> None:
        parts.extras["accelerator"].load_state(str(path))
        parts.state = parts.extras["exact"].state


@trainrec.record
class DDPState:
    micro: int
    rng: trt.TorchRngRecord | None = None


class DDPLoop(trainrec.Workload):
    """The README's DDP loop: `no_sync()` on all but a window's last micro-step, each rank its
    own batches; the pending gradients are each rank's `.grad`. Run with `nproc=2`."""

    state_type = DDPState
    window = 4

    def build(self, seed: int) -> Parts:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # env://, as trainrec check (or torchrun) sets it
        torch.manual_seed(seed)  # DDP starts every rank from rank 0's parameters anyway
        model = DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(100 + seed + dist.get_rank())  # each rank its own batches and masks
        return Parts(model, optimizer, None, DDPState(micro=0))

    def micro_step(self, parts: Parts) -> None:
        last = (parts.state.micro + 1) % self.window == 0
        with contextlib.nullcontext() if last else parts.model.no_sync():  # one all-reduce a window
            x = torch.randn(16, 8)
            parts.report_batch(x)
            (nn.functional.mse_loss(parts.model(x), x.sum(1, keepdim=True)) / self.window).backward()

    def apply_window(self, parts: Parts, window: int) -> None:
        parts.optimizer.step()
        parts.optimizer.zero_grad()

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = trt.TorchRngRecord.capture()

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply()


class DDPRngNotApplied(DDPLoop):
    def after_restore(self, parts: Parts) -> None:
        pass
