"""`trainrec.testing`: helpers for your own test suite.

`assert_exact_resume(workload, at=...)` runs `trainrec.check_resume` and fails like a
pytest assertion, with the check's report as the message, when a resume is not bitwise
identical to the uninterrupted run::

    # tests/test_resume.py
    from trainrec.testing import assert_exact_resume
    from mytraining import MyLoop          # a trainrec.Workload

    def test_my_loop_resumes_exactly():
        assert_exact_resume(MyLoop, at=[6, 8])
"""

from __future__ import annotations

from typing import Any

from .check.resume import ResumeReport, check_resume

__all__ = ["assert_exact_resume"]


def assert_exact_resume(workload: Any, **options: Any) -> ResumeReport:
    """Check `workload` (a `Workload` class, instance or `"module:attr"`) as
    `check_resume(workload, **options)` does (`at=`, `steps=`, `window=`, `recorder=`,
    `nproc=`, ...) and return the report. Raises `AssertionError` whose message is the
    report (each resume's first divergence and its likely cause) when any resume diverges;
    a workload that fails itself raises `trainrec.check.resume.WorkloadError`."""
    report = check_resume(workload, **options)
    if not report.exact:
        raise AssertionError(f"the resume is not bitwise exact\n{report}")
    return report
