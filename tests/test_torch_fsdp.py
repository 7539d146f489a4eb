"""FSDP2 (`fully_shard`) through `torch.distributed.checkpoint`: `DCPRecorder` keeps the
sharded model, optimizer and pending `.grad`, a mid-window checkpoint resumes bitwise in
fresh processes, 2 -> 4 and 4 -> 2 ranks reshard every value unchanged, per-rank caller
state at another world size is refused unless the caller chooses, gradients accumulated
with `set_requires_gradient_sync(False)` are refused, and a rank killed inside DCP's write
commits nothing.

The runs (tests/fsdp_run.py: gloo on CPU, spawned processes, a tiny model) go in two
bounded phases: the uninterrupted 2-rank run (checkpoints at micro-steps 4 and 8, the
second asynchronous, then the killed save); then the 2-rank resumes beside the 4-rank
processes, which first load the 2-rank checkpoint, resharded, then save their own at
micro-step 4, which the 2 ranks load last. Dumps hold full (gathered) tensors, compared bitwise on this machine.
Each fixture's phases run once for all of pytest-xdist's workers (`_shared_runs.once`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _shared_runs import once  # noqa: E402
from timeout_outcomes import assert_timed_out, outcome  # noqa: E402 - next to this file

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import CorruptRecordError, FileMissingError, RecordMismatchError  # noqa: E402

RUN = Path(__file__).with_name("fsdp_run.py")
PHASE_TIMEOUT_S = 120
A, B, STEPS = 4, 8, 9  # as in fsdp_run.py


def _phase(out: Path, runs: list[tuple[str, int]], device: str = "cpu") -> None:
    procs = []
    for mode, world in runs:
        store = out / f"store-{world}-{mode.replace(':', '-').replace('+', '-')}"
        for rank in range(world):
            procs.append((mode, world, rank, subprocess.Popen(
                [sys.executable, str(RUN), mode, str(rank), str(world), str(store), str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "FSDP_RUN_DEVICE": device})))
    failures = []
    for mode, world, rank, p in procs:
        try:
            text, _ = p.communicate(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for *_, q in procs:
                q.kill()
            pytest.fail(f"the {world}-rank run {mode!r} did not finish in {PHASE_TIMEOUT_S} s")
        killed = mode == "checkpoint" and world == 2 and rank == 1
        if p.returncode != (-9 if killed else 0):
            failures.append(f"{mode} ({world} ranks) rank {rank} exited {p.returncode}:\n{text[-3000:]}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")

    def run(out: Path) -> Path:
        (out / "ckpt2").mkdir()
        (out / "ckpt4").mkdir()
        _phase(out, [("checkpoint", 2)])
        # the 2 ranks load the 4 ranks' step-A once they committed it
        _phase(out, [(f"resume+damaged+reshard:4:{A}", 2), (f"reshard:2:{B}+checkpoint", 4)])
        return out

    return once(tmp_path_factory, "fsdp-runs", run)


def _load(path: Path):
    return torch.load(path, weights_only=True)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("step", [A, B])
def test_a_mid_window_checkpoint_resumes_bitwise_on_every_rank(runs, step):
    for rank in range(2):
        final, resumed = _load(runs / f"final2-{rank}.pt"), _load(runs / f"resumed2-{step}-{rank}.pt")
        assert _same(final, resumed), f"rank {rank}, resumed from micro-step {step}"
    # the checkpoint was mid-window: gradients were pending, sharded
    at = _load(runs / f"at2-{step}-0.pt")
    assert len(at["grads"]) == 4 and all(g.abs().sum() > 0 for g in at["grads"].values())
    # each rank's RNG is its own (each draws its own batches): one copy would not do
    assert not torch.equal(_load(runs / "final2-0.pt")["rng"], _load(runs / "final2-1.pt")["rng"])


@pytest.mark.parametrize(("saved", "world", "step"), [(2, 4, B), (4, 2, A)])
def test_another_world_size_reshards_model_optimizer_and_gradients_unchanged(runs, saved, world, step):
    at = _load(runs / f"at{saved}-{step}-0.pt")
    assert at["grads"] and at["optim"]
    for rank in range(world):
        loaded = _load(runs / f"resharded{saved}to{world}-{step}-{rank}.pt")
        for key in ("params", "grads", "optim", "lr"):
            assert _same(at[key], loaded[key]), (key, rank)
        refusal = (runs / f"refused{saved}to{world}-{rank}.txt").read_text()
        assert f"saved by {saved} rank(s), this run has {world}" in refusal
        assert "rank_state='drop'" in refusal


@pytest.mark.parametrize(("damage", "error"), [
    # DCP keeps no checksums: a flipped byte loaded as a wrong value. The manifest has the
    # CRC-32 of every entry DCP wrote; rank 1 reads the damaged one
    ("shard", r"ChecksumError: shard file __1_0\.distcp is damaged: the \d+ bytes at "
              r"offset \d+ have CRC-32 [0-9a-f]{8}, the save wrote [0-9a-f]{8}"),
    # rank 1 refused before DCP's collectives, and rank 0 waited in them until the timeout
    ("part", r"CorruptRecordError: .*rank-00001-of-00002\.mpk"),
    # misuse on rank 1 only (verify=1): raised there before the ranks met, the same wait
    ("misuse", r"TypeError: verify must be True or False, got 1"),
])
def test_one_rank_s_damaged_file_is_refused_on_every_rank_before_any_changes(runs, damage, error):
    """Rank 1 raises what is wrong; rank 0, whose files are sound, raises naming rank 1,
    before reading any tensor; neither rank's live state changed."""
    one = (runs / f"damaged-{damage}-1.txt").read_text()  # TypeError, misuse: raised as is
    zero = (runs / f"damaged-{damage}-0.txt").read_text()
    assert one.startswith("unchanged=True\n") and re.search(error, one), one
    assert zero.startswith("unchanged=True\nRecorderError: rank 1 could not load its part of "
                           "the checkpoint (") and re.search(error, zero), zero


