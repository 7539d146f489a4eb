"""What `trainrec check` reports: `ResumeReport` (one `ResumeCheck` per resume, each with the
first `Divergence` and its cause), its text (`format_report`, what `trainrec check` prints)
and its `--json` object, and `WorkloadError` (the workload itself failed: exit 3).

The report's types alone: `trainrec.check.resume` makes them. Imports only the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Divergence", "ResumeCheck", "ResumeReport", "WorkloadError", "format_report"]


class WorkloadError(RuntimeError):
    """The workload itself failed (an exception in `build`, `micro_step`, a save or a
    restore, or a process that died): `trainrec check` exits 3. The message holds the
    failing role's traceback."""


@dataclass(frozen=True)
class Divergence:
    """Where a resumed run first departs from the uninterrupted one: after `micro_step`
    micro-steps (K: right after the restore), in `component` (one of `COMPONENTS`), at
    `key` (its path inside the component), by `max_abs_diff` (inf where the difference has
    no size: another shape or key set, a string, a hash); `rank` under `nproc > 1`."""

    micro_step: int
    component: str
    key: str
    max_abs_diff: float
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_step": self.micro_step, "component": self.component,
                               "key": self.key, "max_abs_diff": _finite(self.max_abs_diff)}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True)
class ResumeCheck:
    """One resume: checkpointed after micro-step `at`, resumed in a fresh process.

    `curve[i]` is, for micro-step `at + i`, the max difference of each component against
    the uninterrupted run (0.0 where bitwise equal); `without_pending` the same for the
    resume without its pending gradients (when it was run: `plot=`). `differing` lists every
    difference at the first divergent micro-step."""

    at: int
    first_divergence: Divergence | None
    cause: str
    curve: tuple[dict[str, float], ...]
    differing: tuple[Divergence, ...] = ()
    without_pending: tuple[dict[str, float], ...] | None = None

    @property
    def exact(self) -> bool:
        return self.first_divergence is None

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "exact": self.exact,
                "first_divergence": None if self.first_divergence is None
                else self.first_divergence.to_json(), "cause": self.cause}


@dataclass(frozen=True)
class ResumeReport:
    """What `check_resume` found; `exact` when every resume was bitwise identical."""

    workload: str
    steps: int
    window: int
    recorder: str
    nproc: int
    checks: tuple[ResumeCheck, ...]
    wall_s: float
    train_s: float
    """The reference run's time in `micro_step` and `apply_window` (plain training)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Where the time went: the reference's `snapshot_s` and `save_s`, `startup_s` (its
    process start-up: the interpreter, trainrec, the workload's module and framework),
    the resumes' `resume_startup_s` and `resume_train_s` (the slowest) and `runs` (processes
    per rank). The resumes start while the uninterrupted run trains, so on a busy machine
    each start-up is slowed by the others: `benchmarks/check.py` measures one alone."""
    reference: str | None = None
    """The workload whose earlier uninterrupted run was reused (`reference=`), else None."""

    @property
    def exact(self) -> bool:
        return all(c.exact for c in self.checks)

    @property
    def cause(self) -> str:
        """The cause of the first resume that diverged ("" when all are exact)."""
        return next((c.cause for c in self.checks if not c.exact), "")

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: `{"exact", "checks": [{"at", "exact", "first_divergence",
        "cause"}], "cause", ...}`; a non-finite difference is `null`."""
        return {"exact": self.exact, "checks": [c.to_json() for c in self.checks],
                "cause": self.cause, "workload": self.workload, "steps": self.steps,
                "window": self.window, "recorder": self.recorder, "nproc": self.nproc,
                "wall_s": self.wall_s, "train_s": self.train_s, **self.timings,
                **({"reference": self.reference} if self.reference else {})}

    def __str__(self) -> str:
        return format_report(self)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _gap_text(x: float) -> str:
    return "no size (another shape, kind or value)" if not math.isfinite(x) else f"{x:.3g}"


def format_report(report: ResumeReport) -> str:
    """The report as `trainrec check` prints it."""
    lines = [f"trainrec check: {report.workload}: {report.steps} micro-steps, window "
             f"{report.window}, recorder {report.recorder}"
             + (f", {report.nproc} ranks" if report.nproc > 1 else "")]
    for c in report.checks:
        pending = c.at % report.window
        where = f"resume after micro-step {c.at} ({pending} of {report.window} pending)"
        d = c.first_divergence
        if d is None:
            lines.append(f"  {where}: bitwise identical at {c.at}..{report.steps}")
            continue
        step = "right after the restore" if d.micro_step == c.at else \
            f"after micro-step {d.micro_step} (K+{d.micro_step - c.at})"
        rank = f" on rank {d.rank}" if d.rank is not None else ""
        lines.append(f"  {where}: DIVERGES {step}{rank}: {d.component} {d.key}, max abs "
                     f"diff {_gap_text(d.max_abs_diff)}")
        others = [o for o in c.differing if (o.component, o.key) != (d.component, d.key)]
        if others:
            shown = ", ".join(f"{o.component} {o.key}" for o in others[:4])
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            lines.append(f"    also differing then: {shown}{more}")
        lines.append(f"    cause: {c.cause}")
    if report.reference:
        lines.append(f"  compared with the uninterrupted run of {report.reference} (reused)")
    lines.append(_cost_text(report))
    lines.append("RESULT: every resume is bitwise exact" if report.exact
                 else "RESULT: resume is NOT exact")
    return "\n".join(lines)


def _cost_text(report: ResumeReport) -> str:
    t = report.timings
    text = f"  wall time {report.wall_s:.1f} s (training {report.train_s:.2f} s of the reference run"
    if "runs" in t:
        text += (f"; {t['runs']:g} processes, each starting in {t['startup_s']:.1f} s "
                 f"(the uninterrupted run) to {t['resume_startup_s']:.1f} s (the slowest resume)")
        if "forked_from_s" in t:
            text += (f", forked from one that imported the workload in {t['forked_from_s']:.1f} s")
    return text + ")"
