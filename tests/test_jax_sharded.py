"""Sharded `jax.Array`s (`NamedSharding` over 8 CPU devices): capture copies each distinct
shard once without asking for the whole array; restore places onto the live or target
sharding, another mesh included; pending gradients follow their parameters; a run resumed
in a fresh process continues bitwise on the same mesh.

The pytest process has imported jax with one CPU device, so every check runs in a
subprocess (`tests/jax_sharded_run.py`) with `XLA_FLAGS=--xla_force_host_platform_device_count=8`,
each bounded by a timeout. The subprocesses share the session's persistent JAX compilation
cache, and each module fixture runs once for all of pytest-xdist's workers (`_shared_runs`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _shared_runs import jax_cache_env, once, xla_flags

pytest.importorskip("jax")
pytest.importorskip("optax")

SCRIPT = str(Path(__file__).with_name("jax_sharded_run.py"))
TIMEOUT = 120  # seconds per subprocess; each takes a few


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return jax_cache_env(tmp_path_factory)


def _run(cache: dict[str, str], *args: Any) -> None:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu",
               **cache)
    res = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                         timeout=TIMEOUT, env=env)
    assert res.returncode == 0, f"{args[0]} failed:\n{res.stdout}\n{res.stderr}"


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory, cache: dict[str, str]) -> dict[str, str]:
    def run(d: Path) -> dict[str, str]:
        _run(cache, "checks", d / "checks.json")
        results: dict[str, str] = json.loads((d / "checks.json").read_text())
        return results

    return once(tmp_path_factory, "jax-sharded-checks", run)


CHECKS = [
    # capture: each distinct shard (replica_id 0) transferred once, replicas never, the
    # whole array's value never asked for (no __array__/_value of it, no jax.device_get),
    # no host copy left cached on the live array
    "check_capture_copies_each_shard_once",
    # the same for a whole TrainingRecord (params, adam state, pending gradients)
    "check_training_record_capture_reads_only_shards",
    # 8-device sharded / replicated records onto live arrays, abstract targets and
    # restore_tree targets on a 4-device mesh and on the 8-device mesh, values unchanged
    "check_restore_onto_live_and_other_meshes",
    # TrainingRecord.restore and restore_tree place pending gradients on the target
    # parameters' shardings (another mesh)
    # an abstract leaf without a sharding: on the device restore is given (JaxModule, nnx)
    "check_an_abstract_leaf_without_sharding_goes_to_the_device_given",
    "check_pending_gradients_follow_parameter_shardings",
    "check_sharded_typed_keys_round_trip",
    # an array spanning other processes' devices: RecorderError naming OrbaxRecorder
    "check_not_fully_addressable_is_captured_as_shards_only_orbax_saves",
    # OrbaxRecorder: a ShardedTensor saved with a CRC per shard, read back whole or into
    # a layout; every edit of the shards table refused
    "check_orbax_saves_shards_and_checks_each_shard",
    # optax's uncommitted step count is restored uncommitted (a jitted step mixes it
    # with arrays on a mesh)
    "check_an_uncommitted_live_leaf_stays_uncommitted",
]


def test_every_check_of_the_script_is_run_here(checks: dict[str, str]) -> None:
    assert sorted(checks) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_sharded_arrays(checks: dict[str, str], name: str) -> None:
    assert name in checks, f"{name} did not run"
    assert checks[name] == "ok", checks[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, cache: dict[str, str]) -> Path:
    def run(d: Path) -> Path:
        _run(cache, "reference", d / "ckpt.mpk", 6, d / "reference.npz")  # micro-step 6 of 16, windows of 4
        return d

    return once(tmp_path_factory, "jax-sharded-runs", run)


def _load(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _equal(a: dict[str, np.ndarray[Any, Any]], b: dict[str, np.ndarray[Any, Any]]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_fresh_process_resume_on_the_same_mesh_is_bitwise(runs: Path, cache: dict[str, str],
                                                         tmp_path: Path) -> None:
    _run(cache, "resume", runs / "ckpt.mpk", "same", tmp_path / "same.npz")
    # restored values (params and pending gradients, on live arrays of another seed) are the checkpoint's
    _equal(_load(runs / "reference.npz.at.npz"), _load(tmp_path / "same.npz.at.npz"))
    _equal(_load(runs / "reference.npz"), _load(tmp_path / "same.npz"))


def test_fresh_process_resume_on_another_mesh_restores_exactly_and_continues_closely(
        runs: Path, cache: dict[str, str], tmp_path: Path) -> None:
    _run(cache, "resume", runs / "ckpt.mpk", "other", tmp_path / "other.npz")
    # restored exactly, onto abstract targets sharded on 4 other devices with another layout
    _equal(_load(runs / "reference.npz.at.npz"), _load(tmp_path / "other.npz.at.npz"))
    # the continuation is compared at a tolerance: another mesh splits the matmuls' and the
    # mean's reductions differently, so the summation order, and the last bits, can change
    ref, other = _load(runs / "reference.npz"), _load(tmp_path / "other.npz")
    assert sorted(ref) == sorted(other)
    for k in ref:
        np.testing.assert_allclose(other[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
