"""The numpy reference workload for `trainrec demo` and the continuation tests: an MLP
with dropout, AdamW, linear warm-up + cosine schedule; batches and dropout masks come
from a `numpy.random.Generator` whose state the caller's record carries."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

import trainrec
from trainrec import GradientsParams, RngRecord
from trainrec.adapter_kit import Parts, Workload

from .mlp import MLP
from .optim import AdamW
from .schedulers import LinearWarmupCosineLr

__all__ = ["DemoState", "NumpyWorkload", "WORKLOAD"]


@trainrec.record
class DemoState:
    micro: int
    losses: list[float]
    rng: RngRecord | None = None


class NumpyWorkload(Workload):
    name = "numpy"
    ref = "trainrec.adapters.numpy.demo:WORKLOAD"
    device = "cpu"
    state_type = DemoState

    def build(self, seed: int) -> Parts:
        random.seed(seed)
        np.random.seed(seed)
        model = MLP([16, 32, 32, 4], seed=seed, dropout=0.1)
        return Parts(
            model,
            AdamW(weight_decay=0.01),
            LinearWarmupCosineLr(1e-2, warmup=2, total=10),
            DemoState(0, []),
            extras={"gen": np.random.default_rng(seed + 1)},
        )

    def micro_step(self, parts: Parts) -> None:
        gen: np.random.Generator = parts.extras["gen"]
        x = gen.normal(size=(8, 16)).astype(np.float32)
        y = np.tanh(x[:, :4] * 2.0).astype(np.float32)
        loss, grads = parts.model.loss_and_grads(x, y, gen)
        parts.accumulator.accumulate(parts.model, grads)
        parts.state.losses.append(loss)

    def apply_window(self, parts: Parts, window: int) -> None:
        summed = parts.accumulator.grads()
        scaled = GradientsParams({k: v / np.float32(window) for k, v in summed.items()})
        parts.optimizer.step(parts.scheduler.step(), parts.model, scaled)

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = RngRecord.capture(parts.extras["gen"])

    def after_restore(self, parts: Parts) -> None:
        state: Any = parts.state
        state.rng.apply(parts.extras["gen"])

    def reorder(self, parts: Parts) -> bool:
        parts.model.params = dict(reversed(parts.model.params.items()))
        return True

    def native_objects(self, parts: Parts) -> list[Any]:
        return [parts.model, parts.optimizer, parts.scheduler, np.zeros(1)]


WORKLOAD = NumpyWorkload()
