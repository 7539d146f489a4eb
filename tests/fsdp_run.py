"""One rank of a tiny FSDP2 run with gradient accumulation, for test_torch_fsdp.py:
`python tests/fsdp_run.py MODE RANK WORLD STORE OUT`, all ranks started together (gloo on
CPU, a `FileStore` at STORE).

Windows of WINDOW micro-steps with gradient sync on (FSDP2's default): each backward
reduce-scatters into the sharded `.grad`, so mid-window the pending gradients are sharded
DTensors. Each rank draws its own batches from torch's RNG, seeded per rank.

Every dump (`torch.save`, one file per rank) holds the full (gathered) parameters,
pending gradients and optimizer moments, the scheduler's last LR, the caller's counter and
this rank's torch RNG state.

MODE (checkpoints under OUT/ckpt{WORLD}):
- `checkpoint`, 2 ranks: the uninterrupted run: saves step-A and step-B mid-window
  (dumping atWORLD-S-RANK.pt as saved; step-B with async_save=True on a gloo group of its
  own, committed while training goes on, after async-needs-a-group-RANK.txt records the
  refusal without one), trains to STEPS and dumps final2-RANK.pt, then
  saves step-STEPS while rank 1 is killed (SIGKILL) inside DCP's write; rank 0 writes the
  error it got to kill-error.txt.
- `checkpoint`, another world size: trains to A and saves step-A only (for the load into 2
  ranks), then accumulates one micro-step with set_requires_gradient_sync(False) and writes
  the refusal to unsynced-error-RANK.txt.
- `resume`: in fresh objects, read `opt.state[p]` of every parameter (a defaultdict: empty
  entries), restore step-A, train to STEPS, dump resumed-A-RANK.pt; the same from step-B
  after reading one parameter's.
- `timeout`, 2 ranks: `DCPRecorder(timeout=2)` on a new gloo group per case, into
  OUT/timeout: every rank saves step-1 (and step-2 with async_save=True) and loads step-1
  back, dumping timeout-saved-RANK.pt and timeout-loaded-RANK.pt; then rank 0 alone saves
  with async_save=True (`only0`), rank 1 alone saves (`only1`), and rank 0 alone loads
  step-1 (`load0`), then every rank does (`reload`), each outcome in
  OUT/timeout-CASE-RANK.json (the error's type and message, the seconds it took, whether
  this rank's shards, gradients and optimizer state stayed as they were).
- `M1+M2`: M1, then M2 in fresh objects (one process start for both).
- `damaged`, 2 ranks: copies of step-A with one byte of rank 1's shard file flipped, and
  with rank 1's part cut short, and a sound copy loaded with `verify=1` on rank 1; each rank, mid-window with optimizer state, loads them and
  writes damaged-{shard,part}-RANK.txt: its error and whether its live parameters,
  gradients and optimizer state stayed as they were.
- `reshard:N:S`: wait (up to 2 min) for OUT/ckptN/step-S (saved by N ranks, maybe by a
  run going on beside this one), restore it with rank_state="drop" and
  dump resharded-N-S-RANK.pt at once; then check that the default refuses.

With FSDP_RUN_DEVICE=cuda the ranks run NCCL, one GPU each (the `cuda` test).
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import trainrec
import trainrec.adapters.torch as trt

WINDOW, STEPS = 3, 9
A, B = 4, 8  # 1 and 2 micro-steps pending
DEVICE = os.environ.get("FSDP_RUN_DEVICE", "cpu")


@trainrec.record
class State:
    micro: int
    rng: trt.TorchRngRecord | None = None


def device(rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if DEVICE == "cuda" else "cpu")


def build(rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device(rank))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    torch.manual_seed(1000 + rank)
    return model, opt, sched, State(micro=0)


def train(model, opt, sched, state, until, on_step=None):
    while state.micro < until:
        last = state.micro % WINDOW == WINDOW - 1
        x = torch.randn(8, 4, device=device(dist.get_rank()))
        loss = nn.functional.mse_loss(model(x), x[:, :2].sin()) / WINDOW
        loss.backward()
        state.micro += 1
        if last:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(state.micro)


def full(t):
    return t.full_tensor().cpu() if hasattr(t, "full_tensor") else t.cpu()


def dump(model, opt, sched, state, file: Path) -> None:
    params = dict(model.named_parameters())
    out = {
        "params": {n: full(p.detach()) for n, p in params.items()},
        "grads": {n: full(p.grad) for n, p in params.items() if p.grad is not None},
        "optim": {n: {k: full(v) for k, v in opt.state[p].items()}
                  for n, p in params.items() if p in opt.state},
        "lr": sched.get_last_lr(),
        "micro": state.micro,
        "rng": torch.get_rng_state(),
    }
    torch.save(out, file)


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's live parameters, pending gradients and optimizer state, copied."""
    out = {}
    for n, p in model.named_parameters():
        out[f"param.{n}"] = p.detach().to_local().clone()
        if p.grad is not None:
            out[f"grad.{n}"] = p.grad.to_local().clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{n}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def save(model, opt, sched, state, path: Path, recorder=None, **kwargs):
    state.rng = trt.TorchRngRecord.capture()
    return (recorder or trt.DCPRecorder()).save(path, model, opt, sched, state, **kwargs)


