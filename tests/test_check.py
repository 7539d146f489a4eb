"""`trainrec check` (issue 25): correct loops resume bitwise and exit 0; each planted bug
of a broken loop (tests/check_loops.py, check_jax_loops.py) is reported at the right
micro-step and component with its cause; Accelerate and DDP (`nproc=2`) workloads; the
exit codes, `--json`, `--plot` and `trainrec.testing.assert_exact_resume`.

Every check costs fresh processes (one reference run and one per `at`, each importing its
framework), so the bugs are checked with one `at` and two micro-steps after it, the
checks of a framework run two at a time in one module-scoped fixture, and only the CLI
run of the README loop uses the default `at`s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import trainrec
from trainrec.check import WorkloadError, check_resume, default_ats
from trainrec.testing import assert_exact_resume

HERE = Path(__file__).resolve().parent
AT, STEPS = 6, 8  # mid-window in the second window (2 of 4 pending), two micro-steps after

# name: (first divergent micro-step minus AT, component, words the cause must hold)
TORCH_BUGS = {
    "RngNotApplied": (0, "rng", ["recorded but not applied", "state.rng.apply()", "the torch CPU RNG"]),
    "NewAccumulator": (0, "pending", ["new accumulator", "restored.accumulator"]),
    "OptimizerRebuilt": (0, "optimizer", ["optimizer was rebuilt"]),
    "SchedulerRebuilt": (0, "scheduler", ["scheduler was rebuilt"]),
    "GeneratorNotRecorded": (1, "data", ["extras['data_gen']", "randomness the checkpoint does not hold"]),
    "CursorOutside": (1, "data", ["extras['cursor']", "data position", "ids [[0, 1,"]),
    "ScalerNotRecorded": (1, "pending", ["extras['scaler']", "GradScaler", "state_dict()",
                                         "with the same batch"]),
}
JAX_BUGS = {
    "DropoutKeyOutside": (1, "pending", ["extras['key']", "randomness", "with the same batch"]),
}


def _checks(module: str, names: list[str], **options: object) -> dict[str, object]:
    def one(name: str) -> object:
        try:
            return check_resume(f"{module}:{name}", jobs=1, timeout=300, **options)
        except WorkloadError as e:
            return e

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(one, names)))


@pytest.fixture(scope="module")
def torch_reports() -> dict[str, object]:
    pytest.importorskip("torch")
    return _checks("check_loops", list(TORCH_BUGS), at=[AT], steps=STEPS)


@pytest.fixture(scope="module")
def jax_reports() -> dict[str, object]:
    for module in ("jax", "flax", "optax"):
        pytest.importorskip(module)
    return _checks("check_jax_loops", ["README_JAX_LOOP", *JAX_BUGS], at=[AT], steps=STEPS)


def _assert_named(report: object, offset: int, component: str, words: list[str]) -> None:
    assert isinstance(report, trainrec.ResumeReport), report
    assert not report.exact, str(report)
    (check,) = report.checks
    d = check.first_divergence
    assert d is not None and (d.micro_step, d.component) == (AT + offset, component), str(report)
    assert d.max_abs_diff > 0
    for word in words:
        assert word in check.cause, f"{word!r} not in the cause:\n{report}"
    assert report.cause == check.cause
    assert "RESULT: resume is NOT exact" in str(report)


@pytest.mark.parametrize("name", list(TORCH_BUGS))
def test_a_planted_torch_bug_is_named_with_its_micro_step_component_and_cause(torch_reports, name):
    _assert_named(torch_reports[name], *TORCH_BUGS[name])


@pytest.mark.parametrize("name", list(JAX_BUGS))
def test_a_planted_jax_bug_is_named_with_its_micro_step_component_and_cause(jax_reports, name):
    _assert_named(jax_reports[name], *JAX_BUGS[name])


def test_the_readme_jax_loop_resumes_exactly(jax_reports):
    report = jax_reports["README_JAX_LOOP"]
    assert isinstance(report, trainrec.ResumeReport), report
    assert report.exact, str(report)
    assert [c.curve[-1]["model"] for c in report.checks] == [0.0]


def test_the_readme_torch_loop_exits_0_with_the_default_ats_json_and_a_plot(tmp_path):
    pytest.importorskip("torch")
    plot = importlib_util_has("matplotlib")
    cmd = [sys.executable, "-m", "trainrec", "check", "check_loops:README_LOOP", "--json"]
    if plot:
        cmd += ["--plot", str(tmp_path / "check.png")]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["exact"] is True and out["cause"] == ""
    assert [c["at"] for c in out["checks"]] == default_ats(12, 4) == [6, 8, 10]
    assert all(c["exact"] and c["first_divergence"] is None for c in out["checks"])
    assert out["wall_s"] > out["train_s"] > 0
    if plot:
        assert (tmp_path / "check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def importlib_util_has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_accelerate_workload_through_its_own_save_state_resumes_exactly():
    for module in ("torch", "accelerate", "torchdata"):
        pytest.importorskip(module)
    report = check_resume("check_tool_loops:AccelerateLoop", at=[6, 9], steps=12, timeout=300)
    assert report.exact, str(report)
    assert [c.at for c in report.checks] == [6, 9]


def test_ddp_on_two_ranks_resumes_exactly():
    pytest.importorskip("torch")
    report = check_resume("check_tool_loops:DDPLoop", at=[AT], steps=STEPS, nproc=2,
                          recorder="ddp", timeout=300)
    assert report.exact and report.nproc == 2, str(report)
    assert "2 ranks" in str(report)


# -- the numpy reference loop: fast processes for the report, exit codes and testing ---


def test_assert_exact_resume_passes_an_exact_loop_and_fails_with_the_report():
    from check_core_loops import NUMPY_LOOP, NumpyNewAccumulator

    report = assert_exact_resume(NUMPY_LOOP, at=[5], steps=6)
    assert report.exact and report.workload == "check_core_loops:NUMPY_LOOP"
    with pytest.raises(AssertionError, match="new accumulator") as caught:
        assert_exact_resume(NumpyNewAccumulator, at=[5], steps=6)
    assert "DIVERGES right after the restore: pending" in str(caught.value)


def _cli(*args: str, cwd: Path = HERE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainrec", "check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_exit_1_and_the_json_object_for_a_divergence():
    done = _cli("check_core_loops:NumpyNewAccumulator", "--at", "5", "--steps", "6", "--json")
    assert done.returncode == 1, done.stderr
    out = json.loads(done.stdout)
    (check,) = out["checks"]
    assert out["exact"] is False and check["exact"] is False and check["at"] == 5
    first = check["first_divergence"]
    assert set(first) == {"micro_step", "component", "key", "max_abs_diff"}
    assert (first["micro_step"], first["component"]) == (5, "pending")
    assert first["max_abs_diff"] is None  # a gradient missing: a difference with no size
    assert "new accumulator" in out["cause"] and out["cause"] == check["cause"]


@pytest.mark.parametrize(("args", "message"), [
    (["nomodule_xyz:W"], "no module named"),
    (["check_core_loops"], "expected module:attr"),
    (["check_core_loops:MISSING"], "has no workload"),
    (["check_core_loops:NOT_A_WORKLOAD"], "is not a trainrec Workload"),
    (["check_core_loops:NUMPY_LOOP", "--at", "6", "--steps", "6"], "0 < K < steps"),
    (["check_core_loops:NUMPY_LOOP", "--recorder", "nosuch"], "no recorder 'nosuch'"),
    (["check_core_loops:NUMPY_LOOP", "--window", "0"], "window must be at least 1"),
    (["check_core_loops:NUMPY_LOOP", "--at", "x"], "invalid int value"),
])
def test_exit_2_for_usage_errors(args, message):
    done = _cli(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_exit_3_when_the_workload_fails(tmp_path):
    done = _cli("check_core_loops:NumpyFailsAtThree", "--at", "5", "--steps", "6")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the loop's own bug at micro-step 3" in done.stderr
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('a dependency is missing')\n")
    done = _cli("raises_on_import:W", cwd=tmp_path)
    assert done.returncode == 3 and "a dependency is missing" in done.stderr


def test_refusals_name_what_a_fresh_process_cannot_import():
    from check_core_loops import NumpyLoop

    class Local(NumpyLoop):
        pass

    with pytest.raises(ValueError, match="cannot import this workload"):
        check_resume(Local)
    nameless = NumpyLoop()  # held by no module attribute and without `ref`
    with pytest.raises(ValueError, match="no `ref`"):
        check_resume(nameless)
    with pytest.raises(ValueError, match="0 < K < steps"):
        check_resume("check_core_loops:NUMPY_LOOP", at=[0])
    with pytest.raises(ValueError, match="nproc"):
        check_resume("check_core_loops:NUMPY_LOOP", nproc=0)


def test_differences_are_leaf_by_leaf_with_sizes():
    import numpy as np

    from trainrec import TensorData
    from trainrec.check_state import differences

    a = {"w": TensorData.from_array(np.array([1.0, 2.0], np.float32)), "n": 3, "s": "x",
         "ids": [1, 2, 3], "only_a": 1}
    b = {"w": TensorData.from_array(np.array([1.0, 2.5], np.float32)), "n": 5, "s": "y",
         "ids": [1, 2, 9], "only_b": 1}
    got = dict(differences(a, b))
    assert got == {"w": 0.5, "n": 2.0, "s": float("inf"), "ids": 6.0, "only_a": float("inf"),
                   "only_b": float("inf")}
    assert differences(a, a) == []
