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

Needs the extra `trainrec[accelerate]`; importing this module imports accelerate.
"""

from __future__ import annotations

from typing import Any

from torch import nn

try:
    import accelerate
except ImportError as e:  # pragma: no cover - the message is tested with accelerate hidden
    raise ImportError("trainrec.adapters.torch.accelerate needs accelerate, which is not "
                      "installed: pip install 'trainrec[accelerate]'", name=e.name) from e

from .pending import pack, unpack

__all__ = ["ExactResume"]

_COUNTERS = ("accelerate_step", "accelerate_sync_gradients")


class ExactResume:
    """The pending gradients of `model`, the accelerator's accumulation counters and your
    `state` (a `@trainrec.record`, e.g. counters and a `TorchRngRecord`; or None), for
    `accelerator.register_for_checkpointing`.

    `state_dict()` snapshots them (clearing nothing); `load_state_dict(sd)`, which
    `load_state` calls after it restored model and optimizer, checks everything against the
    model and then writes each parameter's `.grad` (the recorded sum or None), replaces
    `self.state` with the loaded one and sets `accelerator.step` and `sync_gradients` as they
    were. A payload that does not fit (another model, a changed file, a state of another
    type) raises `RecordMismatchError` naming what is wrong, and changes nothing.

    Raises `TypeError` when `accelerator` is not an `accelerate.Accelerator` or `model` not an
    `nn.Module` (pass the model `prepare` returned, or the one you gave it), and `ValueError`
    for more than one process: Accelerate writes registered objects from the main process
    only, so every rank would load rank 0's pending gradients."""

    def __init__(self, accelerator: accelerate.Accelerator, model: nn.Module,
                 state: Any = None) -> None:
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

    def _module(self) -> nn.Module:
        unwrapped = self.accelerator.unwrap_model(self.model)
        assert isinstance(unwrapped, nn.Module)
        return unwrapped

    def state_dict(self) -> dict[str, Any]:
        """The payload `save_state` pickles: bytes of trainrec records and ints."""
        acc = self.accelerator
        return pack(self._module(), self.state, {
            "accelerate_step": int(acc.step),
            "accelerate_sync_gradients": int(bool(acc.gradient_state.sync_gradients)),
        })

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; on `RecorderError` nothing changed."""
        module = self._module()
        pending = unpack(state_dict, module, None if self.state is None else type(self.state),
                         _COUNTERS, source="accelerate custom checkpoint (trainrec ExactResume)")
        pending.apply(module)
        if self.state is not None:
            self.state = pending.state
        self.accelerator.step = pending.counters["accelerate_step"]
        self.accelerator.sync_gradients = bool(pending.counters["accelerate_sync_gradients"])
