"""Exact continuation on the reference adapter: checkpoint at every micro-step position
of an accumulation window, with every core recorder, restore in a fresh process,
continue, and compare bitwise with an uninterrupted run (three processes in all: the
uninterrupted run, the checkpointing run, and the resumes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainrec import read_file
from trainrec.items.tree import compare_items
from trainrec.roles import checkpoint_path

STEPS, WINDOW, BASE = 16, 4, 8
RECORDERS = ["mpk", "mpk-full", "gz", "bytes"]


def role(backend: str, name: str, steps: int = STEPS, **kw) -> None:
    """Run one role of `python -m trainrec.roles` in a fresh process."""
    cmd = [sys.executable, "-m", "trainrec.roles", name, "--backend", backend,
           "--steps", str(steps), "--window", str(WINDOW)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(x) for x in (v if isinstance(v, list) else [v])])
    subprocess.run(cmd, check=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The final records of an uninterrupted run ("reference") and of every resume, by
    (position, recorder or "drop"): one process writes every checkpoint (each position of
    the window, each recorder), and one fresh process, which has trained nothing when it
    loads the first, resumes them one after another, each into objects built afresh."""
    tmp = tmp_path_factory.mktemp("continuation")
    role("numpy", "reference", out=tmp / "reference.mpk")
    role("numpy", "checkpoint", at=[BASE + p for p in range(WINDOW)], recorder=RECORDERS, checkpoint=tmp / "ckpt")
    cases = [(p, r) for p in range(WINDOW) for r in RECORDERS] + [(p, "drop") for p in range(1, WINDOW)]
    ckpts = [checkpoint_path(tmp / "ckpt", BASE + p, "mpk" if r == "drop" else r) for p, r in cases]
    outs = [tmp / f"resumed-{p}-{r}.mpk" for p, r in cases]
    role("numpy", "resume", checkpoint=ckpts, out=outs, recorder=["mpk" if r == "drop" else r for _, r in cases],
         drop_pending=[i for i, (_, r) in enumerate(cases) if r == "drop"])
    return {"reference": read_file(tmp / "reference.mpk")[1],
            **{case: read_file(out)[1] for case, out in zip(cases, outs)}}


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("position", range(WINDOW))
def test_resume_in_a_fresh_process_is_bitwise_identical(runs, recorder, position):
    exact, diff, paths = compare_items(runs["reference"], runs[(position, recorder)])
    assert exact, f"differs at {paths[:5]} (max {diff})"


@pytest.mark.parametrize("position", range(1, WINDOW))
def test_resume_without_the_pending_gradients_is_not_identical(runs, position):
    exact, diff, paths = compare_items(runs["reference"], runs[(position, "drop")])
    assert not exact and diff > 0
    assert any(p.startswith("0.") for p in paths)  # the model parameters differ


def test_demo_exits_0_and_reports_an_exact_resume():
    out = subprocess.run([sys.executable, "-m", "trainrec", "demo", "--backend", "numpy", "--json"],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["bitwise_identical"] is True and result["max_abs_diff"] == 0
    assert result["pending_at_checkpoint"] > 0
    assert result["without_pending_identical"] is False and result["without_pending_max_abs_diff"] > 0
