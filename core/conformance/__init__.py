"""`trainrec.conformance`: the suite adapter authors run (needs pytest).

Write a `Workload` (your adapter's small training job, see `trainrec.adapter_kit` and
spec/ADAPTERS.md), then in your test suite:

    from trainrec.conformance import AdapterConformance

    class TestMyAdapter(AdapterConformance):
        workload = MyWorkload()

and run pytest. Each test checks one contract and says which when it fails.
`Workload` itself needs no pytest: `trainrec demo` runs the same workloads.
(`Harness` and `harness = ...` are the former names, still accepted.)
"""

from typing import Any

from .harness import Harness, Parts, Workload

__all__ = ["AdapterConformance", "Harness", "Parts", "Workload"]


def __getattr__(name: str) -> Any:
    if name == "AdapterConformance":  # imports pytest, so only when asked for
        from .suite import AdapterConformance

        return AdapterConformance
    raise AttributeError(name)
