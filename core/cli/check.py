"""`trainrec check TARGET`: the command line of `trainrec.check.resume.check_resume`.

Exit codes: 0 every resume is bitwise identical, 1 one diverges, 2 a usage error (a TARGET
that names no workload, an impossible `--at`, an unknown recorder, `--plot` without
matplotlib), 3 the workload itself fails (importing its module raises, or `build`,
`micro_step`, a save or a restore raise in a run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from .terminal import printable as _printable

__all__ = ["add_check_parser", "run_check"]


def add_check_parser(sub: Any) -> None:
    """Add the `check` command to the `trainrec` parser's subparsers `sub`."""
    p = sub.add_parser(
        "check", help="prove that your training loop resumes bitwise, and say what broke it",
        description="Runs a trainrec Workload (your loop: build, micro_step, apply_window, "
        "before_capture, after_restore) without stopping; for each --at K checkpoints it after "
        "micro-step K, resumes in a fresh process and compares model, optimizer, scheduler, "
        "pending gradients, your state field by field, RNG states and the consumed batch with "
        "the uninterrupted run's, right after the restore and after every following micro-step. "
        "Names the first divergence and its likely cause. Exit 0 when every resume is bitwise "
        "identical, 1 when one diverges, 2 for usage errors, 3 when the workload itself fails.")
    p.add_argument("target", metavar="TARGET",
                   help="module:attr (or path/to/script.py:attr) naming a trainrec Workload "
                        "class or instance")
    p.add_argument("--at", type=int, nargs="+", metavar="K",
                   help="micro-steps to checkpoint after (default: one mid-window, a window "
                        "boundary, and two before the end)")
    p.add_argument("--steps", type=int, help="micro-steps in all (default: three windows)")
    p.add_argument("--window", type=int, help="accumulation window (default: the workload's)")
    p.add_argument("--recorder", default="mpk",
                   help="mpk (default), mpk-full, gz, bytes, torch, ddp, dcp, flax, orbax, one "
                        "of the workload's own recorders, or module:attr naming a recorder")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks per run (torchrun's environment; the workload starts its "
                        "process group, e.g. gloo, in build)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw each resume's differences per micro-step, beside a resume without "
                        "its pending gradients (needs matplotlib: pip install 'trainrec[plot]')")
    p.add_argument("--workdir", help="keep snapshots and checkpoints here (default: a temp dir)")
    p.add_argument("--reference", metavar="DIR",
                   help="compare with the uninterrupted run an earlier check left in its "
                        "--workdir DIR (same --steps, --window, --recorder, --seed, --nproc, its "
                        "--at covering these) instead of running it again: only for a workload "
                        "that differs from that one in its resume code alone")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take (600)")


def _target_problem(target: str) -> tuple[int, str]:
    """(exit code, why) when `target` cannot name a workload, else (0, ""). Imports
    nothing: `check_resume` starts the uninterrupted run before it imports the workload
    (and refuses one its module lacks, exit 2, or whose import raises, exit 3)."""
    module, sep, attr = target.rpartition(":")
    if not (sep and module and attr and all(a.isidentifier() for a in attr.split("."))):
        return 2, "expected module:attr (or script.py:attr) naming a trainrec Workload"
    if module.endswith(".py"):
        found: Any = os.path.isfile(module) or None
    else:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
    if found is None:
        return 2, f"no module named {module!r}"
    return 0, ""


def run_check(args: argparse.Namespace) -> int:
    """Run `trainrec check` with the parsed `args`; the exit code."""
    from ..check.resume import WorkloadError, check_resume

    code, problem = _target_problem(args.target)
    if code:
        print(f"trainrec check: {_printable(args.target)}: {_printable(problem)}", file=sys.stderr)
        return code
    try:
        report = check_resume(
            args.target, at=args.at, steps=args.steps, window=args.window,
            recorder=args.recorder, nproc=args.nproc, seed=args.seed, plot=args.plot,
            workdir=args.workdir, timeout=args.timeout, reference=args.reference)
    except WorkloadError as e:
        print(f"trainrec check: the workload failed: {e}", file=sys.stderr)
        return 3
    except (ValueError, TypeError, ImportError) as e:
        print(f"trainrec check: {_printable(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # --workdir or --plot names a place it cannot write
        print(f"trainrec check: {_printable(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(str(report))
        if args.plot:
            print(f"  plot: {args.plot}")
    return 0 if report.exact else 1
