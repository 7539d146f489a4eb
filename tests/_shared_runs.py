"""Expensive state that tests share across pytest-xdist's workers.

Under `pytest -n N` a module- or session-scoped fixture runs once per worker that runs one
of its tests; `once` makes it run once per test session: the first worker to ask builds
the value under a file lock (pytest-xdist's documented pattern: a file in the workers'
common temporary directory), the others wait for it and read it back. Without xdist it is
the plain fixture.

`XLA_TEST_FLAG` is what the suite adds to `XLA_FLAGS` (tests/conftest.py): XLA's CPU backend
compiles at LLVM's -O0, and `xla_flags` gives a process the caller's flags with more of its own.

`jax_cache_env` is the environment of a persistent JAX compilation cache that every
process of the session shares: a fresh process that compiles what an earlier one compiled
reads the executable instead (the same XLA executable: the results are the same bits).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory all workers of this session share (under xdist, the parent
    of each worker's own; without it, the session's: never one that other runs share)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)` run once per session, whichever worker asks first; the others get a
    copy (pickled). `folder` is empty and stays for the session. A build that raises
    (a failure, a skip) leaves nothing: the next worker to ask builds again."""
    root = shared_dir(tmp_path_factory)
    done = root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if done.exists():
            value: T = pickle.loads(done.read_bytes())
            return value
        work = root / name
        shutil.rmtree(work, ignore_errors=True)  # a build that raised
        work.mkdir()
        value = build(work)
        partial = done.with_name(done.name + ".tmp")
        partial.write_bytes(pickle.dumps(value))
        os.replace(partial, done)
        return value


XLA_TEST_FLAG = "--xla_backend_optimization_level=0"


def xla_flags(*more: str, base: dict[str, str] | None = None) -> str:
    """`XLA_FLAGS` of `base` (default: this process's environment) with `more` after them."""
    return " ".join([(base if base is not None else os.environ).get("XLA_FLAGS", ""), *more]).strip()


def without_xla_test_flag(env: dict[str, str]) -> dict[str, str]:
    """`env` as XLA compiles by default: without the suite's `XLA_TEST_FLAG`."""
    flags = env.get("XLA_FLAGS", "").split()
    return {**env, "XLA_FLAGS": " ".join(f for f in flags if f != XLA_TEST_FLAG)}


def jax_cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment variables that give a JAX process the session's persistent compilation
    cache (every compile cached, however quick or small); one already set is kept."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        shared_dir(tmp_path_factory) / "jax-compilation-cache")
    return {"JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get(
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": os.environ.get(
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")}
