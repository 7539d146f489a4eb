"""Exact continuation with the PyTorch adapter, restored in a fresh process: every
micro-step position of an accumulation window, the core NamedMpk recorder and
`TorchFileRecorder`, three workloads (see `trainrec/adapters/torch/demo.py`).

Each torch process costs seconds (torch and its optimizer machinery import), so one
process per workload writes all of its checkpoints, and independent processes run two
at a time; every resume still runs in a fresh process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torch")

from trainrec import read_file  # noqa: E402
from trainrec.demo import checkpoint_path, compare_items  # noqa: E402

STEPS, WINDOW = 12, 4
CASES = [  # (variant, position in the window, recorder)
    *[("default", pos, rec) for pos in range(WINDOW) for rec in ("mpk", "torch")],
    *[("conv", pos, "mpk" if pos % 2 else "torch-full") for pos in range(WINDOW)],
    *[("bf16", pos, rec) for pos, rec in ((1, "mpk-full"), (3, "torch"))],
]
VARIANTS = sorted({c[0] for c in CASES})
NO_PENDING = [("default", 2), ("bf16", 2)]


def cmd(role: str, variant: str, **kw) -> list[str]:
    out = [sys.executable, "-m", "trainrec.demo", role, "--backend", "torch", "--variant", variant,
           "--steps", str(STEPS), "--window", str(WINDOW)]
    for k, v in kw.items():
        out.append(f"--{k.replace('_', '-')}")
        out += [] if v is True else [str(x) for x in (v if isinstance(v, list) else [v])]
    return out


def run_all(cmds: list[list[str]], env: dict | None = None) -> None:
    def one(c: list[str]) -> None:
        res = subprocess.run(c, capture_output=True, text=True, env=env)
        if res.returncode:
            raise RuntimeError(f"{' '.join(c[3:])} failed:\n{res.stderr}")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, cmds))


def continuation_results(tmp: Path, env: dict | None = None) -> dict:
    """Reference items and resumed items for every case (and the drop-pending runs)."""
    first = []
    for variant in VARIANTS:
        ats = sorted({WINDOW + pos for v, pos, _ in CASES if v == variant} | {WINDOW + 2})
        recs = sorted({r for v, _, r in CASES if v == variant} | {"mpk"})
        first.append(cmd("reference", variant, out=tmp / f"{variant}-ref.mpk"))
        first.append(cmd("checkpoint", variant, at=ats, recorder=recs, checkpoint=tmp / variant))
    run_all(first, env)
    resumes = {}
    for variant, pos, rec in CASES:
        ckpt = checkpoint_path(tmp / variant, WINDOW + pos, rec)
        resumes[(variant, pos, rec)] = cmd("resume", variant, recorder=rec, checkpoint=ckpt,
                                           out=tmp / f"{variant}-{pos}-{rec}.out")
    for variant, pos in NO_PENDING:
        ckpt = checkpoint_path(tmp / variant, WINDOW + pos, "mpk")
        resumes[(variant, pos, "drop")] = cmd("resume", variant, checkpoint=ckpt, drop_pending=True,
                                              out=tmp / f"{variant}-{pos}-drop.out")
    run_all(list(resumes.values()), env)
    refs = {v: read_file(tmp / f"{v}-ref.mpk")[1] for v in VARIANTS}
    return {key: (refs[key[0]], read_file(c[c.index("--out") + 1])[1]) for key, c in resumes.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return continuation_results(tmp_path_factory.mktemp("torch-continuation"))


@pytest.mark.parametrize(("variant", "position", "recorder"), CASES)
def test_torch_resume_in_a_fresh_process_is_bitwise_identical(results, variant, position, recorder):
    reference, resumed = results[(variant, position, recorder)]
    exact, diff, paths = compare_items(reference, resumed)
    assert exact, f"differs at {paths[:5]} (max {diff})"


@pytest.mark.parametrize(("variant", "position"), NO_PENDING)
def test_torch_resume_without_pending_gradients_differs(results, variant, position):
    reference, resumed = results[(variant, position, "drop")]
    exact, diff, _ = compare_items(reference, resumed)
    assert not exact and diff > 0


@pytest.mark.cuda
@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")
def test_torch_resume_on_cuda_is_bitwise_identical(tmp_path):
    results = continuation_results(tmp_path, env={**os.environ, "TRAINREC_DEMO_DEVICE": "cuda:0"})
    for key, (reference, resumed) in results.items():
        exact, diff, paths = compare_items(reference, resumed)
        assert exact == (key[2] != "drop"), f"{key}: {paths[:5]} (max {diff})"
