"""Hugging Face Accelerate: `save_state` / `load_state` in the middle of an accumulation
window resume bitwise.

Accelerate's `save_state` writes the model, optimizer, schedulers, RNG states, its step
counter and (with `DataLoaderConfiguration(use_stateful_dataloader=True)`) the data position,
but not the `.grad` that `accelerator.accumulate(model)` has summed so far: after
`load_state` the window goes on from zero gradients. `ExactResume` is an object for
`accelerator.register_for_checkpointing` that carries them, with your own counters::

    exact = ExactResume(accelerator, model, state=MyState(micro=0))
    accelerator.register_for_checkpointing(exact)   # before save_state and load_state
    ...
    exact.state.micro += 1                          # your counters live in exact.state
    accelerator.save_state(directory)               # anywhere, mid-window too
    ...
    accelerator.load_state(directory)               # .grad, exact.state, accelerator.step

It also makes the data order exact across epochs. Accelerate's `load_state` restores a
`StatefulDataLoader`'s position (`use_stateful_dataloader=True`) and the global RNG, but the
resumed epoch's iterator is made later, by the first `for batch in loader`, and making it
draws again: torch's `_BaseDataLoaderIter` takes a base seed from the loader's `generator=`
(the global RNG without one) and torchdata's `RandomSampler` iterator sets the sampler's
generator back to the epoch's start and redraws the permutation. The uninterrupted run made
those draws at the start of the epoch, so after the resume the loader's generator (or the
global RNG, and with it dropout) is one draw behind and the next epoch is shuffled
differently. `ExactResume` saves those generators and each loader's epoch counter
(`iteration`, which Accelerate keeps out of its checkpoint and a `SeedableRandomSampler`
seeds from); on load it makes the resumed iterator at once (`StatefulDataLoader.state_dict()`
makes the iterator that the next `iter()` returns) and then puts the generators and the
global RNG back as they were at the save.

Needs the extra `trainrec[accelerate]`; importing this module imports accelerate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import accelerate
except ImportError as e:  # pragma: no cover - the message is tested with accelerate hidden
    raise ImportError("trainrec.adapters.torch.accelerate needs accelerate, which is not "
                      "installed: pip install 'trainrec[accelerate]'", name=e.name) from e

from accelerate.data_loader import SeedableRandomSampler, get_sampler
from torch.utils.data import RandomSampler

from trainrec import RecordMismatchError
from trainrec.adapter_kit import parse_changes

from .native_check import Kept, check_native, schedules_of
from .pending import pack, unpack
from .rng import TorchRngRecord

__all__ = ["ExactResume"]

_COUNTERS = ("accelerate_step", "accelerate_sync_gradients", "accelerate_dataloaders",
             "accelerate_gradient_accumulation_steps")
_SOURCE = "accelerate custom checkpoint (trainrec ExactResume)"


class ExactResume:
    """The pending gradients of `model`, the accelerator's accumulation counters and your
    `state` (a `@trainrec.record`, e.g. counters and a `TorchRngRecord`; or None), for
    `accelerator.register_for_checkpointing`; with them the RNG states and epoch counter of
    each dataloader `accelerator.prepare` made with `use_stateful_dataloader=True` (see the
    module docstring).

    `state_dict()` snapshots them (clearing nothing); `load_state_dict(sd)`, which
    `load_state` calls after it restored model, optimizer, dataloader positions and RNG
    states, checks everything against the model and the prepared dataloaders and then
    writes each parameter's `.grad` (the recorded sum or None), replaces `self.state` with
    the loaded one, sets `accelerator.step` and `sync_gradients` as they were, makes each
    stateful dataloader's resumed iterator and puts its generators and the global RNG back.
    A payload that does not fit (another model, a changed file, a state of another type,
    another number of stateful dataloaders, of their generators or of CUDA devices, another
    `gradient_accumulation_steps` inside a window) raises `RecordMismatchError` naming what
    is wrong, and changes nothing: `load_state` runs the same checks in a pre-hook this
    object registers, before Accelerate loads the model, optimizer, RNG and data position.

    Raises `TypeError` when `accelerator` is not an `accelerate.Accelerator` or `model` not an
    `nn.Module` (pass the model `prepare` returned, or the one you gave it), and `ValueError`
    for more than one process: Accelerate writes registered objects from the main process
    only, so every rank would load rank 0's pending gradients."""

    def __init__(self, accelerator: accelerate.Accelerator, model: nn.Module,
                 state: Any = None, *, allow_changes: Iterable[str] | None = None) -> None:
        if not isinstance(accelerator, accelerate.Accelerator):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if accelerator.num_processes != 1:
            raise ValueError(
                f"ExactResume supports one process, this accelerator has "
                f"{accelerator.num_processes}: Accelerate saves registered objects from the main "
                "process only, so each rank's own pending gradients would be lost (accumulate "
                "with trainrec's GradientsAccumulator and a per-rank record instead)"
            )
        if state is not None and not (hasattr(state, "into_item")
                                      and hasattr(type(state), "from_item")):
            raise TypeError(f"state must be a trainrec Record (a @trainrec.record dataclass) "
                            f"or None, got {type(state).__name__}")
        self.accelerator = accelerator
        self.model = model
        self.state = state
        self.allow_changes = parse_changes(allow_changes)
        self._kept: Kept | None = None  # the live values allow_changes keeps, once checked
        self._loaders()  # refuses a dataloader prepared so far that cannot resume exactly
        accelerator.register_load_state_pre_hook(self._check_before_load)

    def _module(self) -> nn.Module:
        unwrapped = self.accelerator.unwrap_model(self.model)
        assert isinstance(unwrapped, nn.Module)
        return unwrapped

    def _loaders(self) -> list[Any]:
        """The dataloaders `save_state` / `load_state` keep the position of, in their order.
        Raises `ValueError` for one whose sampler cannot resume exactly (see `_check`)."""
        loaders = [dl for dl in getattr(self.accelerator, "_dataloaders", [])
                   if getattr(dl, "use_stateful_dataloader", False)]
        for i, dl in enumerate(loaders):
            _check(i, dl)
        return loaders

    def state_dict(self) -> dict[str, Any]:
        """The payload `save_state` pickles: bytes of trainrec records and ints."""
        acc, loaders = self.accelerator, self._loaders()
        counters = {
            "accelerate_step": int(acc.step),
            "accelerate_sync_gradients": int(bool(acc.gradient_state.sync_gradients)),
            "accelerate_dataloaders": len(loaders),
            "accelerate_gradient_accumulation_steps": int(acc.gradient_accumulation_steps),
        }
        for i, dl in enumerate(loaders):
            counters[f"accelerate_dataloader{i}_iteration"] = int(getattr(dl, "iteration", 0))
            counters[f"accelerate_dataloader{i}_in_last_batch"] = int(_in_last_batch(dl))
        payload = pack(self._module(), self.state, counters,
                       rng=TorchRngRecord.capture(*_generators(loaders)))
        payload["schedules"] = schedules_of(_schedulers(acc))  # what scheduler.bin lacks
        return payload

    def _check_before_load(self, models: Any, input_dir: str) -> None:
        """`load_state`'s pre-hook: this object's payload in `input_dir` is checked before
        Accelerate loads the model, optimizer, RNG and data position, so a payload that does
        not fit changes none of them (`load_state_dict` would refuse it only after)."""
        del models
        index = next((i for i, obj in enumerate(self.accelerator._custom_objects) if obj is self),
                     None)
        file = Path(input_dir) / f"custom_checkpoint_{index}.pkl"
        if index is None or not file.is_file():
            return  # not registered, or Accelerate itself says the files do not match
        payload = torch.load(file, map_location="cpu", weights_only=False)
        self._checked(payload)
        self._kept = self._check_schedules(Path(input_dir), payload)

    def _check_schedules(self, folder: Path, payload: Any) -> Kept | None:
        """The optimizers' hyperparameters and the schedules in `folder` against the live
        ones, as `TrainingRecord.restore` compares them: `RecordMismatchError` naming each
        difference that `allow_changes` does not allow; the live values it allows, which
        `load_state_dict` puts back after Accelerate loaded the recorded ones."""
        optimizers = [getattr(o, "optimizer", o) for o in self.accelerator._optimizers]
        schedulers = _schedulers(self.accelerator)
        states: list[list[Any]] = [[], []]
        for what, objs, out in (("optimizer", optimizers, states[0]), ("scheduler", schedulers, states[1])):
            for i in range(len(objs)):
                file = folder / (f"{what}.bin" if i == 0 else f"{what}_{i}.bin")
                if not file.is_file():
                    return None  # Accelerate's own load says what is missing
                out.append(torch.load(file, map_location="cpu", weights_only=False, mmap=True))
        identities = payload.get("schedules") if isinstance(payload, Mapping) else None
        return check_native(optimizers, states[0], schedulers, states[1],
                            identities if isinstance(identities, list) else None, self.allow_changes,
                            f"{_SOURCE} in {folder}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; on `RecorderError` nothing changed."""
        pending, loaders, generators = self._checked(state_dict)
        kept, self._kept = self._kept, None
        if kept is not None:  # the hyperparameters and schedule fields allowed to change
            kept.apply([getattr(o, "optimizer", o) for o in self.accelerator._optimizers],
                       _schedulers(self.accelerator))
        pending.apply(self._module())
        if self.state is not None:
            self.state = pending.state
        self.accelerator.step = pending.counters["accelerate_step"]
        self.accelerator.sync_gradients = bool(pending.counters["accelerate_sync_gradients"])
        assert pending.rng is not None
        self._resume_loaders(loaders, pending.counters, pending.rng, generators)

    def _checked(self, state_dict: Any) -> tuple[Any, list[Any], list[torch.Generator]]:
        """(the checked payload, the stateful loaders, their generators); raises
        `RecordMismatchError` for a payload that does not fit."""
        module, loaders = self._module(), self._loaders()
        saved = state_dict.get("accelerate_dataloaders") if isinstance(state_dict, Mapping) else None
        if isinstance(saved, int) and saved != len(loaders):
            raise RecordMismatchError(
                f"{_SOURCE} holds the RNG states of {saved} stateful dataloaders, the accelerator "
                f"prepared {len(loaders)}: prepare the same dataloaders (with "
                "DataLoaderConfiguration(use_stateful_dataloader=True)) before load_state"
            )
        counters = _COUNTERS + tuple(f"accelerate_dataloader{i}_{what}" for i in range(len(loaders))
                                     for what in ("iteration", "in_last_batch"))
        pending = unpack(state_dict, module, None if self.state is None else type(self.state),
                         counters, source=_SOURCE, rng=True)
        generators = _generators(loaders)
        assert pending.rng is not None
        if len(pending.rng.generators) != len(generators):
            raise RecordMismatchError(
                f"{_SOURCE} holds {len(pending.rng.generators)} dataloader generators, the "
                f"accelerator's stateful dataloaders have {len(generators)}: resume with the "
                "same dataloaders (generator= given or not, the same sampler)"
            )
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(pending.rng.cuda) != cuda:
            raise RecordMismatchError(f"{_SOURCE} holds the RNG states of {len(pending.rng.cuda)} "
                                      f"CUDA devices, this machine has {cuda}")
        saved_steps = pending.counters["accelerate_gradient_accumulation_steps"]
        steps = int(self.accelerator.gradient_accumulation_steps)
        mid_window = (pending.counters["accelerate_step"] % max(saved_steps, 1) != 0
                      or bool(pending.grads.grads))
        if saved_steps != steps and mid_window:
            raise RecordMismatchError(
                f"{_SOURCE} was saved inside a window of gradient_accumulation_steps="
                f"{saved_steps}, this accelerator has {steps}: the pending gradients are a "
                f"part of a {saved_steps}-step window (each micro-step's loss divided by "
                f"{saved_steps}) and would be stepped as one of {steps}; resume with "
                f"Accelerator(gradient_accumulation_steps={saved_steps}), or change it only "
                "from a checkpoint at a window's end")
        return pending, loaders, generators

    @staticmethod
    def _resume_loaders(loaders: list[Any], counters: Mapping[str, int], rng: TorchRngRecord,
                        generators: list[torch.Generator]) -> None:
        """Each loader's epoch counter back, its resumed iterator made (its draws happen
        now), then the generators and the global RNG as they were at the save.

        A save during an epoch's last batch: Accelerate's look-ahead has already marked the
        position `_iterator_finished`, on which torchdata's next `iter()` starts a new epoch,
        so the resumed loop would run a whole epoch more. The resumed iterator is made
        unfinished instead (the loop after the resume gets no batch, as the uninterrupted
        loop got none after its last) and the epoch counter counts the epoch as done, as
        `DataLoaderShard` does after the last batch and does not for an empty loop."""
        for i, dl in enumerate(loaders):
            in_last = counters[f"accelerate_dataloader{i}_in_last_batch"]
            dl.iteration = counters[f"accelerate_dataloader{i}_iteration"] + in_last
            base = getattr(dl, "base_dataloader", dl)
            position = getattr(base, "next_iter_state", None)
            if position is not None:
                if in_last:
                    base.next_iter_state = {**position, "_iterator_finished": False}
                base.state_dict()  # a StatefulDataLoader keeps this iterator for its next iter()
        rng.apply(*generators)


def _schedulers(accelerator: Any) -> list[Any]:
    """The torch schedulers `accelerator.prepare` wrapped, in its order."""
    return [getattr(s, "scheduler", s) for s in getattr(accelerator, "_schedulers", [])]


def _check(index: int, loader: Any) -> None:
    """Raises `ValueError` when the sampler of a prepared stateful dataloader draws its
    order lazily from a generator's state at the start of the epoch, which no checkpoint
    holds: torch's `RandomSampler` (a plain `DataLoader(shuffle=True)` given to `prepare`
    without `use_seedable_sampler`) or another sampler with a `generator` and no
    `state_dict`. torchdata's `RandomSampler` saves that state itself; Accelerate's
    `SeedableRandomSampler` reseeds from the epoch, which `ExactResume` carries. (A
    stateful dataloader means torchdata is installed: Accelerate refuses one otherwise.)"""
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    sampler = get_sampler(loader)
    exact = (isinstance(sampler, (SeedableRandomSampler, StatefulRandomSampler))
             or (hasattr(sampler, "state_dict") and hasattr(sampler, "load_state_dict"))
             or not (isinstance(sampler, RandomSampler)
                     or isinstance(getattr(sampler, "generator", None), torch.Generator)))
    if not exact:
        raise ValueError(
            f"prepared dataloader {index} shuffles with {type(sampler).__module__}."
            f"{type(sampler).__name__}, which draws each epoch's order from the state its "
            "generator had at the start of the epoch: no checkpoint holds that state, so a resume "
            "would shuffle the resumed epoch, or the next one, differently. Give prepare a "
            "torchdata.stateful_dataloader.StatefulDataLoader(shuffle=True) (its RandomSampler "
            "saves that state), or set DataLoaderConfiguration(use_seedable_sampler=True) "
            "(the order is then seeded from the epoch)"
        )


def _in_last_batch(loader: Any) -> bool:
    """Whether `loader` is being iterated and has yielded its epoch's last batch."""
    return bool(getattr(loader, "end_of_dataloader", False)) and any(
        ref is loader for ref in loader.gradient_state.dataloader_references)


def _generators(loaders: list[Any]) -> list[torch.Generator]:
    """Each loader's `generator=` and its sampler's generator (not a
    `SeedableRandomSampler`'s: reseeded every epoch, made at its first one), in order, each
    once: making an iterator draws from them."""
    out: list[torch.Generator] = []
    for dl in loaders:
        sampler = get_sampler(dl)
        own = None if isinstance(sampler, SeedableRandomSampler) else getattr(sampler, "generator", None)
        for g in (getattr(dl, "generator", None), own):
            if isinstance(g, torch.Generator) and all(g is not h for h in out):
                out.append(g)
    return out