def test_the_checkpoint_is_a_dcp_directory_with_rank_parts(runs):
    path = runs / "ckpt4" / f"step-{A:08d}"
    assert sorted(os.listdir(path)) == ["dcp", "manifest.json"] + [
        f"rank-{r:05d}-of-00004.mpk" for r in range(4)]
    assert sorted(os.listdir(path / "dcp")) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    assert {"model.0.weight", "grads.0.weight", "grads.2.bias"} <= set(keys)
    assert any(k.startswith("optim.state.0.weight.exp_avg") for k in keys)


def test_unsynced_accumulation_is_refused_with_the_way_out(runs):
    for rank in range(4):
        error = (runs / f"unsynced-error-{rank}.txt").read_text()
        assert "set_requires_gradient_sync(False)" in error and "gradient sync on" in error
    assert not (runs / "ckpt4" / "unsynced").exists()


def test_an_async_save_without_a_group_of_its_own_is_refused(runs):
    for rank in range(2):
        error = (runs / f"async-needs-a-group-{rank}.txt").read_text()
        assert "process group of its own" in error and "new_group" in error
    assert not (runs / "ckpt2" / "no-group").exists()


def test_a_rank_killed_during_dcp_s_write_leaves_the_previous_checkpoint_loadable(runs):
    error = (runs / "kill-error.txt").read_text()
    assert error.startswith("RecorderError: the ranks could not meet") and "nothing was committed" in error
    assert sorted(os.listdir(runs / "ckpt2")) == [f"step-{A:08d}", f"step-{B:08d}"]
    # and the previous checkpoint was resumed from, bitwise, above (step B)


