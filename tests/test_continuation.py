"""Exact continuation on the reference adapter: checkpoint at every micro-step position
of an accumulation window, with every core recorder, restore in a fresh process,
continue, and compare bitwise with an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainrec import read_file
from trainrec.items.tree import compare_items

STEPS, WINDOW, BASE = 16, 4, 8


def role(backend: str, name: str, steps: int = STEPS, **kw) -> None:
    """Run one role of `python -m trainrec.roles` in a fresh process."""
    cmd = [sys.executable, "-m", "trainrec.roles", name, "--backend", backend,
           "--steps", str(steps), "--window", str(WINDOW)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    subprocess.run(cmd, check=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "reference.mpk"
    role("numpy", "reference", out=out)
    return read_file(out)[1]


@pytest.mark.parametrize("recorder", ["mpk", "mpk-full", "gz", "bytes"])
@pytest.mark.parametrize("position", range(WINDOW))
def test_resume_in_a_fresh_process_is_bitwise_identical(reference, tmp_path: Path, recorder, position):
    ckpt, out = tmp_path / "ckpt", tmp_path / "resumed.mpk"
    role("numpy", "checkpoint", at=BASE + position, recorder=recorder, checkpoint=ckpt)
    role("numpy", "resume", recorder=recorder, checkpoint=ckpt, out=out)
    exact, diff, paths = compare_items(reference, read_file(out)[1])
    assert exact, f"differs at {paths[:5]} (max {diff})"


@pytest.mark.parametrize("position", range(1, WINDOW))
def test_resume_without_the_pending_gradients_is_not_identical(reference, tmp_path, position):
    ckpt, out = tmp_path / "ckpt", tmp_path / "resumed.mpk"
    role("numpy", "checkpoint", at=BASE + position, checkpoint=ckpt)
    role("numpy", "resume", checkpoint=ckpt, out=out, drop_pending=True)
    exact, diff, paths = compare_items(reference, read_file(out)[1])
    assert not exact and diff > 0
    assert any(p.startswith("0.") for p in paths)  # the model parameters differ


def test_demo_exits_0_and_reports_an_exact_resume():
    out = subprocess.run([sys.executable, "-m", "trainrec", "demo", "--backend", "numpy", "--json"],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["bitwise_identical"] is True and result["max_abs_diff"] == 0
    assert result["pending_at_checkpoint"] > 0
    assert result["without_pending_identical"] is False and result["without_pending_max_abs_diff"] > 0
