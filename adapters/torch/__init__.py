"""`trainrec.adapters.torch`: PyTorch models, optimizers and LR schedulers.

Pass your native `nn.Module`, `torch.optim.Optimizer` and scheduler to
`GradientsAccumulator` and `TrainingRecord`; `trainrec.adapt` finds the bindings here.
`grads_from(model)` / `set_grads(model, grads)` move gradients between `.grad` and
`GradientsParams`; `TorchRngRecord` adds torch's generators to `RngRecord`;
`TorchFileRecorder` writes `.pt` files that `torch.load(weights_only=True)` reads.
Models wrapped by `torch.compile`, DDP or DataParallel are recorded under the plain
model's ParamIds (`unwrap(model)` is the model inside); `DistributedRecorder` saves a
DDP run's checkpoint, every rank's pending gradients and state included, as one commit;
`DCPRecorder` saves an FSDP2 (`fully_shard`) run's through `torch.distributed.checkpoint`
(resharded on load to another world size).

Importing this package imports no torch: each name is loaded on first use (so
`trainrec.adapters.torch.neutral`, the conversion form, works without torch installed).
The tool integrations are submodules imported by name, each needing its extra:
`trainrec.adapters.torch.accelerate.ExactResume` (Hugging Face Accelerate's `save_state` /
`load_state`, `trainrec[accelerate]`) and `trainrec.adapters.torch.lightning.ExactResume`
(a Lightning `Callback`, `trainrec[lightning]`), which make a mid-window checkpoint of those
tools resume bitwise, and `trainrec.adapters.torch.transformers.ExactResume.attach(trainer)`
(Hugging Face `Trainer`, `trainrec[transformers]`), which makes a SIGTERM at any micro-step
commit an exact checkpoint that `trainer.train(resume_from_checkpoint=True)` resumes bitwise.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import TorchBackend
    from .bindings import ADAPTER, TorchAdapter, TorchLrScheduler, TorchModule, TorchOptimizer
    from .dcp import DCPRecorder, DCPRestored
    from .distributed import DistributedRecorder
    from .grads import grads_from, set_grads
    from .recorder import BF16PrecisionSettings, TorchFileRecorder, TorchPrecisionSettings
    from .rng import TorchRngRecord
    from .wrappers import unwrap

__all__ = [
    "ADAPTER",
    "BF16PrecisionSettings",
    "DCPRecorder",
    "DCPRestored",
    "DistributedRecorder",
    "TorchAdapter",
    "TorchBackend",
    "TorchFileRecorder",
    "TorchLrScheduler",
    "TorchModule",
    "TorchOptimizer",
    "TorchPrecisionSettings",
    "TorchRngRecord",
    "grads_from",
    "set_grads",
    "unwrap",
]

_HOME = {
    "ADAPTER": "bindings", "TorchAdapter": "bindings", "TorchLrScheduler": "bindings",
    "TorchModule": "bindings", "TorchOptimizer": "bindings", "TorchBackend": "backend",
    "grads_from": "grads", "set_grads": "grads", "BF16PrecisionSettings": "recorder",
    "TorchFileRecorder": "recorder", "TorchPrecisionSettings": "recorder", "TorchRngRecord": "rng",
    "unwrap": "wrappers", "DistributedRecorder": "distributed",
    "DCPRecorder": "dcp", "DCPRestored": "dcp",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{home}")
    except ImportError as e:
        if e.name is not None and e.name.partition(".")[0] == "torch":
            raise ImportError(f"trainrec.adapters.torch.{name} needs torch, which is not installed: "
                              "pip install 'trainrec[torch]'", name=e.name) from e
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
