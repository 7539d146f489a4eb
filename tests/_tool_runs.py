"""Training runs driven by Accelerate or Lightning, one per process, for
tests/test_accelerate_lightning.py: an uninterrupted run, a run checkpointed after a
micro-step inside an accumulation window, and its resume in a fresh process.

    python _tool_runs.py TOOL OUT JOB [JOB ...]     JOB = MODE:KIND:CKPT[:SAVE_AT]
    TOOL: accelerate | lightning; MODE: full | save | resume; KIND: exact (trainrec's
    ExactResume; accelerate: with options joined by "+", see accelerate_run) | plain (the
    tool alone; the caller's counters kept by the tool's own means) | replay (lightning:
    ExactResume with a plain DataLoader) | replay_allowed (the same, with allow_replay=True)

The jobs run one after the other (each seeds everything anew); `OUT` receives
`torch.save([result, ...])`, a result being `{"params", "losses", "pending_at_save",
"pending_at_start"}` (those that apply) or `{"error": "Type: message"}`.
40 samples in batches of 4 (10 micro-batches an epoch), windows of 4, 2 epochs, AdamW,
cosine LR, dropout, shuffled data from the loader's own generator (accelerate: unless the
option nogen).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import trainrec

warnings.filterwarnings("ignore")
WINDOW, EPOCHS = 4, 2


@trainrec.record
class State:
    micro: int
    epoch: int
    losses: list[float]


def _data(stateful: bool = True, generator: bool = True) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    x = torch.randn(40, 8)
    loader = StatefulDataLoader if stateful else torch.utils.data.DataLoader
    return loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                  shuffle=True, generator=torch.Generator().manual_seed(1) if generator else None)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))


class _StoppedError(Exception):
    pass


def _pending(model: nn.Module) -> int:
    return sum(p.grad is not None for p in model.parameters())


def accelerate_run(mode: str, kind: str, ckpt: str, save_at: int) -> dict:
    from accelerate import Accelerator, DataLoaderConfiguration

    from trainrec.adapters.torch.accelerate import ExactResume

    class Counters:  # what an Accelerate user registers for their counters without trainrec
        def __init__(self, state: State) -> None:
            self.state = state

        def state_dict(self) -> dict:
            return {"micro": self.state.micro, "epoch": self.state.epoch,
                    "losses": list(self.state.losses)}

        def load_state_dict(self, sd: dict) -> None:
            self.state = State(**sd)

    # options: nogen (no generator=), seedable (use_seedable_sampler), plainloader (prepare a
    # torch DataLoader, Accelerate makes the StatefulDataLoader), unfixed (the broken variant)
    kind, *options = kind.split("+")
    if "unfixed" in options:  # the broken variant: the dataloaders are left as load_state left them
        fixed = ExactResume.__dict__["_resume_loaders"]
        ExactResume._resume_loaders = staticmethod(lambda *args: None)  # type: ignore[method-assign]
        try:
            return accelerate_run(mode, "+".join([kind] + [o for o in options if o != "unfixed"]),
                                  ckpt, save_at)
        finally:
            ExactResume._resume_loaders = fixed  # type: ignore[method-assign]
    torch.manual_seed(0)
    model, data = _net(), _data("plainloader" not in options, generator="nogen" not in options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    config = DataLoaderConfiguration(use_stateful_dataloader=True,
                                     use_seedable_sampler="seedable" in options)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=WINDOW, dataloader_config=config)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    holder = (ExactResume(accelerator, model, State(0, 0, [])) if kind == "exact"
              else Counters(State(0, 0, [])))
    accelerator.register_for_checkpointing(holder)
    out: dict = {}
    if mode == "resume":
        accelerator.load_state(ckpt)
        out["pending_at_start"] = _pending(model)
    while holder.state.epoch < EPOCHS:
        for x, y in data:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            holder.state.micro += 1
            holder.state.losses.append(loss.item())
            if mode == "save" and holder.state.micro == save_at:
                out["pending_at_save"] = _pending(model)
                accelerator.save_state(ckpt)
                return out
        holder.state.epoch += 1
    return {**out, "params": accelerator.unwrap_model(model).state_dict(),
            "losses": holder.state.losses}


def lightning_run(mode: str, kind: str, ckpt: str, save_at: int) -> dict:
    import lightning.pytorch as pl

    from trainrec.adapters.torch.lightning import ExactResume

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)}

    out: dict = {}

    class SaveInsideWindow(pl.Callback):  # Lightning's own hooks save after optimizer steps
        seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.seen += 1
            if mode == "save" and self.seen == save_at:
                out["pending_at_save"] = _pending(pl_module)
                trainer.save_checkpoint(ckpt)
                raise _StoppedError  # the process ends here, as if killed

    class Report(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            out["pending_at_start"] = _pending(pl_module)

    pl.seed_everything(0, verbose=False)
    data, model = _data(stateful=not kind.startswith("replay")), Net()
    callbacks: list[pl.Callback] = []
    if kind in ("exact", "replay", "replay_allowed"):
        callbacks.append(ExactResume(allow_replay=kind == "replay_allowed"))
    callbacks += [SaveInsideWindow(), Report()]
    trainer = pl.Trainer(max_epochs=EPOCHS, accumulate_grad_batches=WINDOW, accelerator="cpu",
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    try:
        trainer.fit(model, data, ckpt_path=ckpt if mode == "resume" else None)
    except _StoppedError:
        return out
    return {**out, "params": model.net.state_dict(), "losses": model.losses}


if __name__ == "__main__":
    tool, path, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
    run = accelerate_run if tool == "accelerate" else lightning_run
    results = []
    for job in jobs:
        mode, kind, ckpt, *at = job.split(":")
        try:
            results.append(run(mode, kind, ckpt, int(at[0]) if at else 0))
        except Exception as e:  # the test asserts on it
            results.append({"error": f"{type(e).__name__}: {e}"})
    torch.save(results, path)
