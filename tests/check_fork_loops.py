"""Loops for the fork server of `trainrec check` (tests/test_check_zygote.py): numpy loops
whose resume diverges in fresh processes, and must diverge in forked ones too."""

from __future__ import annotations

import random

import numpy as np
from check_core_loops import NumpyLoop

from trainrec import Parts
from trainrec.adapters.numpy import MLP, AdamW, LinearWarmupCosineLr
from trainrec.adapters.numpy.demo import DemoState


class _Scaled(NumpyLoop):
    """The numpy loop with its inputs scaled by `extras["scale"]`, drawn in `build` from
    randomness it does not record: a resume builds another scale, the uninterrupted run's
    is lost, and the batches after the restore differ."""

    def scale(self) -> float:
        raise NotImplementedError

    def build(self, seed: int) -> Parts:
        random.seed(seed)  # numpy's global RNG is never seeded
        model = MLP([16, 32, 32, 4], seed=seed, dropout=0.1)
        return Parts(model, AdamW(weight_decay=0.01), LinearWarmupCosineLr(1e-2, warmup=2, total=10),
                     DemoState(0, []), extras={"gen": np.random.default_rng(seed + 1),
                                               "scale": np.float32(self.scale())})

    def micro_step(self, parts: Parts) -> None:
        gen: np.random.Generator = parts.extras["gen"]
        x = gen.normal(size=(8, 16)).astype(np.float32) * parts.extras["scale"]
        parts.report_batch(x)
        y = np.tanh(x[:, :4] * 2.0).astype(np.float32)
        loss, grads = parts.model.loss_and_grads(x, y, gen)
        parts.accumulator.accumulate(parts.model, grads)
        parts.state.losses.append(loss)


class UnseededGlobalScale(_Scaled):
    """Draws its scale from numpy's global RNG, which nothing seeds: a fresh interpreter
    seeds it from the OS, and so must a forked run."""

    def scale(self) -> float:
        return float(np.random.uniform(0.5, 2.0))


class HashScale(_Scaled):
    """Takes its scale from a string's hash, which differs between interpreters unless
    PYTHONHASHSEED is set: the resume must not come from the uninterrupted run's
    interpreter."""

    def scale(self) -> float:
        return 0.5 + (hash("trainrec check") % 1000) / 1000


UNSEEDED = UnseededGlobalScale()
HASHED = HashScale()
