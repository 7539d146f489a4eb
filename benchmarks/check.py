"""The cost of `trainrec check` on the README's PyTorch loop (issue 25, item 7).

    python -m benchmarks.check [--steps 48] [--repeats 3] [--json out.json]

Measures, in one run: the loop's plain training time (`--steps` micro-steps in this
process, after `build`), one process start-up (a fresh interpreter importing the loop and
building it, alone), and the wall time of `trainrec.check_resume` with its default `at`s (a
mid-window micro-step, a window boundary, one two micro-steps before the end), called here
(where the loop is imported already) and as `trainrec check` (a process of its own, which
imports the loop too). The bound the check keeps is (1 + number of `at`) x (training +
start-up); the row prints the ratio of each wall time to it, and where the check's time
went (its report's timings). Medians of `--repeats`. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import trainrec
import trainrec.adapters.torch as trt
from trainrec.check import default_ats


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


def _train(steps: int) -> float:
    parts = README_LOOP.build(0)
    t0 = time.perf_counter()
    trainrec.train_until(README_LOOP, parts, steps, README_LOOP.window)
    return time.perf_counter() - t0


def _startup() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from benchmarks.check import README_LOOP; README_LOOP.build(0)"],
                   check=True)
    return time.perf_counter() - t0


def _cli(steps: int) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainrec", "check", "benchmarks.check:README_LOOP",
                           "--steps", str(steps), "--json"], capture_output=True, text=True)
    took = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    return took


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.check")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    ats = default_ats(a.steps, README_LOOP.window)
    train = statistics.median(_train(a.steps) for _ in range(a.repeats))
    startup = statistics.median(_startup() for _ in range(a.repeats))
    walls, cli_walls, timings = [], [], []
    for _ in range(a.repeats):
        report = trainrec.check_resume("benchmarks.check:README_LOOP", steps=a.steps)
        assert report.exact, str(report)
        walls.append(report.wall_s)
        timings.append(report.timings)
        cli_walls.append(_cli(a.steps))
    wall, cli_wall = statistics.median(walls), statistics.median(cli_walls)
    bound = (1 + len(ats)) * (train + startup)
    went = {k: statistics.median(float(t[k]) for t in timings) for k in timings[0]}
    row = {"name": "trainrec check, README PyTorch loop", "steps": a.steps, "at": ats,
           "train_s": train, "startup_s": startup, "check_wall_s": wall,
           "cli_wall_s": cli_wall, "bound_s": bound, "ratio_to_bound": wall / bound,
           "cli_ratio_to_bound": cli_wall / bound, "check_timings": went}
    print(f"{row['name']}: {a.steps} micro-steps, at {ats}: training {train:.2f} s, process "
          f"start-up {startup:.2f} s; bound (1 + {len(ats)}) x (training + start-up) = "
          f"{bound:.2f} s; check_resume {wall:.2f} s = {wall / bound:.2f}x the bound, "
          f"trainrec check {cli_wall:.2f} s = {cli_wall / bound:.2f}x; inside the check: "
          + ", ".join(f"{k} {v:.2f}" for k, v in went.items()))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main()
