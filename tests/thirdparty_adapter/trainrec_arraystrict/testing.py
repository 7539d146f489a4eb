"""The workload of this adapter: the training job `trainrec.conformance` and `trainrec demo` run."""

from __future__ import annotations

import random

import array_api_strict as xp
import numpy as np

import trainrec
from trainrec import RngRecord
from trainrec.adapter_kit import Parts, Workload

from .adapter import SUPPORTED
from .model import SGD, Linear, StepSchedule


@trainrec.record
class State:
    micro: int
    rng: RngRecord | None = None


class StrictWorkload(Workload):
    name = "array_api_strict"
    ref = "trainrec_arraystrict.testing:WORKLOAD"
    state_type = State
    device = "cpu"
    dtypes = SUPPORTED

    def build(self, seed: int) -> Parts:
        random.seed(seed)
        np.random.seed(seed)
        return Parts(Linear(5, 3, seed), SGD(0.9), StepSchedule(0.05, 2, 0.5), State(0),
                     extras={"gen": np.random.default_rng(seed + 1)})

    def micro_step(self, parts: Parts) -> None:
        gen = parts.extras["gen"]
        x = gen.normal(size=(4, 5)).astype(np.float32)
        y = np.tanh(x[:, :3]).astype(np.float32)
        _, grads = parts.model.loss_and_grads(xp.asarray(x), xp.asarray(y))
        parts.accumulator.accumulate(parts.model, grads)

    def apply_window(self, parts: Parts, window: int) -> None:
        grads = parts.accumulator.grads()
        scaled = trainrec.GradientsParams({k: v / window for k, v in grads.items()})
        parts.optimizer.step(parts.scheduler.step(), parts.model, scaled)

    def before_capture(self, parts: Parts) -> None:
        parts.state.rng = RngRecord.capture(parts.extras["gen"])

    def after_restore(self, parts: Parts) -> None:
        parts.state.rng.apply(parts.extras["gen"])

    def native_objects(self, parts: Parts) -> list[object]:
        return [parts.model, parts.optimizer, parts.scheduler, xp.asarray([1.0])]


WORKLOAD = StrictWorkload()