@pytest.fixture(scope="module")
def timeout_runs(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")

    def run(out: Path) -> Path:
        (out / "timeout").mkdir()
        _phase(out, [("timeout", 2)])
        return out

    return once(tmp_path_factory, "fsdp-timeout-runs", run)


def test_with_a_timeout_every_rank_saves_and_loads_back_as_before(timeout_runs):
    for rank in range(2):
        assert outcome(timeout_runs, "save", rank)["error"] is None
        assert outcome(timeout_runs, "reload", rank)["error"] is None
        saved, loaded = (_load(timeout_runs / f"timeout-{w}-{rank}.pt") for w in ("saved", "loaded"))
        assert _same(saved, loaded), rank
    assert sorted(os.listdir(timeout_runs / "timeout")) == ["step-1", "step-2"]  # step-2: async


@pytest.mark.parametrize(("case", "rank", "missing", "what"), [
    ("only0", 0, 1, "save"), ("only1", 1, 0, "save"), ("load0", 0, 1, "load")])
def test_a_save_or_load_called_on_one_rank_fails_within_the_timeout(timeout_runs, case, rank, missing, what):
    """Rank `rank` alone calls it (only0: with async_save=True, whose meeting is in the
    calling thread): with timeout=2 it raises in seconds, naming the rank that did not
    join, having written (no temp directory) and loaded nothing."""
    got = outcome(timeout_runs, case, rank)
    assert_timed_out(got, missing, f"DCPRecorder.{what}")
    if what == "load":  # the check can fail: a load on every rank changes the live shards
        assert not outcome(timeout_runs, "reload", rank)["unchanged"]
    assert sorted(os.listdir(timeout_runs / "timeout")) == ["step-1", "step-2"]
    header, _ = trainrec.read_file(timeout_runs / "timeout" / "step-1")  # intact
    assert header.format == "trainrec.dcp"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_ranks_on_gpus_resume_bitwise_from_mid_window(tmp_path):
    """The 2-rank run and its resumes on NCCL, one GPU per rank (needs two GPUs)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    (tmp_path / "ckpt2").mkdir()
    _phase(tmp_path, [("checkpoint", 2)], "cuda")
    _phase(tmp_path, [("resume", 2)], "cuda")
    for step in (A, B):
        for rank in range(2):
            assert _same(_load(tmp_path / f"final2-{rank}.pt"),
                         _load(tmp_path / f"resumed2-{step}-{rank}.pt")), (step, rank)


# -- in this process: reading and refusing, no process group needed -------------------------


@pytest.fixture
def saved(runs, tmp_path):
    return Path(shutil.copytree(runs / "ckpt2" / f"step-{A:08d}", tmp_path / "step"))


def _write_metadata(path: Path, data: bytes) -> None:
    """Write DCP's .metadata and its size and CRC-32 into the manifest: a forger's file, to
    reach the checks behind the checksum (tests/test_attack_dcp_metadata.py has the rest)."""
    import zlib

    (path / "dcp" / ".metadata").write_bytes(data)
    _edit_manifest(path, metadata={"size": len(data), "crc32": zlib.crc32(data)})


def _edit_manifest(path: Path, **changes):
    import json

    doc = json.loads((path / "manifest.json").read_text())
    doc.update(changes)
    (path / "manifest.json").write_text(json.dumps(doc))


def _plain():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    # built as fsdp_run.py builds it: a schedule over another base lr is refused (test_schedule_identity)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


@pytest.mark.parametrize(("damage", "error", "match"), [
    (lambda p: (p / "manifest.json").unlink(), CorruptRecordError, "holds no manifest.json"),
    (lambda p: _edit_manifest(p, format="trainrec.other"), CorruptRecordError, "not a trainrec.dcp"),
    (lambda p: _edit_manifest(p, version=[4, 0]), trainrec.UnsupportedVersionError, "version 4.0"),
    (lambda p: _edit_manifest(p, version=[2, 0]), trainrec.UnsupportedVersionError,
     "version 2.0.*older trainrec.*save it again"),
    (lambda p: _edit_manifest(p, world_size=0), CorruptRecordError, "malformed world_size"),
    (lambda p: _edit_manifest(p, dcp="../x"), CorruptRecordError, "malformed dcp"),
    (lambda p: _edit_manifest(p, grads="0.weight"), CorruptRecordError, "malformed grads"),
    (lambda p: (p / "dcp" / ".metadata").unlink(), CorruptRecordError, r"\.metadata is missing"),
    (lambda p: _edit_manifest(p, save_id="000000000000"), CorruptRecordError, "a part of another save"),
    (lambda p: (p / "rank-00000-of-00002.mpk").unlink(), CorruptRecordError, "part the manifest lists is missing"),
    (lambda p: _edit_manifest(p, grads=["nope.weight"]), RecordMismatchError, "parameter the model lacks"),
])
def test_a_damaged_checkpoint_is_refused_before_anything_changes(saved, damage, error, match):
    damage(saved)
    model, opt = _plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        trt.DCPRecorder().load(saved, model, opt, _sched(opt), rank_state="drop")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_misuse_is_refused(saved, tmp_path):
    model, opt = _plain()
    with pytest.raises(RecordMismatchError, match=r"saved by 2 rank\(s\), this run has 1"):
        trt.DCPRecorder().load(saved, model, opt)
    with pytest.raises(ValueError, match=r"rank_state must be a rank in \[0, 2\), got 2"):
        trt.DCPRecorder().load(saved, model, opt, rank_state=2)
    with pytest.raises(ValueError, match="rank_state must be 'own', 'drop' or a rank"):
        trt.DCPRecorder().load(saved, model, opt, rank_state="first")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        trt.DCPRecorder().load(saved, object(), opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        trt.DCPRecorder().save(tmp_path / "x", model, object())
    with pytest.raises(TypeError, match="state must be a Record"):
        trt.DCPRecorder().save(tmp_path / "x", model, opt, None, {"micro": 1})
    with pytest.raises(FileMissingError, match="no committed DCPRecorder checkpoint"):
        trt.DCPRecorder().load(tmp_path / "missing", model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    shards = json.loads((saved / "manifest.json").read_text())["shards"]
    _edit_manifest(saved, world_size=1, parts=["rank-00000-of-00002.mpk"], shards=shards[:1])
    with pytest.raises(CorruptRecordError, match="world_size is 2, the manifest says 1"):
        trt.DCPRecorder().load(saved, model, opt, sched)


@trainrec.record
class Counter:
    micro: int
    half: torch.Tensor


def test_one_process_without_a_group_saves_and_loads_back_every_component(tmp_path):
    """No process group: one rank, plain tensors (DCP runs without one); bf16 parameters
    and optimizer state, pending .grad, scheduler and caller state come back equal, dtype
    included; a save before the optimizer's first step leaves it without state."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    early = trt.DCPRecorder().save(tmp_path / "step-0", model, opt, sched, Counter(0, torch.zeros(1)))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    model(torch.randn(5, 3, dtype=torch.bfloat16)).sum().backward()
    first = trt.DCPRecorder().save(tmp_path / "step-1", model, opt, sched, Counter(1, torch.zeros(1)))
    assert not opt.state and all(p.grad is not None for p in model.parameters())
    pending = [p.grad.clone() for p in model.parameters()]
    opt.step()
    sched.step()
    model(torch.randn(5, 3, dtype=torch.bfloat16)).sum().backward()  # pending
    state = Counter(4, torch.arange(3, dtype=torch.bfloat16))
    path = trt.DCPRecorder().save(tmp_path / "step-4", model, opt, sched, state)
    assert path == tmp_path / "step-4"
    with pytest.raises(trainrec.RecorderError, match="never replaced"):
        trt.DCPRecorder().save(path, model, opt, sched, state)

    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    back = trt.DCPRecorder().load(path, model2, opt2, sched2, state_type=Counter)
    assert back.state.micro == 4 and back.saved_world_size == 1
    assert back.state.half.dtype == torch.bfloat16 and torch.equal(back.state.half, state.half)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q) and torch.equal(p.grad, q.grad)
        assert _same(opt.state[p], opt2.state[q])
    assert sched2.state_dict() == sched.state_dict()

    # async: the state is staged when save returns; training may change it meanwhile
    future = trt.DCPRecorder().save(tmp_path / "step-5", model, opt, sched, state, async_save=True)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    assert future.result() == tmp_path / "step-5"
    trt.DCPRecorder().load(tmp_path / "step-5", model2, opt2, sched2, state_type=Counter)
    assert all(torch.equal(a, b) for a, b in zip(saved, model2.parameters()))

    torch.manual_seed(2)
    model3 = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    opt3 = torch.optim.AdamW(model3.parameters(), lr=1e-2)
    trt.DCPRecorder().load(early, model3, opt3, torch.optim.lr_scheduler.StepLR(opt3, 1, gamma=0.5))
    assert not opt3.state and all(p.grad is None for p in model3.parameters())
    # mid first window, before the first step: the pending gradients, no optimizer state,
    # and the step taken from there is the one the run took
    model4 = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    opt4 = torch.optim.AdamW(model4.parameters(), lr=1e-2)
    trt.DCPRecorder().load(first, model4, opt4, torch.optim.lr_scheduler.StepLR(opt4, 1, gamma=0.5))
    assert not opt4.state
    assert all(torch.equal(g, p.grad) for g, p in zip(pending, model4.parameters()))
    opt4.step()
    assert all(torch.equal(a, b) for a, b in zip(saved, model4.parameters()))
    # the parameters saved at step 0 (seed 0), not model3's own (seed 2)
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(model3.parameters(), first.parameters()))


