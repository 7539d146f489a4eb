"""Exact continuation with the JAX adapter, restored in a fresh process: every
micro-step position of an accumulation window, the core NamedMpk recorder and
`FlaxMsgpackFileRecorder`, optax schedules inside the optimizer and through
`JaxLrScheduler` + `inject_hyperparams` (see `trainrec/adapters/jax/demo.py`).

The checkpointing and resuming processes read their compiled steps from the suite's
persistent compilation cache (tests/conftest.py); the uninterrupted runs they are
compared with compile theirs with the cache off, so a cache that changed a bit would
fail here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from _shared_runs import XLA_TEST_FLAG, without_xla_test_flag  # noqa: E402
from continuation import (  # noqa: E402
    WINDOW,
    assert_all,
    assert_detects_dropped_pending,
    assert_exact,
    continuation_results,
)

CASES = [
    *[("default", pos, rec) for pos in range(WINDOW) for rec in ("mpk", "flax")],
    *[("injected", pos, rec) for pos, rec in ((1, "flax"), (3, "mpk"))],
]
NO_PENDING = [("default", 2)]


# the suite compiles at -O0 (tests/conftest.py); these processes, a user's fresh-process
# resume, at XLA's default optimization level
DEFAULT_XLA = without_xla_test_flag(dict(os.environ))
UNCACHED = {**DEFAULT_XLA, "JAX_ENABLE_COMPILATION_CACHE": "false"}


# what every role process imports: forked from a zygote that imported them (see
# continuation.continuation_results), a process costs no jax, optax and flax import
PRELOAD = ["jax", "jax.numpy", "optax", "flax", "trainrec.adapters.jax", "trainrec.adapters.jax.demo"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return continuation_results("jax", CASES, NO_PENDING, tmp_path_factory.mktemp("jax"), env=DEFAULT_XLA,
                                reference_env=UNCACHED, preload=PRELOAD)


def test_these_processes_compile_at_xlas_default_level_and_the_suite_at_o0():
    assert "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""), \
        "the suite's processes compile at XLA's default level: conftest's XLA_TEST_FLAG is gone"
    for env in (DEFAULT_XLA, UNCACHED):
        assert XLA_TEST_FLAG not in env["XLA_FLAGS"].split()


def test_the_fresh_processes_share_the_suites_compilation_cache(results):
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert cache and any(p.name.endswith("-cache") for p in Path(cache).iterdir()), \
        "the checkpointing and resuming processes wrote nothing to the suite's compilation cache"


@pytest.mark.parametrize(("variant", "position", "recorder"), CASES)
def test_jax_resume_in_a_fresh_process_is_bitwise_identical(results, variant, position, recorder):
    assert_exact(results, (variant, position, recorder))


@pytest.mark.parametrize(("variant", "position"), NO_PENDING)
def test_jax_resume_without_pending_gradients_differs(results, variant, position):
    assert_detects_dropped_pending(results, (variant, position, "drop"))


@pytest.mark.cuda
@pytest.mark.skipif("not any(d.platform == 'gpu' for d in __import__('jax').devices())",
                    reason="needs a GPU visible to JAX")
def test_jax_resume_on_gpu_is_bitwise_identical(tmp_path):
    gpu = {"TRAINREC_DEMO_DEVICE": "gpu:0"}
    assert_all(continuation_results("jax", CASES, NO_PENDING, tmp_path, env={**os.environ, **gpu},
                                    reference_env={**UNCACHED, **gpu}))
