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


# -- Lightning: a Trainer's own loop, paused after every batch ---------------------------------


class FitStepper:
    """Drives `trainer.fit` one training batch at a time, for a `Workload` whose loop is
    Lightning's: the fit runs in a thread of its own, and the `Callback` this gives
    (`callback`, last in the Trainer's list) pauses it at `on_train_start` (after Lightning
    and `ExactResume` restored everything a checkpoint holds) and at every
    `on_train_batch_end` (where Lightning's own `ModelCheckpoint(every_n_train_steps=...)`
    saves). `start(fit)` runs `fit()` up to its first pause; `step()` lets it train one
    batch (the optimizer steps inside it at a window's end, as Lightning steps); `call(fn)`
    runs `fn()` in the paused fit thread, where Lightning expects `trainer.save_checkpoint`.
    The two threads never run at once: the driver's reads of the model, optimizer and
    `.grad` see the state Lightning left at the pause."""

    def __init__(self) -> None:
        import threading

        import lightning.pytorch as pl

        stepper = self

        class Pause(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                stepper._pause()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                stepper._pause()

        self.callback = Pause()
        self._turn = threading.Condition()
        self._fit_runs = False  # whose turn it is: the fit thread's or the driver's
        self._task: Any = None
        self._failure: BaseException | None = None
        self._ended = False

    def _pause(self) -> None:  # in the fit thread
        while True:
            with self._turn:
                self._fit_runs = False
                self._turn.notify_all()
                self._turn.wait_for(lambda: self._fit_runs)
                task, self._task = self._task, None
            if task is None:
                return
            task()  # a call(fn): run it here, then pause again

    def _hand_over(self, task: Any = None) -> None:  # in the driver
        with self._turn:
            self._task, self._fit_runs = task, True
            self._turn.notify_all()
            self._turn.wait_for(lambda: not self._fit_runs)
        if self._failure is not None:
            raise RuntimeError("trainer.fit raised") from self._failure
        if self._ended:
            raise RuntimeError("trainer.fit ended before the check's last micro-step: give it "
                               "more max_epochs")

    def start(self, fit: Any) -> None:
        import threading

        def run() -> None:
            try:
                fit()
            except BaseException as e:  # noqa: BLE001 - handed to the driver
                self._failure = e
            with self._turn:
                self._ended, self._fit_runs = True, False
                self._turn.notify_all()

        with self._turn:
            self._fit_runs = True
        threading.Thread(target=run, daemon=True, name="trainer.fit").start()
        with self._turn:
            self._turn.wait_for(lambda: not self._fit_runs)
        if self._failure is not None:
            raise RuntimeError("trainer.fit raised") from self._failure

    def step(self) -> None:
        self._hand_over()

    def call(self, fn: Any) -> None:
        self._hand_over(fn)


@trainrec.record
class LightningState:  # your counters, kept by ExactResume
    micro: int


class LightningLoop(trainrec.Workload):
    """A LightningModule trained by `Trainer(accumulate_grad_batches=4)` with trainrec's
    `ExactResume`: AdamW, a cosine schedule stepped every optimizer step, dropout, a
    shuffled `StatefulDataLoader` of 8 batches an epoch with its own generator. The
    checkpoint is Lightning's own (`trainer.save_checkpoint` in `on_train_batch_end`, in
    the middle of a window), the resume Lightning's own (`trainer.fit(ckpt_path=...)`).

    Lightning runs its loop itself, so `micro_step` cannot call one: a `FitStepper` runs
    `trainer.fit` in a thread paused after every batch, and `micro_step` lets it train one;
    the window's optimizer step happens inside the batch that ends it (`apply_window` does
    nothing). The fit starts at the first micro-step (`optimizer` and `scheduler` exist
    once Lightning called `configure_optimizers`), or at the restore."""

    state_type = LightningState
    window = 4
    exact_resume = True

    def build(self, seed: int) -> Parts:
        import lightning.pytorch as pl
        from torchdata.stateful_dataloader import StatefulDataLoader

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                x, y = batch
                return nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self) -> Any:
                opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
                cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

        pl.seed_everything(seed, verbose=False)
        x = torch.randn(32, 8)
        data = StatefulDataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                  batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(seed + 1))
        model, state, stepper = Net(), LightningState(micro=0), FitStepper()
        keep = self.keeper(state)
        trainer = pl.Trainer(max_epochs=100, accumulate_grad_batches=self.window,
                             accelerator="cpu", callbacks=[keep, stepper.callback], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, deterministic=True)
        return Parts(model, None, None, state,
                     extras={"trainer": trainer, "stepper": stepper, "loader": data, "keep": keep})

    def keeper(self, state: Any) -> Any:
        """The callback that keeps the state (and the pending gradients) in the checkpoint."""
        from trainrec.adapters.torch.lightning import ExactResume

        return ExactResume(state=state)

    def _fit(self, parts: Parts, ckpt_path: str | None) -> None:
        trainer = parts.extras["trainer"]
        parts.extras["stepper"].start(
            lambda: trainer.fit(parts.model, train_dataloaders=parts.extras["loader"],
                                ckpt_path=ckpt_path))
        parts.optimizer = trainer.optimizers[0]
        parts.scheduler = trainer.lr_scheduler_configs[0].scheduler

    def micro_step(self, parts: Parts) -> None:
        if parts.optimizer is None:
            self._fit(parts, None)
        parts.extras["stepper"].step()

    def apply_window(self, parts: Parts, window: int) -> None:
        pass  # Lightning stepped the optimizer and the scheduler in the window's last batch

    def save_checkpoint(self, parts: Parts, path: Path) -> None:
        trainer = parts.extras["trainer"]
        parts.extras["stepper"].call(lambda: trainer.save_checkpoint(str(path)))

    def load_checkpoint(self, parts: Parts, path: Path) -> None:
        self._fit(parts, str(path))
        parts.state = parts.extras["keep"].state


class Counters:
    """What a Lightning user keeps counters with, without trainrec: a stateful callback."""

    def __new__(cls, state: Any) -> Any:
        import lightning.pytorch as pl

        class CountersCallback(pl.Callback):
            def __init__(self) -> None:
                self.state = state

            def state_dict(self) -> dict[str, Any]:
                return {"micro": self.state.micro}

            def load_state_dict(self, sd: dict[str, Any]) -> None:
                self.state = LightningState(micro=sd["micro"])

        return CountersCallback()


class LightningAlone(LightningLoop):
    """The same loop checkpointed by Lightning alone (its counters in a stateful callback):
    Lightning's checkpoint holds no `.grad`, so the window's pending gradients are lost."""

    def keeper(self, state: Any) -> Any:
        return Counters(state)