def test_a_damaged_shard_file_is_refused_and_the_live_objects_stay(saved):
    shard = saved / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    model, opt = _plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptRecordError, match=r"__1_0\.distcp holds \d+ bytes, DCP's \.metadata points"):
        trt.DCPRecorder().load(saved, model, opt, _sched(opt), rank_state="drop")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_the_2_rank_sharded_checkpoint_loads_into_one_plain_process_unchanged(runs, saved):
    """2 -> 1: DCP gathers the shards into whole tensors of a model that is not sharded."""
    model, opt = _plain()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    back = trt.DCPRecorder().load(saved, model, opt, sched, rank_state=0)
    assert back.state["micro"] == A and back.saved_world_size == 2
    at = _load(runs / f"at2-{A}-0.pt")
    params = dict(model.named_parameters())
    assert _same(at["params"], {n: p.detach() for n, p in params.items()})
    assert _same(at["grads"], {n: p.grad for n, p in params.items()})
    assert _same(at["optim"], {n: opt.state[p] for n, p in params.items()})
    assert sched.get_last_lr() == at["lr"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_dcp_write_commits_nothing_and_leaves_no_temp_directory(tmp_path, monkeypatch, async_save):
    """DCP reports a failed write as a CheckpointException, a BaseException: it is caught,
    told to every rank and raised as a RecorderError, and the temp directory goes."""
    from torch import nn
    from torch.distributed.checkpoint import FileSystemWriter

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters())
    monkeypatch.setattr(FileSystemWriter, "write_data", refuse)
    with pytest.raises(trainrec.RecorderError, match="No space left on device"):
        out = trt.DCPRecorder().save(tmp_path / "step-1", model, opt, async_save=async_save)
        out.result()
    assert os.listdir(tmp_path) == []


def _two_groups():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[0].bias]},
                             {"params": [model[2].weight, model[2].bias], "lr": 1e-4}], lr=1e-2)
    return model, opt


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            repr(opt.state_dict()))


def _unchanged(before, model, opt):
    params, grads, optim = before
    return (all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            and all((g is None) == (p.grad is None) and (g is None or torch.equal(g, p.grad))
                    for g, p in zip(grads, model.parameters()))
            and optim == repr(opt.state_dict()))


@pytest.fixture
def one_rank(tmp_path):
    """A one-process checkpoint mid window (pending .grad, optimizer state, two param groups)
    and another save's, for swapping parts in."""
    torch.manual_seed(0)
    model, opt = _two_groups()
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model(torch.randn(3, 4)).sum().backward()
    path = trt.DCPRecorder().save(tmp_path / "step-3", model, opt)
    other = trt.DCPRecorder().save(tmp_path / "step-4", model, opt)
    return path, other


_EDITED = "manifest was edited, or the dcp/ directory"


