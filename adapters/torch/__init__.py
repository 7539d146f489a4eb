"""`trainrec.adapters.torch`: PyTorch models, optimizers and LR schedulers.

Pass your native `nn.Module`, `torch.optim.Optimizer` and scheduler to
`GradientsAccumulator` and `TrainingRecord`; `trainrec.adapt` finds the bindings here.
`grads_from(model)` / `set_grads(model, grads)` move gradients between `.grad` and
`GradientsParams`; `TorchRngRecord` adds torch's generators to `RngRecord`;
`TorchFileRecorder` writes `.pt` files that `torch.load(weights_only=True)` reads.
"""

from .backend import TorchBackend
from .bindings import ADAPTER, TorchAdapter, TorchLrScheduler, TorchModule, TorchOptimizer
from .grads import grads_from, set_grads
from .recorder import BF16PrecisionSettings, TorchFileRecorder, TorchPrecisionSettings
from .rng import TorchRngRecord

__all__ = [
    "ADAPTER",
    "BF16PrecisionSettings",
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
]
