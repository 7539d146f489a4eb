"""Lightning: a `Trainer` with `accumulate_grad_batches` checkpointed in the middle of a
window resumes bitwise through `trainer.fit(ckpt_path=...)`.

Lightning's checkpoint holds the model, optimizers, schedulers, the loops' progress and
(for a `torchdata.stateful_dataloader.StatefulDataLoader`) the data position, but not the
`.grad` summed so far in the window: the resumed window goes on from zero gradients.
`ExactResume` is a `Callback` that carries them, with your own counters::

    exact = ExactResume(state=MyState(seen=0))        # or ExactResume() for none
    trainer = Trainer(accumulate_grad_batches=4, callbacks=[exact, ...])
    trainer.fit(model, train_dataloaders=loader, ckpt_path=path_or_None)
    exact.state                                       # your counters, restored on resume

Any checkpoint Lightning writes carries them: `ModelCheckpoint`, or
`trainer.save_checkpoint(path)` from `on_train_batch_end` for one inside a window.
Use a `StatefulDataLoader` (a plain `DataLoader` restarts the epoch and replays batches) with
its own `generator=` (an iterator made after the resume must not draw from the global RNG
that the uninterrupted run drew from at the start of the epoch).

Needs the extra `trainrec[lightning]`; importing this module imports lightning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - the message is tested with lightning hidden
    raise ImportError("trainrec.adapters.torch.lightning needs lightning, which is not "
                      "installed: pip install 'trainrec[lightning]'", name=e.name) from e

from trainrec import RecordMismatchError
from trainrec.adapter_kit import parse_changes

from .native_check import check_native, schedules_of
from .pending import Pending, pack, unpack
from .rng import TorchRngRecord

__all__ = ["ExactResume"]

_COUNTERS = ("accumulate_grad_batches",)


class ExactResume(pl.Callback):
    """Saves the LightningModule's pending `.grad`, your `state` (a `@trainrec.record`, or
    None) and, with `rng=True`, the RNG states (`TorchRngRecord`: Python, numpy, torch CPU
    and CUDA, and the `generator=` of each train dataloader; Lightning's checkpoint keeps
    none) in every checkpoint, and restores them when `trainer.fit(ckpt_path=...)` resumes:
    at `on_train_start` (after Lightning restored the model, the optimizers and the loops)
    `.grad` is written and `self.state` replaced by the loaded state; the RNG states go back
    at the first `on_train_batch_start` (see there).

    A checkpoint that does not fit (another model, a changed file, a state of another type,
    another `accumulate_grad_batches` or `rng` setting, or written without this callback)
    raises `RecordMismatchError` naming what is wrong, before anything is written: the
    check runs before Lightning loads the checkpoint's weights into the module (Lightning
    calls a callback's `on_load_checkpoint` only after that, so `setup` has the Trainer's
    strategy run it first, from its `load_model_state_dict`). Resuming
    mid-epoch with a train dataloader that keeps no position (a plain `DataLoader`: Lightning
    restarts the epoch and replays batches) raises `ValueError` unless `allow_replay=True`.

    One per Trainer: its checkpoint entry is `trainrec.ExactResume` (Lightning refuses a
    second instance, "Found more than one stateful callback of type `ExactResume`"); keep
    all your counters in one `state` record.

    The optimizers' hyperparameters and the schedules in the checkpoint are compared with
    the live ones as `TrainingRecord.restore` compares them (the payload keeps what the
    schedulers' state dicts lack: their functions, a `functools.partial`'s keywords): a
    difference is a `RecordMismatchError` naming each field, unless `allow_changes` names it
    (the live value is then kept). Lightning builds the optimizers only after it loaded the
    weights, so this check runs when it is about to load the optimizers' state, and a
    refusal there puts the module's weights back as they were (a copy taken just before
    Lightning loaded the checkpoint's).

    Raises `TypeError` when `state` is not a trainrec Record; `ValueError` in a Trainer of
    more than one process (see `setup`), or for a malformed `allow_changes`."""

    def __init__(self, state: Any = None, *, rng: bool = True, allow_replay: bool = False,
                 allow_changes: Iterable[str] | None = None) -> None:
        if state is not None and not (hasattr(state, "into_item")
                                      and hasattr(type(state), "from_item")):
            raise TypeError(f"state must be a trainrec Record (a @trainrec.record dataclass) "
                            f"or None, got {type(state).__name__}")
        self.state = state
        self.rng = bool(rng)
        self.allow_replay = bool(allow_replay)
        self.allow_changes = parse_changes(allow_changes)
        self._weights: dict[str, torch.Tensor] | None = None  # the module's, before Lightning's load
        self._trainer: pl.Trainer | None = None
        self._pending: Pending | None = None
        self._checked: Any = None  # the checkpoint dict `_pending` was checked from
        self._rng: TorchRngRecord | None = None

    @property
    def state_key(self) -> str:
        return "trainrec.ExactResume"

    def state_dict(self) -> dict[str, Any]:
        """Lightning calls this while it writes a checkpoint (`trainer.lightning_module`
        is the model whose `.grad` is saved)."""
        trainer = self._trainer
        if trainer is None:
            raise ValueError("ExactResume.state_dict() is called by a Trainer saving a "
                             "checkpoint; pass the callback to Trainer(callbacks=[...])")
        payload = pack(trainer.lightning_module, self.state,
                       {"accumulate_grad_batches": int(trainer.accumulate_grad_batches)},
                       rng=TorchRngRecord.capture(*_generators(trainer)) if self.rng else None)
        payload["schedules"] = schedules_of([c.scheduler for c in trainer.lr_scheduler_configs])
        return payload

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing: `on_load_checkpoint` reads the same entry and checks it first."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Raises `ValueError` for more than one process (Lightning writes the callbacks'
        state from rank 0 only: every rank would load rank 0's pending gradients)."""
        if trainer.world_size != 1:
            raise ValueError(
                f"ExactResume supports one process, this Trainer has world_size "
                f"{trainer.world_size}: Lightning saves callback state from rank 0 only, so each "
                "rank's own pending gradients would be lost"
            )
        self._trainer = trainer
        self._check_before_the_weights(trainer)

    def _check_before_the_weights(self, trainer: pl.Trainer) -> None:
        """Make the Trainer's strategy check a checkpoint against this callback before it
        loads the checkpoint's weights into the module: Lightning restores the model
        (`Strategy.load_model_state_dict`) before it calls any callback's
        `on_load_checkpoint`, so a refusal there came with the weights already loaded."""
        strategy = trainer.strategy
        load = strategy.load_model_state_dict
        if getattr(load, "_trainrec_checks", None) is self:
            return  # a second fit with this Trainer

        def load_model_state_dict(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
            module = trainer.lightning_module
            if module is not None and isinstance(checkpoint, dict):
                self.on_load_checkpoint(trainer, module, checkpoint)
                if "optimizer_states" in checkpoint:  # a resume: kept for a later refusal
                    self._weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
            return load(checkpoint, *args, **kwargs)

        load_optimizer_state_dict = strategy.load_optimizer_state_dict

        def load_optimizers(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
            self._check_schedules(trainer, checkpoint)
            return load_optimizer_state_dict(checkpoint, *args, **kwargs)

        load_model_state_dict._trainrec_checks = self  # type: ignore[attr-defined]
        strategy.load_model_state_dict = load_model_state_dict  # type: ignore[method-assign]
        strategy.load_optimizer_state_dict = load_optimizers  # type: ignore[method-assign]

    def _check_schedules(self, trainer: pl.Trainer, checkpoint: Any) -> None:
        """The checkpoint's optimizer hyperparameters and schedules against the live ones
        (`native_check`); the allowed live values written into the checkpoint dict that
        Lightning loads next. On a refusal the module gets its weights back first."""
        weights, self._weights = self._weights, None
        if not isinstance(checkpoint, dict):
            return
        optimizer_states = checkpoint.get("optimizer_states") or []
        scheduler_states = checkpoint.get("lr_schedulers") or []
        payload = checkpoint.get("callbacks", {}).get(self.state_key)
        identities = payload.get("schedules") if isinstance(payload, dict) else None
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        try:
            kept = check_native(trainer.optimizers, optimizer_states, schedulers, scheduler_states,
                                identities if isinstance(identities, list) else None,
                                self.allow_changes, "the Lightning checkpoint")
        except (RecordMismatchError, ValueError):
            module = trainer.lightning_module
            if weights is not None and module is not None:
                with torch.no_grad():
                    for k, v in module.state_dict().items():
                        v.copy_(weights[k])
            self._pending = self._checked = None
            raise
        kept.into_states(optimizer_states, scheduler_states)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Check the checkpoint's entry against `pl_module` and keep it for
        `on_train_start`; raises `RecordMismatchError` when it does not fit. (Checked once
        a checkpoint: the strategy calls this before it loads the weights, Lightning again
        after.)"""
        if checkpoint is self._checked and self._pending is not None:
            return
        source = "Lightning checkpoint (trainrec ExactResume)"
        payload = checkpoint.get("callbacks", {}).get(self.state_key)
        if payload is None:
            raise RecordMismatchError(
                f"{source}: the checkpoint holds no ExactResume entry (it was written without "
                "the callback), so the pending gradients of its window are lost; resume from a "
                "checkpoint written with ExactResume in Trainer(callbacks=[...])"
            )
        pending = unpack(payload, pl_module, None if self.state is None else type(self.state),
                         _COUNTERS, source=source, rng=self.rng)
        saved, want = pending.counters["accumulate_grad_batches"], int(trainer.accumulate_grad_batches)
        if saved != want:
            raise RecordMismatchError(
                f"{source}: written with accumulate_grad_batches={saved}, the Trainer has {want}: "
                "the pending gradients belong to another window; resume with the same "
                "accumulate_grad_batches"
            )
        self._pending, self._checked = pending, checkpoint

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending, self._pending, self._checked = self._pending, None, None
        if pending is None:
            return
        replaying = [type(dl).__name__ for dl in _leaves(trainer.train_dataloader)
                     if not (hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict"))]
        if replaying and trainer.fit_loop.restarted_mid_epoch and not self.allow_replay:
            raise ValueError(
                f"resuming in the middle of an epoch with a {replaying[0]} that keeps no position: "
                "Lightning restarts its epoch, replaying batches the checkpointed run already "
                "trained on; use torchdata.stateful_dataloader.StatefulDataLoader, or pass "
                "ExactResume(allow_replay=True) to accept the replay"
            )
        generators = _generators(trainer)
        if pending.rng is not None and len(pending.rng.generators) != len(generators):
            raise RecordMismatchError(
                f"Lightning checkpoint (trainrec ExactResume) holds the generators of "
                f"{len(pending.rng.generators)} train dataloaders, the Trainer's have "
                f"{len(generators)}: resume with the same dataloaders (generator= given or not)"
            )
        pending.apply(pl_module)
        if self.state is not None:
            self.state = pending.state
        self._rng = pending.rng

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """The RNG states go back once the resumed epoch's iterator exists: making it draws
        from the loader's generator (or the global RNG), which the uninterrupted run did at
        the start of the epoch, and restoring a `StatefulDataLoader` sets its generator to
        the epoch's start; its state at the save is what the next epoch's shuffle needs."""
        rng, self._rng = self._rng, None
        if rng is not None:
            rng.apply(*_generators(trainer))


def _generators(trainer: pl.Trainer) -> list[torch.Generator]:
    """The `generator=` of each train dataloader that has one, in order, each once."""
    out: list[torch.Generator] = []
    for dl in _leaves(trainer.train_dataloader):
        g = getattr(dl, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in out):
            out.append(g)
    return out


def _leaves(loaders: Any) -> list[Any]:
    """The dataloaders in Lightning's `train_dataloader` (one, or a list / dict of them)."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [leaf for v in loaders.values() for leaf in _leaves(v)]
    if isinstance(loaders, (list, tuple)):
        return [leaf for v in loaders for leaf in _leaves(v)]
    return [loaders]