@pytest.mark.parametrize(("damage", "match"), [
    (lambda p, o: _edit_manifest(p, grads=[]), _EDITED),  # the pending gradients would be dropped
    (lambda p, o: _edit_manifest(p, grads=["0.weight"]), _EDITED),
    (lambda p, o: _edit_manifest(p, optimizer_state=False), _EDITED),  # the optimizer state cleared
    # another save's dcp/: named as such (it was "__0_0.distcp is damaged": the disk blamed)
    (lambda p, o: (shutil.rmtree(p / "dcp"), shutil.copytree(o / "dcp", p / "dcp")),
     r"the dcp/ folder is another save's: its \.metadata was written by save"),
    # ... and with that save's shard checksums too
    (lambda p, o: (shutil.rmtree(p / "dcp"), shutil.copytree(o / "dcp", p / "dcp"),
                   _edit_manifest(p, shards=json.loads((o / "manifest.json").read_text())["shards"])),
     r"the dcp/ folder is another save's"),
    # ... and its .metadata's checksum: the facts repeated inside DCP's files differ
    (lambda p, o: (shutil.rmtree(p / "dcp"), shutil.copytree(o / "dcp", p / "dcp"),
                   _edit_manifest(p, **{k: json.loads((o / "manifest.json").read_text())[k]
                                        for k in ("shards", "metadata")})),
     r"DCP's \.metadata names save '[0-9a-f]+', manifest\.json save"),
])
def test_a_manifest_that_disagrees_with_its_dcp_checkpoint_is_refused(one_rank, damage, match):
    """The manifest's facts are repeated inside DCP's files: an edited manifest, or the dcp/
    directory of another save, is refused (both loaded silently before)."""
    path, other = one_rank
    damage(path, other)
    torch.manual_seed(1)
    model, opt = _two_groups()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    before = _snapshot(model, opt)
    with pytest.raises(CorruptRecordError, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)


def test_a_ddp_checkpoint_given_to_dcp_recorder_says_which_recorder_reads_it(one_rank):
    path, _ = one_rank
    _edit_manifest(path, format="trainrec.distributed")
    model, opt = _two_groups()
    with pytest.raises(CorruptRecordError, match=r"a DistributedRecorder checkpoint .*"
                       r"TrainingRecord.load\(trainrec.adapters.torch.DistributedRecorder\(\)"):
        trt.DCPRecorder().load(path, model, opt)


def test_other_param_groups_or_another_model_s_optimizer_are_refused(one_rank, tmp_path):
    """One param group where the run had two took group 0's lr for every parameter, without
    a word; an optimizer of another model was a KeyError 0 from get_state_dict."""
    from torch import nn

    path, _ = one_rank
    model, _ = _two_groups()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    before = _snapshot(model, opt)
    with pytest.raises(RecordMismatchError, match="param groups differ"):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt) and opt.param_groups[0]["lr"] == 5e-2
    stranger = torch.optim.AdamW(nn.Linear(4, 8).parameters())
    with pytest.raises(TypeError, match="not in the model: build the optimizer from"):
        trt.DCPRecorder().load(path, model, stranger)
    with pytest.raises(TypeError, match="not in the model: build the optimizer from"):
        trt.DCPRecorder().save(tmp_path / "x", model, stranger)
    assert not (tmp_path / "x").exists()


def test_trainrec_verify_reads_a_dcp_checkpoint_and_refuses_a_truncated_shard(one_rank):
    """The directory was 'not a record file'; now the trainrec.dcp format shows DCP's entries
    and the parts, and a shard file shorter than DCP's .metadata says is refused."""
    path, _ = one_rank
    header, item = trainrec.read_file(path)
    assert (header.format, header.record_type) == ("trainrec.dcp", "TrainingRecord")
    assert item["dcp"]["model.0.weight"] == "float32[8, 4]"
    assert item["manifest"]["grads"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    shard = path / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CorruptRecordError, match=r"__0_0\.distcp holds \d+ bytes, DCP's \.metadata points to"):
        trainrec.read_file(path)


def test_a_model_of_other_shapes_is_refused_naming_the_parameter(one_rank):
    """It was DCP's CheckpointException, a traceback per rank naming no parameter."""
    from torch import nn

    path, _ = one_rank
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[0].bias]},
                             {"params": [model[2].weight, model[2].bias]}])
    before = _snapshot(model, opt)
    with pytest.raises(RecordMismatchError, match=r"model\.2\.weight is float32\[2, 8\] in the "
                       r"checkpoint, float32\[3, 8\] in the live model"):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)


def test_a_saved_scheduler_with_none_given_is_refused(tmp_path):
    """The scheduler's state was dropped without a word (single-process restore refuses it)."""
    model, opt = _two_groups()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    path = trt.DCPRecorder().save(tmp_path / "step", model, opt, sched)
    model2, opt2 = _two_groups()
    before = _snapshot(model2, opt2)
    with pytest.raises(RecordMismatchError, match=r"holds the state of an LR scheduler \(torch.optim.lr_scheduler.StepLR\) but scheduler=None was given.*initial_lr"):
        trt.DCPRecorder().load(path, model2, opt2)
    assert _unchanged(before, model2, opt2)


