"""One rank of the 2-rank saves and loads at an S3 URL, for test_object_store_folders.py:
`python tests/objstore_ranks.py RANK WORLD STORE OUT BASE`, all ranks started together (gloo
on CPU, a `FileStore` at STORE; BASE an `s3://bucket/run` URL on the moto server whose
endpoint the environment names). Every check in one process start, in order:

- `ddp`: a DDP model mid-window (each rank its own pending `.grad` under `no_sync()`),
  saved with `DistributedRecorder` to BASE/ddp and loaded back on every rank; a second save
  to it (refused); a save to BASE/ddp-failed whose rank 1 fails writing its part;
- `dcp`: an FSDP2 model mid-window saved with `DCPRecorder` to BASE/dcp, loaded back into
  fresh objects on every rank (full tensors compared); rank 0 dumps the full tensors to
  OUT/dcp-full.pt (the test reshards the checkpoint into one process); a save to
  BASE/dcp-failed whose rank 1's second upload fails;
- BASE/ddp loaded once more after both failures.

Each rank writes what it found to OUT/rank-RANK.json.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import trainrec
import trainrec.adapters.torch as trt
from trainrec import (
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    TrainingRecord,
)

NATIVE = NativePrecisionSettings()


@trainrec.record
class State:
    micro: int


class FailingOnRank1(NamedMpkFileRecorder):
    def save_item(self, item, args, record_type="Item", *, allow_lossy=False):
        if dist.get_rank() == 1 and Path(args).name.startswith("rank-"):
            raise OSError(28, "injected: no space left writing rank 1's part")
        return super().save_item(item, args, record_type, allow_lossy=allow_lossy)


def same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_tree, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def ddp_build(rank: int):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    return model, opt


def ddp_step(model, opt) -> None:
    model(torch.randn(4, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.zero_grad()
    with model.no_sync():  # pending, each rank's own
        model(torch.randn(4, 4, dtype=torch.float64)).sum().backward()


def fsdp_build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return model, opt, sched


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp_full(model, opt) -> dict:
    params = dict(model.named_parameters())
    return {"params": {n: full(p.detach()).clone() for n, p in params.items()},
            "grads": {n: full(p.grad).clone() for n, p in params.items() if p.grad is not None},
            "optim": {n: {k: full(v).clone() for k, v in opt.state[p].items()}
                      for n, p in params.items() if p in opt.state}}


def error_of(call) -> str:
    try:
        call()
    except trainrec.RecorderError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main() -> None:
    rank, world, store, out, base = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                     Path(sys.argv[4]), sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    found: dict = {}

    model, opt = ddp_build(rank)
    ddp_step(model, opt)
    rec = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), State(micro=rank))
    rec.save(trt.DistributedRecorder(), f"{base}/ddp")
    loaded = TrainingRecord.load(trt.DistributedRecorder(), f"{base}/ddp", state_type=State)
    fresh, fresh_opt = ddp_build(rank)
    loaded.restore(fresh, fresh_opt, None, "cpu")
    found["ddp_loaded_same"] = loaded.state.micro == rank and all(
        torch.equal(a, b) and a.dtype == b.dtype and torch.equal(a.grad, b.grad)
        for a, b in zip(model.parameters(), fresh.parameters())) and same_tree(
        opt.state_dict(), fresh_opt.state_dict())
    found["ddp_grads"] = [p.grad.sum().item() for p in model.parameters()]
    found["ddp_again"] = error_of(lambda: rec.save(trt.DistributedRecorder(), f"{base}/ddp"))
    found["ddp_failed"] = error_of(lambda: rec.save(trt.DistributedRecorder(FailingOnRank1(NATIVE)),
                                                    f"{base}/ddp-failed"))

    fmodel, fopt, fsched = fsdp_build()
    torch.manual_seed(200 + rank)
    fmodel(torch.randn(4, 4)).sum().backward()
    fopt.step()
    fsched.step()
    fopt.zero_grad()
    fmodel(torch.randn(4, 4)).sum().backward()  # pending, sharded
    trt.DCPRecorder().save(f"{base}/dcp", fmodel, fopt, fsched, State(micro=10 + rank))
    before = fsdp_full(fmodel, fopt)
    if rank == 0:
        torch.save(before, out / "dcp-full.pt")
    lmodel, lopt, lsched = fsdp_build()
    got = trt.DCPRecorder().load(f"{base}/dcp", lmodel, lopt, lsched, state_type=State)
    found["dcp_loaded_same"] = (got.state.micro == 10 + rank and same_tree(before, fsdp_full(lmodel, lopt))
                                and lsched.state_dict() == fsched.state_dict())

    from trainrec.storage import folder

    real, calls = folder.upload, []

    def failing(url, **kw):
        calls.append(url)
        if rank == 1 and len(calls) == 2:
            raise trainrec.RecorderError("injected: the store went away", source=url)
        return real(url, **kw)

    folder.upload = failing
    try:
        found["dcp_failed"] = error_of(lambda: trt.DCPRecorder().save(
            f"{base}/dcp-failed", fmodel, fopt, fsched, State(micro=0)))
    finally:
        folder.upload = real
    again = TrainingRecord.load(trt.DistributedRecorder(), f"{base}/ddp", state_type=State)
    found["ddp_after_failures_same"] = trainrec.read_file(f"{base}/ddp")[0].format == "trainrec.distributed" \
        and again.state.micro == rank
    (out / f"rank-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
