"""`trainrec check` (issue 25): correct loops resume bitwise and exit 0; each planted bug
of a broken loop (tests/check_loops.py, check_jax_loops.py) is reported at the right
micro-step and component with its cause; Accelerate, Lightning and DDP (`nproc=2`)
workloads; the exit codes, `--json`, `--plot`, `reference=` and
`trainrec.testing.assert_exact_resume`.

Every check costs fresh processes (one uninterrupted run and one per `at`, each importing
its framework), so: the bugs are checked at one `at`; a bug that lives in the resume code
alone (`after_restore`) is compared with the uninterrupted run of the correct loop, which
the CLI run of the README loop leaves in its `--workdir` (`reference=`: the same bits,
run once); the checks of a framework run two at a time in one module-scoped fixture; and
the exit codes other than 0 and 1 are checked in this process (`trainrec.cli.commands.main`).
Under pytest-xdist each fixture's runs are made once for all workers (`_shared_runs.once`),
and the JAX processes share a persistent compilation cache (`_shared_runs.jax_cache_env`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _shared_runs import jax_cache_env, once

import trainrec
from trainrec.check.resume import WorkloadError, check_resume, default_ats
from trainrec.testing import assert_exact_resume

HERE = Path(__file__).resolve().parent
AT, STEPS = 6, 12  # mid-window in the second window (2 of 4 pending); the default steps

# name: (first divergent micro-step minus AT, component, words the cause must hold);
# RESUME_ONLY: the bug is in after_restore alone, so the uninterrupted run is the README loop's
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
    "JaxRngNotApplied": (0, "rng", ["recorded but not applied", "JAX key 0 given to capture"]),
}
RESUME_ONLY = {"RngNotApplied", "NewAccumulator", "OptimizerRebuilt", "SchedulerRebuilt",
               "JaxRngNotApplied"}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _in_pairs(jobs: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Run the checks two at a time (each runs its processes one at a time); a
    `WorkloadError` is the result of its check."""
    def one(job: Callable[[], object]) -> object:
        try:
            return job()
        except WorkloadError as e:
            return e

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(one, jobs.values())))


def _check(target: str, **options: Any) -> Callable[[], object]:
    return lambda: check_resume(target, jobs=1, timeout=300, **options)


