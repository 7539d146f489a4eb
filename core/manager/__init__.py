"""`CheckpointManager`: periodic background saves of `TrainingRecord`s into a directory (`local`) or
onto a store URL (`store`). A tool on top of the data path: it may import `workload`, `recorders`,
`training` and every layer below, never another tool (`check`, `conversion`, `conformance`) or
`cli`.

`trainrec.manager` is `trainrec.manager.local`'s names."""


from . import store as _store  # noqa: F401  (registers the manager of store URLs)
from .local import (
    CheckpointManager,
    KeepBest,
    Preemption,
)

__all__ = [
    "CheckpointManager",
    "KeepBest",
    "Preemption",
]