def test_plain_pending_gradients_at_more_than_one_rank_are_refused(tmp_path, monkeypatch):
    """A DDP model's pending .grad (each rank's own inside no_sync) is a plain tensor, which
    DCP wrote once for all ranks: 2 DDP ranks each got another's gradients back, silently
    (checked by hand with 2 gloo ranks). Refused before the ranks meet, so 2 ranks are faked."""
    import trainrec.adapters.torch.dcp as dcp_mod

    model, opt = _two_groups()
    model(torch.randn(3, 4)).sum().backward()
    monkeypatch.setattr(dcp_mod, "_rank_world", lambda group: (0, 2))
    with pytest.raises(trainrec.RecorderError, match="plain tensor, not a sharded DTensor.*"
                       "DistributedRecorder"):
        trt.DCPRecorder().save(tmp_path / "step", model, opt)
    assert not (tmp_path / "step").exists() and os.listdir(tmp_path) == []


def test_a_changed_byte_is_refused_by_load_and_verify_and_the_live_objects_stay(one_rank):
    """DCP keeps no checksums: one flipped byte inside a tensor loaded as another value."""
    from torch.distributed.checkpoint import FileSystemReader

    path, _ = one_rank
    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    where = next(info for index, info in meta.storage_data.items() if index.fqn == "model.2.weight")
    shard = path / "dcp" / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset + where.length - 40] ^= 0x10  # in the tensor's bytes, near the blob's end
    shard.write_bytes(bytes(data))
    torch.manual_seed(1)
    model, opt = _two_groups()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model(torch.randn(3, 4)).sum().backward()
    before = _snapshot(model, opt)
    damaged = r"__0_0\.distcp is damaged: the \d+ bytes at offset \d+ have CRC-32"
    with pytest.raises(CorruptRecordError, match=damaged):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    with pytest.raises(CorruptRecordError, match=damaged):
        trainrec.read_file(path)  # trainrec verify / inspect


class _Marker:
    """Unpickling it opens (creates) a file: what a hostile checkpoint's code could do."""

    def __init__(self, file: Path) -> None:
        self.file = str(file)

    def __reduce__(self):
        return (open, (self.file, "w"))


def test_a_hostile_dcp_metadata_is_refused_without_unpickling_it(one_rank, tmp_path):
    """DCP unpickles .metadata with pickle.load: any code in it ran, in load and verify."""
    import pickle

    path, _ = one_rank
    marker = tmp_path / "ran"
    _write_metadata(path, pickle.dumps(_Marker(marker)))
    model, opt = _two_groups()
    before = _snapshot(model, opt)
    with pytest.raises(CorruptRecordError, match=r"\.metadata names io\.open, which DCP's "
                       r"metadata never holds: refused without unpickling it"):
        trt.DCPRecorder().load(path, model, opt)
    with pytest.raises(CorruptRecordError, match=r"names io\.open"):
        trainrec.read_file(path)
    assert not marker.exists() and _unchanged(before, model, opt)
    _write_metadata(path, pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CorruptRecordError, match="does not hold a DCP Metadata"):
        trainrec.read_file(path)


def test_a_hostile_non_tensor_entry_is_refused_without_running_it(tmp_path, monkeypatch):
    """DCP unpickles its non-tensor entries with torch.load(weights_only=False). A save whose
    entry holds an object that runs code when unpickled (its checksums right: written by
    the save itself) is refused, and the code does not run."""
    import trainrec.adapters.torch.dcp as dcp_mod

    marker = tmp_path / "ran"
    real = dcp_mod.dcp_save
    monkeypatch.setattr(dcp_mod, "dcp_save", lambda tree, **kw: real({**tree, "trainrec": _Marker(marker)}, **kw))
    model, opt = _two_groups()
    path = trt.DCPRecorder().save(tmp_path / "step", model, opt)
    monkeypatch.undo()
    import torch.distributed.checkpoint as dcp

    dcp.load({"trainrec": ""}, checkpoint_id=path / "dcp")  # a plain DCP load runs it
    assert marker.exists()
    marker.unlink()
    model2, opt2 = _two_groups()
    before = _snapshot(model2, opt2)
    with pytest.raises(CorruptRecordError, match="the DCP entry 'trainrec' holds something other "
                       "than plain values, refused unread"):
        trt.DCPRecorder().load(path, model2, opt2)
    assert not marker.exists() and _unchanged(before, model2, opt2)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: s.update(shards="x"), "malformed shards"),
    (lambda s: s["shards"][0]["__0_0.distcp"].update(size=1), r"holds \d+ bytes, the save wrote 1"),
    (lambda s: s["shards"][0].pop("__0_0.distcp"), r"__0_0\.distcp has no checksum in manifest\.json"),
    (lambda s: s["shards"][0].update({"__9_0.distcp": {"size": 1, "items": []}}),
     r"lists shard file __9_0\.distcp, which DCP's \.metadata does not name"),
    (lambda s: s["shards"][0]["__0_0.distcp"]["items"].pop(), "an entry the save did not write"),
])
def test_edited_shard_checksums_are_refused(one_rank, edit, match):
    path, _ = one_rank
    doc = json.loads((path / "manifest.json").read_text())
    edit(doc)
    (path / "manifest.json").write_text(json.dumps(doc))
    model, opt = _two_groups()
    before = _snapshot(model, opt)
    with pytest.raises(CorruptRecordError, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)


