"""`trainrec.adapters.jax`: JAX pytrees, optax optimizers and schedules, flax models.

JAX values are immutable, so the protocol objects are holders whose fields the training
loop reassigns: `JaxModule(params)`, `JaxOptimizer(tx, opt_state)`,
`JaxLrScheduler(schedule, count)`. `grads_from(grad_tree, module)` / `to_tree(grads,
module)` move gradients between pytrees and `GradientsParams`.
`FlaxMsgpackFileRecorder` writes flax's msgpack convention (readable by
`flax.serialization.msgpack_restore`) without needing flax.
"""

from .bindings import (
    ADAPTER,
    JaxAdapter,
    JaxBackend,
    JaxLrScheduler,
    JaxModule,
    JaxOptimizer,
    grads_from,
    to_tree,
)
from .recorder import FlaxMsgpackFileRecorder

__all__ = [
    "ADAPTER",
    "FlaxMsgpackFileRecorder",
    "JaxAdapter",
    "JaxBackend",
    "JaxLrScheduler",
    "JaxModule",
    "JaxOptimizer",
    "grads_from",
    "to_tree",
]
