"""`DistributedRecorder` on 2 ranks (gloo, CPU) against the single-process recorder and
`torch.distributed.checkpoint`, on one DDP training state.

    python -m benchmarks.distributed [--size 256MiB] [--repeats 3] [--json results.json]

The state: a model of 16 f32 parameters (`--size` / 4 bytes in all), AdamW moments for
each (two more copies, equal on both ranks) and pending gradients that differ per rank
(one more copy): about `--size` bytes per rank, three quarters of it replicated. Rows,
each the median over `--repeats` of the slowest rank:

- `DistributedRecorder` save (every rank's part, one commit) and load (each rank reads the
  replicated part and its own);
- the same `TrainingRecord` of rank 0 saved and loaded by `NamedMpkFileRecorder` in one
  process while rank 1 waits: what one rank costs without the distributed layout;
- `dcp.save` / `dcp.load` of the model's and optimizer's state dicts (no pending
  gradients: DCP has no place for them), each rank writing its share;
- FSDP2: the same parameters sharded by `fully_shard` over the 2 ranks (half the bytes per
  rank), AdamW moments and pending `.grad` (sharded), saved and loaded by `DCPRecorder`
  against plain `dcp.save` / `dcp.load` of the same state dicts (`get_state_dict` plus the
  gradients); the recorder adds the scheduler and caller-state parts, the commit (fsync,
  rename, the entries' CRC-32s) and, on load, its checks: with `verify=True` (the
  default) every entry's CRC-32 before any live tensor changes (a second read of the
  bytes), with `verify=False` only the non-tensor entries' (like for like: DCP keeps
  no checksums);
- `dcp.load + get/set_state_dict`: the whole resume of torch's DCP recipe for FSDP2
  (`set_state_dict` gives the optimizer its saved param groups), plus the scheduler.

Ratios are printed against the single-process recorder and DCP of the same run (the FSDP2
rows against the FSDP2 DCP rows). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PARAMS = 16


def _rank_main(rank: int, world: int, root: str, nbytes: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    import trainrec
    import trainrec.adapters.torch as trt
    from trainrec import (
        GradientsAccumulator,
        NamedMpkFileRecorder,
        NativePrecisionSettings,
        TrainingRecord,
    )

    @trainrec.record
    class State:
        micro: int

    # one intra-op thread per rank, as torchrun sets (OMP_NUM_THREADS=1 unless told
    # otherwise): 2 ranks of 2 OpenMP threads each on 2 cores made every copy bimodal
    torch.set_num_threads(1)
    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=rank, world_size=world)
    per = max(1, nbytes // 4 // 4 // PARAMS)  # f32 elements per parameter
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(PARAMS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model:
        p.grad = torch.randn(per)
    opt.step()  # the moments exist
    torch.manual_seed(1 + rank)
    for p in model:
        p.grad = torch.randn(per)  # pending, each rank's own
    record = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), State(3))
    native = NamedMpkFileRecorder(NativePrecisionSettings())

    def timed(fn: Any, solo: bool = False) -> float:
        """Median over repeats of the slowest rank's seconds (`solo`: rank 0 alone)."""
        runs = []
        for i in range(repeats):
            if rank == 0:
                os.sync()  # no earlier row's dirty pages left for this one to flush
            dist.barrier()
            t0 = time.perf_counter()
            if not solo or rank == 0:
                fn(i)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            runs.append(float(took))
        return statistics.median(runs)

    def fresh(name: str, i: int) -> Path:
        path = base / f"{name}-{i}"
        if rank == 0 and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        dist.barrier()
        return path

    paths = {i: base / f"dist-{i}" for i in range(repeats)}
    rows = {
        "DistributedRecorder save": timed(lambda i: record.save(trt.DistributedRecorder(), paths[i])),
        "DistributedRecorder load": timed(
            lambda i: TrainingRecord.load(trt.DistributedRecorder(), paths[i], state_type=State)),
        "NamedMpkFileRecorder save (one process)": timed(
            lambda i: record.save(native, base / f"single-{i}.mpk"), solo=True),
        "NamedMpkFileRecorder load (one process)": timed(
            lambda i: TrainingRecord.load(native, base / f"single-{i}.mpk", state_type=State), solo=True),
    }
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dirs = {i: fresh("dcp", i) for i in range(repeats)}
    rows["dcp.save (model + optimizer)"] = timed(lambda i: dcp.save(state, checkpoint_id=dirs[i]))
    rows["dcp.load (model + optimizer)"] = timed(lambda i: dcp.load(state, checkpoint_id=dirs[i]))
    rows.update(_fsdp_rows(rank, base, per, repeats, timed, fresh))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_rows(rank: int, base: Path, per: int, repeats: int, timed: Any, fresh: Any) -> dict[str, float]:
    """`DCPRecorder` against plain `dcp.save` / `dcp.load` of the same FSDP2 state: the
    same parameters, AdamW moments and pending gradients, sharded over the 2 ranks (each
    rank holds half), plus the recorder's scheduler and caller state parts."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import trainrec
    import trainrec.adapters.torch as trt

    @trainrec.record
    class State:
        micro: int
        rng: trt.TorchRngRecord

    torch.manual_seed(0)
    holder = nn.Module()
    holder.params = nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(PARAMS)])
    fully_shard(holder)
    opt = torch.optim.AdamW(holder.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    for p in holder.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in holder.parameters():
        p.grad = torch.randn_like(p)  # pending
    state = State(3, trt.TorchRngRecord.capture())
    rec = trt.DCPRecorder()
    rows = {}
    paths = {i: fresh("fsdp-rec", i) for i in range(repeats)}
    rows["DCPRecorder save (FSDP2, + grads)"] = timed(
        lambda i: rec.save(paths[i], holder, opt, sched, state))
    rows["DCPRecorder load (FSDP2, + grads)"] = timed(
        lambda i: rec.load(paths[i], holder, opt, sched, state_type=State))
    rows["DCPRecorder load, verify=False (FSDP2, + grads)"] = timed(
        lambda i: rec.load(paths[i], holder, opt, sched, state_type=State, verify=False))
    msd, osd = get_state_dict(holder, opt)
    grads = {n: p.grad for n, p in holder.named_parameters()}
    plain = {"model": msd, "optim": osd, "grads": grads}
    dirs = {i: fresh("fsdp-dcp", i) for i in range(repeats)}
    rows["dcp.save (FSDP2, same state)"] = timed(lambda i: dcp.save(plain, checkpoint_id=dirs[i]))
    rows["dcp.load (FSDP2, same state)"] = timed(lambda i: dcp.load(plain, checkpoint_id=dirs[i]))

    def resume(i: int) -> None:
        """What torch's DCP recipe for FSDP2 does to resume: get_state_dict, dcp.load into
        it, set_state_dict (which gives the optimizer its saved param groups, lr included),
        plus the pending gradients and the scheduler."""
        msd, osd = get_state_dict(holder, opt)
        grads = {n: p.grad for n, p in holder.named_parameters()}
        tree = {"model": msd, "optim": osd, "grads": grads, "sched": sched.state_dict()}
        dcp.load(tree, checkpoint_id=dirs[i])
        set_state_dict(holder, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
        sched.load_state_dict(tree["sched"])

    plain["sched"] = sched.state_dict()
    dirs = {i: fresh("fsdp-resume", i) for i in range(repeats)}
    timed(lambda i: dcp.save(plain, checkpoint_id=dirs[i]))
    rows["dcp.load + get/set_state_dict (FSDP2 resume)"] = timed(resume)
    return rows


def main() -> None:
    import torch.multiprocessing as mp

    from benchmarks.state import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="bytes of state per rank (e.g. 64MiB, 1GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="trainrec-dist-bench-") as root:
        out = Path(root) / "rows.json"
        mp.spawn(_rank_main, args=(2, root, nbytes, args.repeats, str(out)), nprocs=2)
        rows = json.loads(out.read_text())
    single = {"save": rows["NamedMpkFileRecorder save (one process)"],
              "load": rows["NamedMpkFileRecorder load (one process)"]}
    peer = {"save": rows["dcp.save (model + optimizer)"], "load": rows["dcp.load (model + optimizer)"]}
    fsdp = {"save": rows["dcp.save (FSDP2, same state)"], "load": rows["dcp.load (FSDP2, same state)"]}
    print(f"2 ranks, gloo on CPU, {args.size} of state per rank, median of {args.repeats}")
    print(f"{'row':44} {'seconds':>9} {'x one process':>14} {'x dcp':>7}")
    for name, seconds in rows.items():
        op = "save" if "save" in name else "load"
        against = fsdp if "FSDP2" in name else peer
        print(f"{name:44} {seconds:9.3f} {seconds / single[op]:14.2f} {seconds / against[op]:7.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"size": nbytes, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
