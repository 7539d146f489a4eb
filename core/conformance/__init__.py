"""`trainrec.conformance`: the suite adapter authors run (needs pytest).

Write a `Harness` (a small training workload, see `harness.py` and spec/ADAPTERS.md),
then in your test suite:

    from trainrec.conformance import AdapterConformance

    class TestMyAdapter(AdapterConformance):
        harness = MyHarness()

and run pytest. Each test checks one contract and says which when it fails.
`Harness` itself needs no pytest: adapters' demo workloads are harnesses.
"""

from typing import Any

from .harness import Harness, Parts

__all__ = ["AdapterConformance", "Harness", "Parts"]


def __getattr__(name: str) -> Any:
    if name == "AdapterConformance":  # imports pytest, so only when asked for
        from .suite import AdapterConformance

        return AdapterConformance
    raise AttributeError(name)