def test_verify_false_skips_the_tensor_checksums_only(one_rank, tmp_path, monkeypatch):
    """verify=False trusts the tensors' bytes as a plain dcp.load does (a changed byte in a
    tensor loads as a wrong value: the documented price), but still checks the non-tensor
    entries' checksums and everything else before the live objects change."""
    from torch.distributed.checkpoint import FileSystemReader

    path, _ = one_rank
    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    where = {index.fqn: info for index, info in meta.storage_data.items()}
    shard = path / "dcp" / where["model.2.weight"].relative_path
    data = bytearray(shard.read_bytes())
    weight = where["model.2.weight"]
    data[weight.offset + weight.length - 40] ^= 0x10
    shard.write_bytes(bytes(data))
    model, opt = _two_groups()
    with pytest.raises(TypeError, match="verify must be True or False"):
        trt.DCPRecorder().load(path, model, opt, verify=1)
    trt.DCPRecorder().load(path, model, opt, verify=False)  # loads: the tensor is not checked
    assert opt.state and all(p.grad is not None for p in model.parameters())
    # a tensor entry whose bytes no longer unpickle fails only in DCP's read, after other
    # live tensors changed: the error says so, and that verify=True refuses it first
    bad = bytearray(data)
    bad[weight.offset + 2] ^= 0xFF  # inside its zip's first header
    shard.write_bytes(bytes(bad))
    with pytest.raises(trainrec.RecorderError, match=r"With verify=False their bytes are not "
                       r"checked before the read.*were rolled back\. Load with verify=True"):
        trt.DCPRecorder().load(path, *_two_groups(), verify=False)
    shard.write_bytes(bytes(data))
    # a non-tensor entry changed (the trainrec facts): refused even so, before any change
    trainrec_entry = where["trainrec"]
    data[trainrec_entry.offset + trainrec_entry.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    model2, opt2 = _two_groups()
    before = _snapshot(model2, opt2)
    with pytest.raises(CorruptRecordError, match=r"is damaged: the \d+ bytes at offset "
                       f"{trainrec_entry.offset} have CRC-32"):
        trt.DCPRecorder().load(path, model2, opt2, verify=False)
    assert _unchanged(before, model2, opt2)


def test_a_load_right_after_an_async_save_waits_for_its_commit(one_rank, tmp_path):
    """load did not wait for the recorder's pending async save (save did): loading the
    checkpoint just saved was a FileMissingError, and with several ranks the load's
    collectives ran on the group beside the commit's, in its background thread."""
    path, _ = one_rank
    model, opt = _two_groups()
    trt.DCPRecorder().load(path, model, opt)
    rec = trt.DCPRecorder()
    future = rec.save(tmp_path / "async", model, opt, async_save=True)
    torch.manual_seed(5)
    model2, opt2 = _two_groups()
    rec.load(tmp_path / "async", model2, opt2)
    assert future.done() and future.result() == tmp_path / "async"
    assert all(torch.equal(a, b) and torch.equal(a.grad, b.grad)
               for a, b in zip(model.parameters(), model2.parameters()))
    assert repr(opt.state_dict()) == repr(opt2.state_dict())


@pytest.mark.parametrize("change", [{"length": "float"}, {"offset": "float"}, {"offset": -5}])
def test_a_dcp_metadata_entry_whose_place_is_not_byte_counts_is_refused(one_rank, change):
    """A .metadata whose entry had length 1705.0 (the entry's checksum looked up by int())
    passed every check, then DCP's read failed after the live tensors began to change."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path, _ = one_rank
    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    index, info = next((i, w) for i, w in meta.storage_data.items() if i.fqn == "model.2.weight")
    fields = {k: (float(getattr(info, k)) if v == "float" else v) for k, v in change.items()}
    meta.storage_data[index] = _StorageInfo(**{**info.__dict__, **fields})
    _write_metadata(path, pickle.dumps(meta))
    torch.manual_seed(1)
    model, opt = _two_groups()
    model(torch.randn(3, 4)).sum().backward()
    before = _snapshot(model, opt)
    with pytest.raises(CorruptRecordError, match=r"gives the entry in shard file '__0_0\.distcp' "
                       r"offset .* not byte counts"):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    with pytest.raises(CorruptRecordError, match="not byte counts"):
        trainrec.read_file(path)


def _rewrite_entry(path: Path, fqn: str, value) -> None:
    """Replace the DCP entry `fqn` of a one-rank checkpoint by `value` (a plain value that
    torch.load(weights_only=True) reads), its checksum in the manifest too: a hand-made file."""
    import io
    import pickle
    import zlib

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    index, info = next((i, w) for i, w in meta.storage_data.items() if i.fqn == fqn)
    blob = io.BytesIO()
    torch.save(value, blob)
    shard = path / "dcp" / info.relative_path
    data = shard.read_bytes()
    shard.write_bytes(data + blob.getvalue())
    meta.storage_data[index] = _StorageInfo(info.relative_path, len(data), len(blob.getvalue()))
    _write_metadata(path, pickle.dumps(meta))
    doc = json.loads((path / "manifest.json").read_text())
    entry = doc["shards"][0][info.relative_path]
    entry["size"] = len(data) + len(blob.getvalue())
    entry["items"] = [i for i in entry["items"] if i[:2] != [info.offset, info.length]]
    entry["items"].append([len(data), len(blob.getvalue()), zlib.crc32(blob.getvalue())])
    (path / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("fqn", "value", "match"), [
    ("optim.param_groups.0.lr", "abc", r"param_groups\.0\.lr: str 'abc' in the record, number live"),
    ("optim.param_groups.0.betas", (0.9,), r"param_groups\.0\.betas"),
    # the groups' params swapped: each group's lr went to the other group's parameters
    ("optim.param_groups.0.params", ["2.weight", "2.bias"], r"param_groups\.0\.params: \['2\.weight'"),
])
def test_a_param_group_entry_that_does_not_fit_the_live_optimizer_is_refused(one_rank, fqn, value, match):
    """DCP's param group entries went into the optimizer as they were: a hand-made file
    (checksums right) set lr to 'abc' (the next step failed), or swapped two groups' lr
    (the check compared the 'trainrec' entry's copy of the groups, not the ones loaded)."""
    path, _ = one_rank
    _rewrite_entry(path, fqn, value)
    torch.manual_seed(1)
    model, opt = _two_groups()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    before = _snapshot(model, opt)
    with pytest.raises(RecordMismatchError, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    trainrec.read_file(path)  # the bytes are the ones the manifest has the checksums of


def _unblock_later(fifo: Path, seconds: float = 10.0) -> None:
    """Open `fifo` for writing after `seconds` (and close it): a reader blocked on it then
    reads nothing, so a regression fails the test instead of hanging it."""
    import threading
    import time

    def writer() -> None:
        time.sleep(seconds)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader waits: nothing to unblock
            return
        os.close(fd)

    threading.Thread(target=writer, daemon=True).start()


@pytest.mark.parametrize("kind", ["fifo", "directory", "deep"])
def test_a_manifest_that_is_no_regular_file_or_nested_too_deep_is_refused(one_rank, kind):
    """manifest.json as a FIFO hung load and `trainrec verify` (both opened it, waiting for a
    writer); nested JSON 100000 deep was a raw RecursionError."""
    path, _ = one_rank
    manifest = path / "manifest.json"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
        _unblock_later(manifest)
    elif kind == "directory":
        manifest.mkdir()
    else:
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    model, opt = _two_groups()
    before = _snapshot(model, opt)
    match = ("manifest.json holds more containers than a manifest does" if kind == "deep"
             else "manifest.json is not a regular file")
    with pytest.raises(CorruptRecordError, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    # trainrec verify / inspect: a FIFO is named as one (never opened), else the folder is no record file
    found = "manifest.json is a FIFO" if kind == "fifo" else "a directory, not a record file"
    with pytest.raises(trainrec.RecorderError, match=found):
        trainrec.read_file(path)


@pytest.mark.parametrize(("chunks", "match"), [
    (lambda c: [], r"chunks of model\.0\.weight do not cover its shape \[8, 4\] once \(0 elements"),
    (lambda c: c + c, r"do not cover its shape \[8, 4\] once \(64 elements in 2 non-empty "
                      r"chunk\(s\): two at one place, overlapping"),
    (lambda c: [type(c[0])(offsets=torch.Size([4, 0]), sizes=c[0].sizes)],
     r"gives model\.0\.weight a chunk at \[4, 0\] of \[8, 4\], outside its shape"),
])
def test_dcp_metadata_chunks_that_do_not_tile_a_tensor_are_refused(one_rank, chunks, match):
    """.metadata has no checksum: with model.0.weight's chunk list emptied, DCP read nothing
    into it and the load kept its live value beside everything else restored, without a
    word; a chunk moved was a raw KeyError."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    path, _ = one_rank
    meta = FileSystemReader(str(path / "dcp")).read_metadata()
    entry = meta.state_dict_metadata["model.0.weight"]
    entry.chunks = chunks(entry.chunks)
    _write_metadata(path, pickle.dumps(meta))
    torch.manual_seed(1)
    model, opt = _two_groups()
    before = _snapshot(model, opt)
    with pytest.raises(CorruptRecordError, match=match):
        trt.DCPRecorder().load(path, model, opt)
    assert _unchanged(before, model, opt)
    with pytest.raises(CorruptRecordError, match=match):
        trainrec.read_file(path)