def main() -> None:
    mode, rank, world, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    for one in mode.split("+"):
        run(one, rank, world, out)
    gc.collect()  # the FSDP modules go before their group does
    dist.destroy_process_group()
    # torch 2.13's gloo can abort at interpreter teardown ("terminate called without an
    # active exception", seen once in ~20 4-rank runs) after all went well: skip teardown
    sys.stdout.flush()
    os._exit(0)


def run(mode: str, rank: int, world: int, out: Path) -> None:
    ckpt = out / f"ckpt{world}"
    model, opt, sched, state = build(rank)
    if mode == "checkpoint":
        def at(micro: int) -> None:
            if micro in (A, B):
                save(model, opt, sched, state, ckpt / f"step-{micro:08d}")
                dump(model, opt, sched, state, out / f"at{world}-{micro}-{rank}.pt")
        if world != 2:  # only step-A, for the 4 -> 2 load; then the unsynced refusal
            train(model, opt, sched, state, A, on_step=at)
            model.set_requires_gradient_sync(False)
            model(torch.randn(8, 4, device=device(rank))).sum().backward()
            try:
                save(model, opt, sched, state, ckpt / "unsynced")
            except trainrec.RecorderError as e:
                (out / f"unsynced-error-{rank}.txt").write_text(str(e))
        else:
            try:
                save(model, opt, sched, state, ckpt / "no-group", async_save=True)
            except ValueError as e:
                (out / f"async-needs-a-group-{rank}.txt").write_text(str(e))
            async_rec = trt.DCPRecorder(group=dist.new_group(backend="gloo"))
            futures = []

            def at_async(micro: int) -> None:  # step B in the background, training goes on
                if micro == B:
                    futures.append(save(model, opt, sched, state, ckpt / f"step-{micro:08d}",
                                        async_rec, async_save=True))
                    dump(model, opt, sched, state, out / f"at{world}-{micro}-{rank}.pt")
                else:
                    at(micro)

            train(model, opt, sched, state, STEPS, on_step=at_async)
            assert futures[0].result() == ckpt / f"step-{B:08d}"
            dump(model, opt, sched, state, out / f"final{world}-{rank}.pt")
            if rank == 1:
                from torch.distributed.checkpoint import FileSystemWriter

                def die(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGKILL)

                FileSystemWriter.write_data = die  # type: ignore[method-assign]
            try:
                save(model, opt, sched, state, ckpt / f"step-{STEPS:08d}")
            except trainrec.RecorderError as e:
                (out / "kill-error.txt").write_text(f"{type(e).__name__}: {e}")
            os._exit(0)  # the group lost a rank: no orderly shutdown
    elif mode == "resume":
        for step in (A, B):
            model, opt, sched, _ = build(rank)
            # logging code that reads opt.state[p] (a defaultdict) adds empty entries: every
            # parameter's before step A's load, one before step B's (DCP planned no optimizer
            # entries, and lost every moment and step; with one read, set_state_dict raised
            # after the weights were overwritten)
            for p in list(model.parameters())[: None if step == A else 1]:
                assert not opt.state[p]
            restored = trt.DCPRecorder().load(ckpt / f"step-{step:08d}", model, opt, sched,
                                              state_type=State)
            state = restored.state
            state.rng.apply()
            train(model, opt, sched, state, STEPS)
            dump(model, opt, sched, state, out / f"resumed{world}-{step}-{rank}.pt")
    elif mode == "damaged":
        # one byte of rank 1's shard file flipped, rank 1's part cut short, or verify=1 on
        # rank 1 only (API misuse on one rank): every rank refuses before any changes (and
        # none waits for the others until the timeout)
        train(model, opt, sched, state, A + 1)  # pending gradients and optimizer state, live
        for damage in ("shard", "part", "misuse"):
            path = out / f"damaged{world}-{damage}"
            if rank == 0:
                shutil.copytree(ckpt / f"step-{A:08d}", path)
            if rank == 0 and damage != "misuse":
                file = path / ("dcp/__1_0.distcp" if damage == "shard" else "rank-00001-of-00002.mpk")
                data = bytearray(file.read_bytes())
                if damage == "shard":  # inside rank 1's shard of a parameter: only it reads it
                    from torch.distributed.checkpoint import FileSystemReader
                    where = [info for index, info in
                             FileSystemReader(str(path / "dcp")).read_metadata().storage_data.items()
                             if index.fqn.startswith("model.") and info.relative_path == file.name]
                    data[where[0].offset + where[0].length // 2] ^= 0x01
                else:
                    del data[len(data) // 2:]
                file.write_bytes(bytes(data))
            dist.barrier()
            before = snapshot(model, opt)
            verify = 1 if damage == "misuse" and rank == 1 else True  # a bool is asked for
            try:
                trt.DCPRecorder().load(path, model, opt, sched, state_type=State, verify=verify)
                outcome = "loaded"
            except (trainrec.RecorderError, TypeError) as e:
                outcome = f"{type(e).__name__}: {e}"
            after = snapshot(model, opt)
            unchanged = before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before)
            (out / f"damaged-{damage}-{rank}.txt").write_text(f"unchanged={unchanged}\n{outcome}")
    elif mode.startswith("reshard:"):
        saved, step = (int(v) for v in mode.split(":")[1:])
        path = out / f"ckpt{saved}" / f"step-{step:08d}"
        for _ in range(1200):  # another group of ranks may still be saving it
            if path.exists():  # committed by one rename: whole once it exists
                break
            time.sleep(0.1)
        restored = trt.DCPRecorder().load(path, model, opt, sched, rank_state="drop")
        assert restored.state is None and restored.saved_world_size == saved
        dump(model, opt, sched, State(micro=step), out / f"resharded{saved}to{world}-{step}-{rank}.pt")
        try:
            trt.DCPRecorder().load(path, model, opt, sched, state_type=State)
        except trainrec.RecordMismatchError as e:
            (out / f"refused{saved}to{world}-{rank}.txt").write_text(str(e))
        chosen = trt.DCPRecorder().load(path, model, opt, sched, state_type=State, rank_state=1)
        assert chosen.state.micro == step, chosen.state
    elif mode == "timeout":
        timeout_cases(model, opt, sched, state, rank, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def timeout_cases(model, opt, sched, state, rank: int, out: Path) -> None:
    import timeout_outcomes  # next to this file

    folder = out / "timeout"
    train(model, opt, sched, state, A)

    def attempt(case: str, call) -> None:  # this rank's own tensors: no collective, unlike dump
        timeout_outcomes.attempt(out, case, rank, call, lambda: snapshot(model, opt))

    def recorder():
        return trt.DCPRecorder(group=dist.new_group(backend="gloo"), timeout=2)

    rec = recorder()
    attempt("save", lambda: save(model, opt, sched, state, folder / "step-1", rec))
    dump(model, opt, sched, state, out / f"timeout-saved-{rank}.pt")
    assert save(model, opt, sched, state, folder / "step-2", rec,
                async_save=True).result() == folder / "step-2"
    fresh, fresh_opt, fresh_sched, _ = build(rank)
    back = rec.load(folder / "step-1", fresh, fresh_opt, fresh_sched, state_type=State).state
    back.rng.apply()
    dump(fresh, fresh_opt, fresh_sched, back, out / f"timeout-loaded-{rank}.pt")
    train(model, opt, sched, state, A + 2)  # the live run is past step-1: a load would show
    rec = recorder()
    if rank == 0:
        attempt("only0", lambda: save(model, opt, sched, state, folder / "step-3", rec,
                                      async_save=True).result())
    dist.barrier()
    rec = recorder()
    if rank == 1:
        attempt("only1", lambda: save(model, opt, sched, state, folder / "step-4", rec))
    dist.barrier()
    rec = recorder()
    if rank == 0:
        attempt("load0", lambda: rec.load(folder / "step-1", model, opt, sched, state_type=State))
    dist.barrier()
    # the check of load0 can fail: a load on every rank does change the live run
    attempt("reload", lambda: recorder().load(folder / "step-1", model, opt, sched, state_type=State))


if __name__ == "__main__":
    main()
