"""Exact continuation with the PyTorch adapter, restored in a fresh process: every
micro-step position of an accumulation window, the core NamedMpk recorder and
`TorchFileRecorder`, three workloads (see `trainrec/adapters/torch/demo.py`).

Each torch process costs seconds (torch and its optimizer machinery import), so one
process per workload writes all of its checkpoints, one fresh process per workload
resumes them all (it has trained nothing when it loads the first; each resume goes into
objects built afresh), and independent processes run two at a time, each forked from a
zygote that imported torch once (a process of its own; the resumes' zygote is not the
one the checkpoints and references came from).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

from continuation import (  # noqa: E402
    WINDOW,
    assert_all,
    assert_detects_dropped_pending,
    assert_exact,
    continuation_results,
)

CASES = [  # (variant, position in the window, recorder)
    *[("default", pos, rec) for pos in range(WINDOW) for rec in ("mpk", "torch")],
    *[("conv", pos, "mpk" if pos % 2 else "torch-full") for pos in range(WINDOW)],
    *[("bf16", pos, rec) for pos, rec in ((1, "mpk-full"), (3, "torch"))],
]
NO_PENDING = [("default", 2), ("bf16", 2)]


# what every role process imports: forked from a zygote that imported them (see
# continuation.continuation_results), a process costs no torch import
PRELOAD = ["torch", "torch.optim", "trainrec.adapters.torch", "trainrec.adapters.torch.demo"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return continuation_results("torch", CASES, NO_PENDING, tmp_path_factory.mktemp("torch"), preload=PRELOAD)


@pytest.mark.parametrize(("variant", "position", "recorder"), CASES)
def test_torch_resume_in_a_fresh_process_is_bitwise_identical(results, variant, position, recorder):
    assert_exact(results, (variant, position, recorder))


@pytest.mark.parametrize(("variant", "position"), NO_PENDING)
def test_torch_resume_without_pending_gradients_differs(results, variant, position):
    assert_detects_dropped_pending(results, (variant, position, "drop"))


@pytest.mark.cuda
@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")
def test_torch_resume_on_cuda_is_bitwise_identical(tmp_path):
    assert_all(continuation_results("torch", CASES, NO_PENDING, tmp_path,
                                    env={**os.environ, "TRAINREC_DEMO_DEVICE": "cuda:0"}))
