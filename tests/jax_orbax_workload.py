"""The JAX demo workload checkpointed with `OrbaxRecorder` too (recorder name "orbax"),
for the fresh-process continuation test (`python -m trainrec.roles ... --backend
jax_orbax_workload:WORKLOAD`, with this directory on PYTHONPATH). Not in the bundled
workload: the conformance suite cuts recorders' payloads as files, and an Orbax
checkpoint is a directory (its damage is tested in test_orbax_recorder.py)."""

from __future__ import annotations

from typing import ClassVar

from trainrec import NativePrecisionSettings, Recorder
from trainrec.adapters.jax import OrbaxRecorder
from trainrec.adapters.jax.demo import JaxWorkload


class OrbaxWorkload(JaxWorkload):
    ref = "jax_orbax_workload:WORKLOAD"
    recorders: ClassVar[dict[str, Recorder]] = {
        **JaxWorkload.recorders, "orbax": OrbaxRecorder(NativePrecisionSettings())}


WORKLOAD = OrbaxWorkload()