@pytest.fixture(scope="module")
def readme_cli(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`trainrec check` on the README loop with the default `at`s, `--json` and (with
    matplotlib) `--plot`; its workdir holds the uninterrupted run the resume-only bugs reuse."""
    pytest.importorskip("torch")

    def run(tmp: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
        cmd = [sys.executable, "-m", "trainrec", "check", "check_loops:README_LOOP", "--json",
               "--workdir", str(tmp / "work")]
        if _has("matplotlib"):
            cmd += ["--plot", str(tmp / "check.png")]
        return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600), tmp

    return once(tmp_path_factory, "check-readme-cli", run)


@pytest.fixture(scope="module")
def torch_reports(readme_cli: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    done, tmp = readme_cli
    assert done.returncode == 0, done.stdout + done.stderr
    return once(tmp_path_factory, "check-torch-bugs", lambda _: _in_pairs({
        name: _check(f"check_loops:{name}", at=[AT], steps=STEPS,
                     reference=tmp / "work" if name in RESUME_ONLY else None)
        for name in TORCH_BUGS}))


@pytest.fixture(scope="module")
def jax_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    for module in ("jax", "flax", "optax"):
        pytest.importorskip(module)

    def run(work: Path) -> dict[str, object]:
        with pytest.MonkeyPatch.context() as mp:  # the check's processes inherit it
            for name, value in jax_cache_env(tmp_path_factory).items():
                mp.setenv(name, value)
            first = _in_pairs({
                "README_JAX_LOOP": _check("check_jax_loops:README_JAX_LOOP", at=[AT],
                                          steps=STEPS, workdir=work),
                "DropoutKeyOutside": _check("check_jax_loops:DropoutKeyOutside", at=[AT],
                                            steps=STEPS)})
            reused = _check("check_jax_loops:JaxRngNotApplied", at=[AT], steps=STEPS,
                            reference=work)
            return {**first, **_in_pairs({"JaxRngNotApplied": reused})}

    return once(tmp_path_factory, "check-jax", run)


@pytest.fixture(scope="module")
def lightning_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    for module in ("torch", "lightning", "torchdata"):
        pytest.importorskip(module)
    # resumed after micro-step 6 (2 of 4 pending) and compared up to 10: across the end of
    # the epoch of 8 batches, where the next shuffle needs the loader's generator
    return once(tmp_path_factory, "check-lightning", lambda _: _in_pairs({
        name: _check(f"check_tool_loops:{name}", at=[AT], steps=10)
        for name in ("LightningLoop", "LightningAlone")}))


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
    reused = torch_reports[name].reference  # type: ignore[union-attr]
    assert reused == ("check_loops:README_LOOP" if name in RESUME_ONLY else None)


@pytest.mark.parametrize("name", list(JAX_BUGS))
def test_a_planted_jax_bug_is_named_with_its_micro_step_component_and_cause(jax_reports, name):
    _assert_named(jax_reports[name], *JAX_BUGS[name])
    reused = jax_reports[name].reference  # type: ignore[union-attr]
    assert reused == ("check_jax_loops:README_JAX_LOOP" if name in RESUME_ONLY else None)


def test_the_readme_jax_loop_resumes_exactly(jax_reports):
    report = jax_reports["README_JAX_LOOP"]
    assert isinstance(report, trainrec.ResumeReport), report
    assert report.exact, str(report)
    assert [c.curve[-1]["model"] for c in report.checks] == [0.0]


def test_the_readme_torch_loop_exits_0_with_the_default_ats_json_and_a_plot(readme_cli):
    done, tmp = readme_cli
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["exact"] is True and out["cause"] == ""
    assert [c["at"] for c in out["checks"]] == default_ats(12, 4) == [6, 8, 10]
    assert all(c["exact"] and c["first_divergence"] is None for c in out["checks"])
    assert out["wall_s"] > out["train_s"] > 0
    plot = _has("matplotlib")
    # the cost, reported: one uninterrupted run and one resume per at (twice with --plot)
    assert out["runs"] == 1 + 3 * (1 + plot)
    assert out["startup_s"] > 0 and out["resume_startup_s"] > 0 and out["resume_train_s"] > 0
    if plot:
        assert (tmp / "check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accelerate_workload_through_its_own_save_state_resumes_exactly():
    for module in ("torch", "accelerate", "torchdata"):
        pytest.importorskip(module)
    report = check_resume("check_tool_loops:AccelerateLoop", at=[6, 9], steps=12, timeout=300)
    assert report.exact, str(report)
    assert [c.at for c in report.checks] == [6, 9]


def test_lightning_trainer_with_exact_resume_resumes_exactly_mid_window(lightning_reports):
    report = lightning_reports["LightningLoop"]
    assert isinstance(report, trainrec.ResumeReport), report
    assert report.exact, str(report)
    (check,) = report.checks
    assert check.at == AT and len(check.curve) == 10 - AT + 1  # compared at 6, 7, ..., 10
    assert "resume after micro-step 6 (2 of 4 pending): bitwise identical at 6..10" in str(report)


def test_lightning_alone_loses_the_pending_gradients_and_the_check_says_so(lightning_reports):
    _assert_named(lightning_reports["LightningAlone"], 0, "pending",
                  ["4 parameters pending", "the resumed run has none", "own checkpoint",
                   "`lightning.ExactResume` in Trainer(callbacks=[...])"])


def test_ddp_on_two_ranks_resumes_exactly():
    pytest.importorskip("torch")
    report = check_resume("check_tool_loops:DDPLoop", at=[AT], steps=8, nproc=2,
                          recorder="ddp", timeout=300)
    assert report.exact and report.nproc == 2, str(report)
    assert "2 ranks" in str(report)


# -- the numpy reference loop: fast processes for the report, exit codes and testing ---


@pytest.fixture(scope="module")
def numpy_exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[trainrec.ResumeReport, Path]:
    """`assert_exact_resume` on the numpy loop; its workdir holds the uninterrupted run that
    the checks of `NumpyNewAccumulator` (a bug of the resume code alone) reuse."""
    from check_core_loops import NUMPY_LOOP

    work = tmp_path_factory.mktemp("numpy-check")
    return assert_exact_resume(NUMPY_LOOP, at=[5], steps=6, workdir=work), work


def test_assert_exact_resume_passes_an_exact_loop_and_fails_with_the_report(numpy_exact):
    from check_core_loops import NumpyNewAccumulator

    report, work = numpy_exact
    assert report.exact and report.workload == "check_core_loops:NUMPY_LOOP"
    assert report.reference is None
    with pytest.raises(AssertionError, match="new accumulator") as caught:
        assert_exact_resume(NumpyNewAccumulator, at=[5], steps=6, reference=work)
    assert "DIVERGES right after the restore: pending" in str(caught.value)
    assert "compared with the uninterrupted run of check_core_loops:NUMPY_LOOP (reused)" in str(caught.value)


def test_a_reference_is_reused_only_for_the_same_settings_and_checkpoints(numpy_exact):
    _, work = numpy_exact
    for options, message in [({"at": [4], "steps": 6}, r"checkpointed after micro-steps \[5\], not after \[4\]"),
                             ({"at": [5], "steps": 7}, r"was run with \{'steps': 6\}"),
                             ({"at": [5], "steps": 6, "seed": 1}, r"was run with \{'seed': 0\}"),
                             ({"at": [5], "steps": 6, "recorder": "gz"}, "'recorder': 'mpk'")]:
        with pytest.raises(ValueError, match=message):
            check_resume("check_core_loops:NumpyNewAccumulator", reference=work, **options)
    with pytest.raises(ValueError, match="holds no uninterrupted run"):
        check_resume("check_core_loops:NumpyNewAccumulator", at=[5], steps=6,
                     reference=work / "nothing-here")


def _cli(*args: str, cwd: Path = HERE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainrec", "check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_exit_1_and_the_json_object_for_a_divergence(numpy_exact):
    _, work = numpy_exact
    done = _cli("check_core_loops:NumpyNewAccumulator", "--at", "5", "--steps", "6", "--json",
                "--reference", str(work))
    assert done.returncode == 1, done.stderr
    out = json.loads(done.stdout)
    (check,) = out["checks"]
    assert out["exact"] is False and check["exact"] is False and check["at"] == 5
    first = check["first_divergence"]
    assert set(first) == {"micro_step", "component", "key", "max_abs_diff"}
    assert (first["micro_step"], first["component"]) == (5, "pending")
    assert first["max_abs_diff"] is None  # a gradient missing: a difference with no size
    assert "new accumulator" in out["cause"] and out["cause"] == check["cause"]
    assert out["reference"] == "check_core_loops:NUMPY_LOOP"


def _cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`trainrec check ARGS` in this process (what `python -m trainrec` runs): the exit
    code and stderr."""
    from trainrec.cli.commands import main

    try:
        code = main(["check", *args])
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["nomodule_xyz:W"], "no module named"),
    (["check_core_loops"], "expected module:attr"),
    (["check_core_loops:MISSING"], "has no workload"),
    (["check_core_loops:NOT_A_WORKLOAD"], "is not a trainrec Workload"),
    (["check_core_loops:NUMPY_LOOP", "--at", "6", "--steps", "6"], "0 < K < steps"),
    (["check_core_loops:NUMPY_LOOP", "--recorder", "nosuch"], "no recorder 'nosuch'"),
    (["check_core_loops:NUMPY_LOOP", "--window", "0"], "window must be at least 1"),
    (["check_core_loops:NUMPY_LOOP", "--at", "x"], "invalid int value"),
    (["check_core_loops:NUMPY_LOOP", "--reference", "/nonexistent-dir"], "holds no uninterrupted run"),
])
def test_exit_2_for_usage_errors(capsys, args, message):
    code, err = _cli_here(capsys, *args)
    assert code == 2, err
    assert message in err


