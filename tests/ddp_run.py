"""One rank of a small DDP run with gradient accumulation, for test_torch_distributed.py:
`python tests/ddp_run.py MODE RANK WORLD STORE OUT`, all ranks started together
(gloo on CPU, a `FileStore` at STORE: no port to pick).

Windows of WINDOW micro-steps; all but a window's last micro-step run under
`model.no_sync()`. Even windows accumulate natively in `.grad` (the usual DDP way; the
pending `.grad` is the model record's), odd windows through trainrec's accumulator (put
back into `.grad` before the last backward, which DDP then all-reduces), so a checkpoint
in either holds each rank's own pending gradients. Each rank draws its own batches and
dropout masks from torch's RNG, seeded per rank; `forward_sync_buffers=False` lets each
rank's BatchNorm statistics drift apart, so they too are each rank's own.

MODE:
- `checkpoint`: the uninterrupted run: train to STEPS, saving OUT/ckpt/step-A and step-B
  mid-window with `DistributedRecorder` (a save changes nothing the run goes on with: the
  resumes are compared with this run), and write the final capture to OUT/final-RANK.mpk;
  then save it as OUT/ckpt/step-STEPS, during which rank 1 kills itself (SIGKILL) half-way
  through writing its part; rank 0 writes the error it got to OUT/kill-error.txt and exits.
- `resume:S[,S...]`: restore OUT/ckpt/step-S into fresh objects, train to STEPS, write
  OUT/resumed-S-RANK.mpk; each S in turn, each into objects built anew (the process never
  trained but from a restore: one process start-up for every resume).
- `load-damaged`: load OUT/damaged (rank 1's part truncated) and write what each rank
  got to OUT/load-damaged-RANK.txt.
- `timeout`: `DistributedRecorder(timeout=2)` on a new group per case, into OUT/timeout:
  every rank saves step-1 and loads it back (both written to
  OUT/timeout-{saved,loaded}-RANK.mpk); then rank 0 alone saves (`only0`), rank 1
  alone saves (`only1`) and after it gave up rank 0 saves too, late (`late0`), and rank 1
  alone loads (`load1`), then every rank does (`reload`). Each outcome goes to
  OUT/timeout-CASE-RANK.json (the error's type and message, the seconds it took, whether
  the live model stayed as it was).

With DDP_RUN_DEVICE=cuda the ranks run NCCL, one GPU each (the `cuda` test); a world of
one rank has nobody to kill, so its last save just commits.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import random
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainrec
import trainrec.adapters.torch as trt
from trainrec import (
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    TrainingRecord,
)

WINDOW, STEPS = 3, 12
A, B = 4, 8  # A: 1 pending, through the accumulator; B: 2 pending, in .grad


@trainrec.record
class State:
    micro: int
    rng: trt.TorchRngRecord | None = None


class DyingRecorder(NamedMpkFileRecorder):
    """Writes half a part, then the process is killed, as by the OOM killer."""

    def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
        Path(args).write_bytes(b"\x93partial")
        os.kill(os.getpid(), signal.SIGKILL)


DEVICE = os.environ.get("DDP_RUN_DEVICE", "cpu")


def device(rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if DEVICE == "cuda" else "cpu")


def build(rank: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(16, 2)).to(device(rank))
    ids = [rank] if DEVICE == "cuda" else None
    model = DistributedDataParallel(net, device_ids=ids, forward_sync_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    torch.manual_seed(1000 + rank)  # each rank its own batches and dropout masks
    random.seed(rank)  # recorded by TorchRngRecord too: the same in every run
    return model, opt, sched, GradientsAccumulator(), State(micro=0)


def train(model, opt, sched, acc, state, until, on_step=None):
    while state.micro < until:
        window, pos = divmod(state.micro, WINDOW)
        last = pos == WINDOW - 1
        through_acc = window % 2 == 1
        if last and through_acc:
            trt.set_grads(model, acc.grads())  # the window's sum; this backward adds to it
        x = torch.randn(8, 4, device=next(model.parameters()).device)
        with contextlib.nullcontext() if last else model.no_sync():
            loss = nn.functional.mse_loss(model(x), x[:, :2].sin()) / WINDOW
            loss.backward()
        if through_acc and not last:
            acc.accumulate(model, trt.grads_from(model))
        state.micro += 1
        if last:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(state.micro)


def capture(model, opt, sched, acc, state):
    state.rng = trt.TorchRngRecord.capture()
    return TrainingRecord.capture(model, opt, sched, acc, state)


def main() -> None:
    mode, rank, world, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    kind, _, steps = mode.partition(":")
    for one in ([f"resume:{s}" for s in steps.split(",")] if kind == "resume" else [mode]):
        run(one, rank, world, out)
    finish()


def run(mode: str, rank: int, world: int, out: Path) -> None:
    native = NamedMpkFileRecorder(NativePrecisionSettings())
    ckpt = out / "ckpt"
    model, opt, sched, acc, state = build(rank)
    if mode == "checkpoint":
        def save(micro: int) -> None:
            if micro in (A, B):
                capture(model, opt, sched, acc, state).save(trt.DistributedRecorder(),
                                                            ckpt / f"step-{micro:08d}")
        train(model, opt, sched, acc, state, STEPS, on_step=save)
        final = capture(model, opt, sched, acc, state)
        final.save(native, out / f"final-{rank}.mpk")
        if world == 1:
            final.save(trt.DistributedRecorder(), ckpt / f"step-{STEPS:08d}")
            return
        dying = trt.DistributedRecorder(DyingRecorder() if rank == 1 else None)
        try:
            final.save(dying, ckpt / f"step-{STEPS:08d}")
        except trainrec.RecorderError as e:
            (out / "kill-error.txt").write_text(f"{type(e).__name__}: {e}")
        os._exit(0)  # the group lost a rank: no orderly shutdown
    elif mode.startswith("resume:"):
        step = int(mode.split(":")[1])
        record = TrainingRecord.load(trt.DistributedRecorder(), ckpt / f"step-{step:08d}",
                                     device(rank), state_type=State)
        r = record.restore(model, opt, sched, device(rank))
        acc, state = r.accumulator, r.state
        state.rng.apply()
        train(model, opt, sched, acc, state, STEPS)
        capture(model, opt, sched, acc, state).save(native, out / f"resumed-{step}-{rank}.mpk")
    elif mode == "load-damaged":  # OUT/damaged: rank 1's part truncated by the test
        try:
            TrainingRecord.load(trt.DistributedRecorder(), out / "damaged", device(rank), state_type=State)
            result = "loaded"
        except trainrec.RecorderError as e:
            result = f"{type(e).__name__}: {e}"
        (out / f"load-damaged-{rank}.txt").write_text(result)
    elif mode == "timeout":
        timeout_cases(model, opt, sched, acc, state, rank, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def finish() -> None:
    gc.collect()  # the DDP reducer goes before its group does
    dist.destroy_process_group()
    # torch 2.13's gloo can abort at interpreter teardown ("terminate called without an
    # active exception", seen once in CI after all went well): skip teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def timeout_cases(model, opt, sched, acc, state, rank: int, out: Path) -> None:
    import json

    import timeout_outcomes  # next to this file

    folder = out / "timeout"
    train(model, opt, sched, acc, state, A)

    def attempt(case: str, call) -> None:
        timeout_outcomes.attempt(out, case, rank, call, lambda: {
            k: v.clone() for k, v in model.state_dict().items()})

    def recorder():
        return trt.DistributedRecorder(group=dist.new_group(backend="gloo"), timeout=2)

    saved = capture(model, opt, sched, acc, state)
    rec = recorder()
    attempt("save", lambda: saved.save(rec, folder / "step-1"))
    back = TrainingRecord.load(rec, folder / "step-1", device(rank), state_type=State)
    store = rec.group.get_group_store()  # the save's meeting keys went once the load's met
    meetings = {f"{n}/DistributedRecorder.{what}/{k}": store.check([f"trainrec/meeting/{n}/DistributedRecorder.{what}/{k}"])
                for n, what in ((0, "save"), (1, "load")) for k in ("outcome", "arrived", f"rank/{rank}")}
    (out / f"timeout-keys-{rank}.json").write_text(json.dumps(meetings))
    # every rank saves over step-1: rank 0 refuses to start, and tells rank 1 why
    attempt("again", lambda: saved.save(trt.DistributedRecorder(), folder / "step-1"))
    native = NamedMpkFileRecorder(NativePrecisionSettings())
    saved.save(native, out / f"timeout-saved-{rank}.mpk")
    back.save(native, out / f"timeout-loaded-{rank}.mpk")
    train(model, opt, sched, acc, state, A + 2)  # the live run is past step-1: a load would show
    rec = recorder()
    if rank == 0:
        attempt("only0", lambda: saved.save(rec, folder / "step-2"))
    dist.barrier()
    rec = recorder()
    if rank == 1:
        attempt("only1", lambda: saved.save(rec, folder / "step-3"))
    dist.barrier()  # rank 1 gave up: rank 0 comes late to the same save
    if rank == 0:
        attempt("late0", lambda: saved.save(rec, folder / "step-3"))
    rec = recorder()
    if rank == 1:
        attempt("load1", lambda: TrainingRecord.load(rec, folder / "step-1", device(rank),
                                                      state_type=State).restore(
            model, opt, sched, device(rank)))
    dist.barrier()
    # the check of load1 can fail: a load on every rank does change the live run
    attempt("reload", lambda: TrainingRecord.load(recorder(), folder / "step-1", device(rank),
                                                   state_type=State).restore(model, opt, sched, device(rank)))


if __name__ == "__main__":
    main()
