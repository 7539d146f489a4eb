"""The cost of `trainrec check` on the README's PyTorch loop (issue 25, item 7).

    python -m benchmarks.check [--steps 48] [--repeats 3] [--json out.json]

Measures, in one run: the loop's plain training time (`--steps` micro-steps in this
process, after `build`), one process start-up (a fresh interpreter importing the loop and
building it, alone), and the wall time of `trainrec.check_resume` with its default `at`s (a
mid-window micro-step, a window boundary, one two micro-steps before the end), called here
(where the loop is imported already) and as `trainrec check` (a process of its own, which
imports the loop too). The bound the check keeps is (1 + number of `at`) x (training +
start-up); the rows print the ratio of each to it in wall time and in CPU time (user +
system, the check's processes summed: on a machine other jobs load, wall times swing with
them and CPU times much less), and where the check's time went (its report's timings).
Medians of `--repeats`. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import trainrec
import trainrec.adapters.torch as trt
from trainrec.check.resume import default_ats


@trainrec.record
class State:
    micro: int
    rng: trt.TorchRngRecord | None = None


class ReadmeLoop(trainrec.Workload):
    """The README's PyTorch loop ("Checking your own loop")."""

    state_type = State
    window = 4

    def build(self, seed: int) -> trainrec.Parts:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
        return trainrec.Parts(model, optimizer, scheduler, State(micro=0))

    def micro_step(self, parts: trainrec.Parts) -> None:
        x = torch.randn(16, 8)
        parts.report_batch(x)
        loss = nn.functional.mse_loss(parts.model(x), x.sum(1, keepdim=True)) / self.window
        loss.backward()  # type: ignore[no-untyped-call]
        parts.accumulator.accumulate(parts.model, trt.grads_from(parts.model))

    def apply_window(self, parts: trainrec.Parts, window: int) -> None:
        trt.set_grads(parts.model, parts.accumulator.grads())
        nn.utils.clip_grad_norm_(parts.model.parameters(), max_norm=1.0)
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()

    def before_capture(self, parts: trainrec.Parts) -> None:
        parts.state.rng = trt.TorchRngRecord.capture()

    def after_restore(self, parts: trainrec.Parts) -> None:
        parts.state.rng.apply()


README_LOOP = ReadmeLoop()


def _children_cpu() -> float:
    """CPU seconds (user + system) of the ended child processes waited for, theirs too."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _train(steps: int) -> tuple[float, float]:
    """Wall and CPU seconds of `steps` plain micro-steps in this process."""
    parts = README_LOOP.build(0)
    t0, c0 = time.perf_counter(), time.process_time()
    trainrec.train_until(README_LOOP, parts, steps, README_LOOP.window)
    return time.perf_counter() - t0, time.process_time() - c0


def _startup() -> tuple[float, float]:
    """Wall and CPU seconds of a fresh interpreter importing the loop and building it."""
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-c", "from benchmarks.check import README_LOOP; README_LOOP.build(0)"],
                   check=True)
    return time.perf_counter() - t0, _children_cpu() - c0


def _cli(steps: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), _children_cpu()
    done = subprocess.run([sys.executable, "-m", "trainrec", "check", "benchmarks.check:README_LOOP",
                           "--steps", str(steps), "--json"], capture_output=True, text=True)
    took = time.perf_counter() - t0, _children_cpu() - c0
    assert done.returncode == 0, done.stdout + done.stderr
    return took


def _in_process(steps: int) -> tuple[float, float, dict[str, float]]:
    t0, c0, p0 = time.perf_counter(), _children_cpu(), time.process_time()
    report = trainrec.check_resume("benchmarks.check:README_LOOP", steps=steps)
    assert report.exact, str(report)
    cpu = _children_cpu() - c0 + time.process_time() - p0
    return time.perf_counter() - t0, cpu, report.timings


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.check")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    ats = default_ats(a.steps, README_LOOP.window)
    med = statistics.median
    trains = [_train(a.steps) for _ in range(a.repeats)]
    starts = [_startup() for _ in range(a.repeats)]
    checks = [_in_process(a.steps) for _ in range(a.repeats)]
    clis = [_cli(a.steps) for _ in range(a.repeats)]
    n = 1 + len(ats)
    row: dict[str, Any] = {"name": "trainrec check, README PyTorch loop", "steps": a.steps, "at": ats}
    for kind, i in (("wall", 0), ("cpu", 1)):
        train, startup = med(t[i] for t in trains), med(t[i] for t in starts)
        bound = n * (train + startup)
        check, cli = med(c[i] for c in checks), med(c[i] for c in clis)
        row[kind] = {"train_s": train, "startup_s": startup, "bound_s": bound,
                     "check_resume_s": check, "trainrec_check_s": cli,
                     "check_resume_ratio": check / bound, "trainrec_check_ratio": cli / bound}
        print(f"{row['name']}, {kind} time: {a.steps} micro-steps, at {ats}: training {train:.2f} s, "
              f"process start-up {startup:.2f} s; bound (1 + {len(ats)}) x (training + start-up) = "
              f"{bound:.2f} s; check_resume {check:.2f} s = {check / bound:.2f}x the bound, "
              f"trainrec check {cli:.2f} s = {cli / bound:.2f}x")
    went = {k: med(float(c[2][k]) for c in checks) for k in checks[0][2]}
    row["check_timings"] = went
    print("  inside check_resume (wall): " + ", ".join(f"{k} {v:.2f}" for k, v in went.items()))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main()