def test_exit_3_when_the_workload_fails(tmp_path, capsys, monkeypatch):
    code, err = _cli_here(capsys, "check_core_loops:NumpyFailsAtThree", "--at", "5", "--steps", "6")
    assert code == 3, err
    assert "the loop's own bug at micro-step 3" in err
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('a dependency is missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = _cli_here(capsys, "raises_on_import:W")
    assert code == 3 and "a dependency is missing" in err


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
    from trainrec.check.state import differences

    a = {"w": TensorData.from_array(np.array([1.0, 2.0], np.float32)), "n": 3, "s": "x",
         "ids": [1, 2, 3], "only_a": 1}
    b = {"w": TensorData.from_array(np.array([1.0, 2.5], np.float32)), "n": 5, "s": "y",
         "ids": [1, 2, 9], "only_b": 1}
    got = dict(differences(a, b))
    assert got == {"w": 0.5, "n": 2.0, "s": float("inf"), "ids": 6.0, "only_a": float("inf"),
                   "only_b": float("inf")}
    assert differences(a, a) == []


def test_the_command_leaves_the_import_to_the_uninterrupted_run_and_keeps_its_exit_codes(tmp_path):
    # `trainrec check` imports no workload itself (that would cost a process start-up):
    # the uninterrupted run imports it, refuses what check_resume refuses (exit 2) or fails
    # to import it (exit 3), and resolves the default --at
    done = _cli("check_core_loops:NOT_A_WORKLOAD")
    assert done.returncode == 2 and "is not a trainrec Workload" in done.stderr, done.stderr
    done = _cli("check_core_loops:NUMPY_LOOP", "--at", "0")
    assert done.returncode == 2 and "0 < K < steps=12; got [0]" in done.stderr, done.stderr
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('a dependency is missing')\n")
    done = _cli("raises_on_import:W", cwd=tmp_path)
    assert done.returncode == 3 and "a dependency is missing" in done.stderr, done.stderr
