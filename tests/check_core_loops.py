"""Loops on the numpy reference adapter for `trainrec check` (tests/test_check.py): fast
fresh processes (no framework to import), for the report, the exit codes and
`trainrec.testing`."""

from __future__ import annotations

from trainrec import GradientsAccumulator, Parts
from trainrec.adapters.numpy.demo import NumpyWorkload


class NumpyLoop(NumpyWorkload):
    """The numpy demo's loop, exact."""

    ref = ""  # named by this module's attribute, as a user's would be


class NumpyNewAccumulator(NumpyLoop):
    def after_restore(self, parts: Parts) -> None:
        super().after_restore(parts)
        parts.accumulator = GradientsAccumulator()


class NumpyFailsAtThree(NumpyLoop):
    """A loop that raises in its third micro-step: the check exits 3."""

    def micro_step(self, parts: Parts) -> None:
        if parts.state.micro == 2:
            raise RuntimeError("the loop's own bug at micro-step 3")
        super().micro_step(parts)


NUMPY_LOOP = NumpyLoop()
NOT_A_WORKLOAD = object()
