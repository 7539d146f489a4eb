"""`pytest -n auto` (the README's test command) starts one xdist worker more than the cores
it may run on, up to 8 cores (tests/conftest.py: `auto_workers`); PYTEST_XDIST_AUTO_NUM_WORKERS
still decides when set; the suite keeps its bytecode where PYTHONDONTWRITEBYTECODE is set
(tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import auto_workers, usable_cores

HERE = Path(__file__).resolve().parent


def test_one_worker_more_than_the_cores_up_to_eight():
    assert [auto_workers(n) for n in (1, 2, 4, 7, 8, 16)] == [2, 3, 5, 8, 8, 16]


def _workers(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider",
                           f"{Path(__file__).name}::test_one_worker_more_than_the_cores_up_to_eight"],
                          cwd=HERE, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = re.search(r"created: (\d+)/\1 workers?\b", done.stdout)
    assert found, done.stdout[-2000:]
    return int(found.group(1))


def test_n_auto_starts_them_and_the_variable_still_decides():
    pytest.importorskip("xdist")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    assert _workers(env) == auto_workers(usable_cores())
    assert _workers({**env, "PYTEST_XDIST_AUTO_NUM_WORKERS": "1"}) == 1


def test_the_suite_and_the_processes_it_starts_keep_their_bytecode():
    assert not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ
    child = subprocess.run([sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["False"], child.stdout + child.stderr
