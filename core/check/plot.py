"""`trainrec check --plot FILE.png`: where a resume departs from the uninterrupted run.

One row per `--at K`: on the left, per micro-step from K (right after the restore) to the
end, the max abs difference of each component against the uninterrupted run (log scale;
bitwise equal sits on the "equal" floor, a difference with no size, such as a missing key
or another hash, on the "no size" ceiling); on the right the same for the resume without
its pending gradients, the departure trainrec exists to prevent. Needs matplotlib (the
`plot` extra); nothing else in the check does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .state import COMPONENTS

__all__ = ["draw"]

_COLOURS = {"model": "#1f77b4", "optimizer": "#ff7f0e", "scheduler": "#2ca02c",
            "pending": "#d62728", "state": "#9467bd", "rng": "#8c564b", "data": "#e377c2"}
_MARKERS = {"model": "o", "optimizer": "s", "scheduler": "^", "pending": "D", "state": "v",
            "rng": "P", "data": "X"}


def _bounds(curves: list[tuple[dict[str, float], ...]]) -> tuple[float, float]:
    finite = [v for curve in curves for step in curve for v in step.values()
              if v > 0 and math.isfinite(v)]
    low = 10.0 ** (math.floor(math.log10(min(finite))) - 1) if finite else 1e-8
    high = 10.0 ** (math.ceil(math.log10(max(finite))) + 1) if finite else 1.0
    return low, high


def _panel(ax: Any, at: int, curve: tuple[dict[str, float], ...], floor: float, ceiling: float,
           title: str, first: Any) -> None:
    xs = list(range(at, at + len(curve)))
    for component in COMPONENTS:
        ys = [step.get(component, 0.0) for step in curve]
        if not any(ys):
            continue  # bitwise equal throughout: listed under the plot instead
        shown = [floor if y == 0 else ceiling if not math.isfinite(y) else y for y in ys]
        ax.plot(xs, shown, marker=_MARKERS[component], color=_COLOURS[component],
                label=component, linewidth=1.5, markersize=5)
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, ceiling * 3)
    ax.axhline(floor, color="0.6", linewidth=0.8, linestyle=":")
    ax.axhline(ceiling, color="0.6", linewidth=0.8, linestyle=":")
    ax.text(xs[0], floor, " equal", va="bottom", ha="left", fontsize=8, color="0.35")
    ax.text(xs[0], ceiling, " no size (a missing key, another shape or hash)", va="top",
            ha="left", fontsize=8, color="0.35")
    ax.set_xlim(xs[0] - 0.3, xs[-1] + 0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, "every component bitwise equal\nat every micro-step", ha="center",
                va="center", transform=ax.transAxes, fontsize=10, color="#2ca02c")
    ax.set_xticks(xs)
    ax.set_xticklabels(["K" if x == at else f"{x}" for x in xs], fontsize=8)
    ax.set_xlabel(f"micro-step (K = {at}: right after the restore)", fontsize=9)
    ax.set_ylabel("max |resumed - uninterrupted|", fontsize=9)
    if first is not None:
        ax.axvline(first.micro_step, color="#d62728", linewidth=0.8, linestyle="--")
    equal = [c for c in COMPONENTS if not any(step.get(c, 0.0) for step in curve)]
    note = "bitwise equal throughout: " + (", ".join(equal) if equal else "none")
    ax.set_title(title, fontsize=10)
    ax.text(0.01, -0.28, note, transform=ax.transAxes, fontsize=8, color="0.3", va="top")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def draw(report: Any, path: Path) -> None:
    """Write the plot of `report` (a `ResumeReport` whose checks ran `without_pending`, as
    `check_resume(plot=...)` runs them) to the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checks = report.checks
    curves = [c.curve for c in checks] + [c.without_pending for c in checks if c.without_pending]
    floor, ceiling = _bounds(curves)
    cols = 2 if any(c.without_pending for c in checks) else 1
    fig, axes = plt.subplots(len(checks), cols, figsize=(7.0 * cols, 3.6 * len(checks)),
                             squeeze=False)
    for row, check in enumerate(checks):
        pending = check.at % report.window
        if check.exact:
            verdict = "bitwise identical"
        else:
            d = check.first_divergence
            verdict = f"diverges at {d.micro_step}: {d.component}"
        _panel(axes[row][0], check.at, check.curve, floor, ceiling,
               f"resume after micro-step {check.at} ({pending} of {report.window} pending): {verdict}",
               check.first_divergence)
        if cols == 2 and check.without_pending is not None:
            _panel(axes[row][1], check.at, check.without_pending, floor, ceiling,
                   "the same resume without its pending gradients", None)
    fig.suptitle(f"trainrec check {report.workload}: "
                 f"{'every resume bitwise exact' if report.exact else 'resume NOT exact'}",
                 fontsize=11, fontweight="bold")
    fig.tight_layout(h_pad=3.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
