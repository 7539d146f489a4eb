"""The conformance suite (`trainrec.conformance`) against every adapter: the same tests,
subclassed once per workload, exactly as a third-party adapter author runs them."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

from trainrec.conformance import AdapterConformance


def _workload_module(module: str, needs: str):
    if importlib.util.find_spec(needs) is None:
        return None
    return importlib.import_module(module)


class TestNumpyReference(AdapterConformance):
    workload = importlib.import_module("trainrec.adapters.numpy.demo").WORKLOAD


_torch = _workload_module("trainrec.adapters.torch.demo", "torch")
_jax = _workload_module("trainrec.adapters.jax.demo", "flax")
_strict = _workload_module("trainrec_arraystrict.testing", "trainrec_arraystrict")


@pytest.mark.skipif(_torch is None, reason="torch is not installed")
class TestTorch(AdapterConformance):
    workload = _torch.WORKLOAD if _torch else None


@pytest.mark.skipif(_jax is None, reason="jax and flax are not installed")
class TestJax(AdapterConformance):
    workload = _jax.WORKLOAD if _jax else None


@pytest.mark.skipif(_strict is None, reason="tests/thirdparty_adapter is not installed")
class TestThirdPartyArrayStrict(AdapterConformance):
    """A backend trainrec does not ship, installed as its own package and found through
    its entry point (tests/thirdparty_adapter)."""

    workload = _strict.WORKLOAD if _strict else None


class TestMinigrad(AdapterConformance):
    """An adapter written outside trainrec for a framework it does not ship (tests/minigrad.py,
    shaped like tinygrad: gradients pending in `.grad`, a global RNG, plain model classes),
    the base of the mutation test's broken variants."""

    workload = importlib.import_module("trainrec_minigrad").WORKLOAD

    @pytest.fixture(autouse=True)
    def _importable_in_fresh_processes(self, monkeypatch):
        tests = str(Path(__file__).resolve().parent)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))


def test_the_third_party_adapter_is_found_through_its_entry_point():
    pytest.importorskip("trainrec_arraystrict")
    import subprocess
    import sys

    code = ("import sys, trainrec, array_api_strict as xp\n"
            "b = trainrec.adapt(xp.asarray([1.0]))\n"
            "assert type(b).__module__ == 'trainrec_arraystrict.adapter', type(b)\n"
            "assert 'trainrec_arraystrict' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("workload", ["trainrec_arraystrict.testing:WORKLOAD", "trainrec.adapters.numpy.demo:WORKLOAD"])
def test_demo_runs_any_adapter_named_by_its_workload(workload):
    """`trainrec demo --backend module:attr`, as spec/ADAPTERS.md says."""
    pytest.importorskip(workload.partition(":")[0])
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainrec", "demo", "--backend", workload, "--steps", "8",
                          "--window", "4", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["backend"] == workload and result["bitwise_identical"] and not result["without_pending_identical"]


@pytest.mark.parametrize(("backend", "says"), [("no_such_module_x:HARNESS", "no module named"),
                                                ("trainrec.adapters.numpy.demo", "module:attr")])
def test_demo_refuses_a_backend_it_cannot_find(backend, says):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainrec", "demo", "--backend", backend],
                         capture_output=True, text=True)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_former_names_harness_still_work():
    """Adapters written when `Workload` was `Harness` (and the suite's attribute
    `harness`) still run the suite."""
    from trainrec.adapter_kit import Workload
    from trainrec.conformance import Harness

    wl = importlib.import_module("trainrec.adapters.numpy.demo").WORKLOAD
    old = type("TestOld", (AdapterConformance,), {"harness": wl})
    assert Harness is Workload and old.workload is wl
