"""DDP with gradient accumulation: `DistributedRecorder` keeps every rank's pending
gradients and state, a mid-window checkpoint resumes bitwise in fresh processes, another
world size is refused, and one checkpoint is one commit (a rank killed mid-save leaves the
previous checkpoint loadable and the partial one invisible).

The 2-rank runs (tests/ddp_run.py: gloo on CPU, spawned processes) go in two phases: the
uninterrupted run, which checkpoints twice on the way and ends with the killed save, then
the two resumes one after the other in one fresh process per rank (each into objects built
anew). Each phase is bounded in time; each fixture's phases run once for all of pytest-xdist's
workers (`_shared_runs.once`). Everything else runs in this process as a world of one rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from _shared_runs import once  # noqa: E402
from same_items import same  # noqa: E402
from timeout_outcomes import assert_timed_out, outcome  # noqa: E402 - next to this file
from torch import nn  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import (  # noqa: E402
    CorruptRecordError,
    FileMissingError,
    GradientsAccumulator,
    HalfPrecisionSettings,
    NamedMpkFileRecorder,
    RecorderError,
    RecordMismatchError,
    TrainingRecord,
)

RUN = Path(__file__).with_name("ddp_run.py")
PHASE_TIMEOUT_S = 120
A, B, STEPS = 4, 8, 12  # as in ddp_run.py


def _phase(out: Path, modes: list[str], world: int = 2, device: str = "cpu") -> None:
    procs = []
    for mode in modes:
        store = out / f"store-{mode.replace(':', '-')}"
        for rank in range(world):
            procs.append((mode, rank, subprocess.Popen(
                [sys.executable, str(RUN), mode, str(rank), str(world), str(store), str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "DDP_RUN_DEVICE": device})))
    failures = []
    for mode, rank, p in procs:
        try:
            text, _ = p.communicate(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for *_, q in procs:
                q.kill()
            pytest.fail(f"the 2-rank run {mode!r} did not finish in {PHASE_TIMEOUT_S} s")
        killed = mode == "checkpoint" and rank == 1 and world > 1
        if p.returncode != (-9 if killed else 0):
            failures.append(f"{mode} rank {rank} exited {p.returncode}:\n{text[-3000:]}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")

    def run(out: Path) -> Path:
        (out / "ckpt").mkdir()
        _phase(out, ["checkpoint"])
        _phase(out, [f"resume:{A},{B}"])
        return out

    return once(tmp_path_factory, "ddp-runs", run)


def _item(path: Path):
    return trainrec.read_file(path)[1]


@pytest.mark.parametrize("step", [A, B])
def test_a_mid_window_checkpoint_resumes_bitwise_on_every_rank(runs, step):
    for rank in range(2):
        uninterrupted = _item(runs / f"final-{rank}.mpk")
        resumed = _item(runs / f"resumed-{step}-{rank}.mpk")
        assert same(uninterrupted, resumed), f"rank {rank}, resumed from micro-step {step}"
    # the ranks' records differ (their RNG, their BatchNorm statistics): each rank's own
    # state was needed, not one copy of rank 0's
    assert not same(_item(runs / "final-0.mpk"), _item(runs / "final-1.mpk"))


def test_each_rank_keeps_its_own_pending_gradients(runs):
    rec = trt.DistributedRecorder()
    # micro-step 4: one gradient of an accumulator window pending
    r0, r1 = (TrainingRecord.load(rec, runs / "ckpt" / f"step-{A:08d}", rank=r) for r in range(2))
    g0, g1 = r0.grads.grads, r1.grads.grads
    assert set(g0) == set(g1) == {"0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"}
    assert not np.array_equal(g0["0.weight"].array, g1["0.weight"].array)
    assert r0.model.item["grads"] == {} and r1.model.item["grads"] == {}
    # micro-step 8: two gradients pending natively in .grad under no_sync()
    r0, r1 = (TrainingRecord.load(rec, runs / "ckpt" / f"step-{B:08d}", rank=r) for r in range(2))
    assert not r0.grads.grads and not r1.grads.grads
    m0, m1 = r0.model.item["grads"], r1.model.item["grads"]
    assert len(m0) == len(m1) == 6
    assert not np.array_equal(m0["4.weight"].array, m1["4.weight"].array)
    # rank 1's BatchNorm statistics differ from rank 0's: kept as its overrides
    t0, t1 = r0.model.item["tensors"], r1.model.item["tensors"]
    assert not np.array_equal(t0["1.running_mean"].array, t1["1.running_mean"].array)
    assert np.array_equal(t0["0.weight"].array, t1["0.weight"].array)  # replicated
    manifest = (runs / "ckpt" / f"step-{B:08d}" / "manifest.json").read_text()
    assert '"overrides": [\n  0,\n  2\n ]' in manifest


def test_a_different_world_size_is_refused(runs):
    assert not dist.is_initialized()  # this process is a world of one rank
    with pytest.raises(RecordMismatchError, match=r"saved by 2 rank\(s\), this run has 1.*resume with 2"):
        TrainingRecord.load(trt.DistributedRecorder(), runs / "ckpt" / f"step-{A:08d}")
    with pytest.raises(RecordMismatchError, match=r"rank must be in \[0, 2\).*got 2"):
        TrainingRecord.load(trt.DistributedRecorder(), runs / "ckpt" / f"step-{A:08d}", rank=2)
    with pytest.raises(TypeError, match="rank must be an int, got bool"):
        TrainingRecord.load(trt.DistributedRecorder(), runs / "ckpt" / f"step-{A:08d}", rank=True)


def test_a_part_one_rank_cannot_read_fails_the_load_on_every_rank(runs):
    """Loads are collective: rank 0's part is intact, yet it raises too, naming rank 1, so
    it never restores and then waits at its next all-reduce for a rank that failed."""
    import json
    import shutil

    damaged = runs / "damaged"
    shutil.copytree(runs / "ckpt" / f"step-{B:08d}", damaged)
    part = damaged / json.loads((damaged / "manifest.json").read_text())["parts"][1]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    _phase(runs, ["load-damaged"])
    got = [(runs / f"load-damaged-{r}.txt").read_text() for r in (0, 1)]
    assert got[1].startswith("CorruptRecordError"), got[1]
    assert got[0].startswith("RecorderError: rank 1 could not load its part"), got[0]


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_loadable(runs):
    error = (runs / "kill-error.txt").read_text()
    assert error.startswith("RecorderError: the ranks could not meet") and "nothing was committed" in error
    ckpt = runs / "ckpt"
    assert not (ckpt / f"step-{STEPS:08d}").exists()
    assert sorted(os.listdir(ckpt)) == [f"step-{A:08d}", f"step-{B:08d}"]  # rank 0 removed the rest
    # the previous checkpoint loads on each rank (and the resume from it was bitwise, above)
    for rank in range(2):
        TrainingRecord.load(trt.DistributedRecorder(), ckpt / f"step-{B:08d}", rank=rank)


@pytest.fixture(scope="module")
def timeout_runs(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")

    def run(out: Path) -> Path:
        (out / "timeout").mkdir()
        _phase(out, ["timeout"])
        return out

    return once(tmp_path_factory, "ddp-timeout-runs", run)


def test_with_a_timeout_every_rank_saves_and_loads_back_as_before(timeout_runs):
    import json

    for rank in range(2):
        assert outcome(timeout_runs, "save", rank)["error"] is None
        assert outcome(timeout_runs, "reload", rank)["error"] is None
        saved, loaded = (_item(timeout_runs / f"timeout-{w}-{rank}.mpk") for w in ("saved", "loaded"))
        assert same(saved, loaded), rank
    # the store keeps no meeting but the last: each goes once the next one succeeded
    keys = [json.loads((timeout_runs / f"timeout-keys-{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert not any(v for k, v in keys[r].items() if k.startswith("0/")), keys
        assert all(keys[r][f"1/DistributedRecorder.load/{k}"] for k in ("outcome", "arrived", f"rank/{r}")), keys


@pytest.mark.parametrize(("case", "rank", "missing", "what"), [
    ("only0", 0, 1, "save"), ("only1", 1, 0, "save"), ("load1", 1, 0, "load")])
def test_a_save_or_load_called_on_one_rank_fails_within_the_timeout(timeout_runs, case, rank, missing, what):
    """Rank `rank` alone calls it (rank 0 under `if rank == 0:`, say): with timeout=2 it
    raises in seconds, not at the group's timeout, naming the rank that did not join,
    having written (no temp directory) and loaded nothing."""
    got = outcome(timeout_runs, case, rank)
    assert_timed_out(got, missing, f"DistributedRecorder.{what}")
    if what == "load":  # the check can fail: a load on every rank changes the live model
        assert not outcome(timeout_runs, "reload", rank)["unchanged"]
    assert not (timeout_runs / f"timeout-{case}-{missing}.json").exists()  # it never called
    ckpt = timeout_runs / "timeout"
    assert os.listdir(ckpt) == ["step-1"]  # no step-2 or step-3, no temp directory
    for r in range(2):  # the earlier checkpoint is intact
        TrainingRecord.load(trt.DistributedRecorder(), ckpt / "step-1", rank=r)


def test_a_save_over_a_checkpoint_is_refused_on_every_rank_naming_it_once(timeout_runs):
    """Rank 0 finds step-1 there and refuses to start; rank 1 gets its reason, the
    directory named once (it was named twice), and neither changed anything."""
    mine, theirs = (outcome(timeout_runs, "again", r) for r in (0, 1))
    path = timeout_runs / "timeout" / "step-1"
    assert mine["message"] == ("a distributed checkpoint is a directory and is never replaced: "
                               f"save under a new path (a new step) (file {path})"), mine
    assert theirs["message"] == f"rank 0 could not start the save: RecorderError: {mine['message']}"
    assert mine["unchanged"] and theirs["unchanged"]


def test_a_rank_that_comes_after_the_others_gave_up_fails_at_once(timeout_runs):
    got = outcome(timeout_runs, "late0", 0)
    assert got["error"] == "RecorderError" and got["seconds"] < 1, got
    assert got["message"].startswith("this rank (rank 0) joined DistributedRecorder.save more "
                                     "than 2 s after the rank(s) waiting for it, which gave up"), got


class _FakeRank:
    """One rank of a group of `world`, for `meet` in threads of this process: its own group
    name (the process's meeting count is per name) over one shared store."""

    def __init__(self, store, rank: int, world: int, tag: str) -> None:
        self.store, self.rank, self.world, self.group_name = store, rank, world, f"{tag}-{rank}"

    def get_group_store(self):
        return self.store


def _meet_in_threads(monkeypatch, ranks, world: int, store=None, timeout: float = 0.3):
    """Run `meet` on `ranks` (of `world`) at once, in threads: {rank: None or the error}."""
    import threading
    import uuid

    from trainrec.adapters.torch import distributed_collectives

    monkeypatch.setattr(distributed_collectives, "_rank_world", lambda g: (g.rank, g.world))
    store = dist.HashStore() if store is None else store
    tag = uuid.uuid4().hex
    got: dict = {}
    start = threading.Barrier(len(ranks))

    def one(rank: int) -> None:
        start.wait(10)
        try:
            distributed_collectives.meet(_FakeRank(store, rank, world, tag), timeout, "DCPRecorder.save", Path("ck"))
            got[rank] = None
        except RecorderError as e:
            got[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == len(ranks), "a meeting did not end"
    return got


def test_the_ranks_that_came_all_name_every_rank_that_did_not(monkeypatch):
    """3 ranks, rank 1 missing: rank 0 and rank 2 both raise naming rank 1 (whichever
    timed out first decided, the other read its outcome); all 3 meet fine."""
    got = _meet_in_threads(monkeypatch, [0, 2], 3)
    for rank in (0, 2):
        assert str(got[rank]).startswith("rank(s) 1 of the process group did not join "
                                         "DCPRecorder.save within 0.3 s"), got
    got = _meet_in_threads(monkeypatch, [0, 2], 4)
    assert all(str(e).startswith("rank(s) 1, 3 of the process group") for e in got.values()), got
    assert _meet_in_threads(monkeypatch, [0, 1, 2], 3, timeout=5) == {0: None, 1: None, 2: None}


def test_a_store_that_fails_is_a_recorder_error(monkeypatch):
    class Gone:
        def set(self, *args):
            raise RuntimeError("Connection reset by peer")

    got = _meet_in_threads(monkeypatch, [0], 2, Gone())
    assert isinstance(got[0], RecorderError)
    assert "could not meet before DCPRecorder.save in the process group's store: Connection reset" in str(got[0])


@pytest.mark.parametrize(("timeout", "error", "match"), [
    (-1, ValueError, "positive and finite, got -1"),
    (0, ValueError, "positive and finite"),
    (float("nan"), ValueError, "positive and finite, got nan"),
    (float("inf"), ValueError, "positive and finite"),
    (__import__("datetime").timedelta(0), ValueError, "positive and finite"),
    (True, TypeError, "got bool"),
    ("2", TypeError, "seconds or a datetime.timedelta.*got str"),
])
@pytest.mark.parametrize("recorder", ["DistributedRecorder", "DCPRecorder"])
def test_a_bad_timeout_is_refused(recorder, timeout, error, match):
    with pytest.raises(error, match=match):
        getattr(trt, recorder)(timeout=timeout)


def test_a_timeout_is_seconds_or_a_timedelta_and_one_rank_needs_no_meeting(tmp_path):
    import datetime

    assert trt.DistributedRecorder(timeout=datetime.timedelta(minutes=1)).timeout == 60.0
    assert trt.DCPRecorder(timeout=np.float32(1.5)).timeout == 1.5
    assert trt.DistributedRecorder().timeout is None and repr(trt.DCPRecorder(timeout=2)) == "DCPRecorder(timeout=2)"
    record = TrainingRecord.capture(*_training())
    path = record.save(trt.DistributedRecorder(timeout=0.01), tmp_path / "step-1")
    loaded = TrainingRecord.load(trt.DistributedRecorder(timeout=0.01), path, state_type=State)
    native = trainrec.NativePrecisionSettings()
    assert same(loaded.into_item(native), record.into_item(native))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_ranks_on_gpus_resume_bitwise_from_mid_window(tmp_path):
    """The same runs on NCCL, one GPU per rank (two, or one where there is one): pending
    gradients live on the GPU, the CUDA RNG is each rank's."""
    world = min(2, torch.cuda.device_count())
    (tmp_path / "ckpt").mkdir()
    _phase(tmp_path, ["checkpoint"], world, "cuda")
    _phase(tmp_path, [f"resume:{A},{B}"], world, "cuda")
    for step in (A, B):
        for rank in range(world):
            assert same(_item(tmp_path / f"final-{rank}.mpk"),
                        _item(tmp_path / f"resumed-{step}-{rank}.mpk")), (step, rank)
    part = TrainingRecord.load(trt.DistributedRecorder(), tmp_path / "ckpt" / f"step-{B:08d}", rank=0)
    assert part.model.item["grads"], "the GPU's pending .grad was recorded"


# -- one rank, in this process ---------------------------------------------------------------


@trainrec.record
class State:
    micro: int
    half: torch.Tensor


def _training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    acc = GradientsAccumulator()
    for _ in range(2):
        model(torch.randn(5, 3)).sum().backward()
        acc.accumulate(model, trt.grads_from(model))
    trt.set_grads(model, acc.grads())
    opt.step()
    sched.step()
    model(torch.randn(5, 3)).sum().backward()
    acc.accumulate(model, trt.grads_from(model))  # pending in the accumulator
    model[2].weight.grad = torch.ones(2, 4)  # and natively
    state = State(3, torch.arange(4, dtype=torch.bfloat16))
    return model, opt, sched, acc, state


def test_one_rank_saves_and_loads_back_every_component_dtype_included(tmp_path):
    record = TrainingRecord.capture(*_training())
    out = record.save(trt.DistributedRecorder(), tmp_path / "step-1")
    assert out == tmp_path / "step-1"
    assert sorted(os.listdir(out)) == ["manifest.json", "rank-00000-of-00001.mpk", "replicated.mpk"]
    loaded = TrainingRecord.load(trt.DistributedRecorder(), out, state_type=State)
    native = trainrec.NativePrecisionSettings()
    assert same(loaded.into_item(native), record.into_item(native))
    assert loaded.state.half.dtype == torch.bfloat16
    model, opt, sched, _, _ = _training()
    r = loaded.restore(model, opt, sched, "cpu")
    assert torch.equal(model[2].weight.grad, torch.ones(2, 4))
    assert len(r.accumulator.try_to_record().grads) == 6


def test_another_record_is_each_rank_s_whole_part(tmp_path):
    rng = trainrec.RngRecord.capture(np.random.default_rng(7))
    trt.DistributedRecorder().record(rng, tmp_path / "rng")
    assert sorted(os.listdir(tmp_path / "rng")) == ["manifest.json", "rank-00000-of-00001.mpk"]
    back = trt.DistributedRecorder().load(tmp_path / "rng", None, trainrec.RngRecord)
    assert back == rng


def test_a_checkpoint_is_never_replaced_and_needs_its_folder(tmp_path):
    record = TrainingRecord.capture(*_training())
    path = record.save(trt.DistributedRecorder(), tmp_path / "step-1")
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(RecorderError, match="never replaced"):
        record.save(trt.DistributedRecorder(), path)
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    with pytest.raises(FileMissingError, match="does not exist"):
        record.save(trt.DistributedRecorder(), tmp_path / "missing" / "step-1")
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


def test_a_failed_part_commits_nothing_and_leaves_no_temp_directory(tmp_path):
    model, opt, sched, acc, state = _training()
    with torch.no_grad():
        model[0].weight[0, 0] = 1e-30  # Half precision would flush it to zero
    record = TrainingRecord.capture(model, opt, sched, acc, state)
    with pytest.raises(trainrec.LossyPrecisionError, match=r"key '(grads|model\.state)\."):
        record.save(trt.DistributedRecorder(NamedMpkFileRecorder(HalfPrecisionSettings())),
                    tmp_path / "step-1")
    assert os.listdir(tmp_path) == []


def test_a_commit_that_fails_leaves_neither_the_checkpoint_nor_its_temp_directory(tmp_path, monkeypatch):
    from trainrec.adapters.torch import distributed_commit

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    record = TrainingRecord.capture(*_training())
    monkeypatch.setattr(distributed_commit.os, "rename", refuse)
    with pytest.raises(RecorderError, match="rank 0 could not commit: PermissionError.*nothing was committed"):
        record.save(trt.DistributedRecorder(), tmp_path / "step-1")
    assert os.listdir(tmp_path) == []


def test_misuse_is_refused():
    with pytest.raises(TypeError, match="file recorder"):
        trt.DistributedRecorder(trainrec.NamedMpkBytesRecorder())
    with pytest.raises(ValueError, match="not initialized"):
        trt.DistributedRecorder(group=object()).save_item({}, "x")


def test_an_orphaned_temp_directory_is_swept_and_a_live_one_kept(tmp_path):
    import fcntl

    dead = tmp_path / ".step-1.0123456789ab.trainrec-dist-tmp"
    live = tmp_path / ".step-2.ba9876543210.trainrec-dist-tmp"
    foreign = tmp_path / ".notes.0123456789ab.trainrec-dist-tmp"  # no lock file: not touched
    for d in (dead, live, foreign):
        d.mkdir()
    (dead / ".lock").touch()
    (live / ".lock").touch()
    fd = os.open(live / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        TrainingRecord.capture(*_training()).save(trt.DistributedRecorder(), tmp_path / "step-3")
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, foreign.name, "step-3"])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "step-1"
    return TrainingRecord.capture(*_training()).save(trt.DistributedRecorder(), path)


@pytest.fixture
def saved(pristine, tmp_path):
    import shutil

    return Path(shutil.copytree(pristine, tmp_path / "step-1"))


def _edit_manifest(path: Path, **changes):
    import json

    doc = json.loads((path / "manifest.json").read_text())
    doc.update(changes)
    (path / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("damage", "error", "match"), [
    (lambda p: (p / "manifest.json").unlink(), CorruptRecordError, "holds no manifest.json"),
    (lambda p: (p / "manifest.json").write_text("{"), CorruptRecordError, "unreadable manifest"),
    (lambda p: _edit_manifest(p, format="other"), CorruptRecordError, "not a trainrec.distributed"),
    (lambda p: _edit_manifest(p, version=[2, 0]), trainrec.UnsupportedVersionError, "version 2.0"),
    (lambda p: _edit_manifest(p, world_size=0), CorruptRecordError, "malformed world_size"),
    (lambda p: _edit_manifest(p, parts=["../x.mpk"]), CorruptRecordError, "malformed parts"),
    (lambda p: _edit_manifest(p, save_id="000000000000"), CorruptRecordError, "a part of another save"),
    (lambda p: (p / "rank-00000-of-00001.mpk").unlink(), CorruptRecordError, "part the manifest lists is missing"),
    (lambda p: (p / "replicated.mpk").write_bytes((p / "replicated.mpk").read_bytes()[:-9]),
     CorruptRecordError, r"truncated.*replicated\.mpk"),
    # these three were 'malformed parts', 'a TrainingRecord item is a list of 5' (no file
    # named) and 'not a trainrec.distributed manifest' (not saying what the directory is)
    (lambda p: _edit_manifest(p, world_size=2), CorruptRecordError,
     r"malformed parts: it lists 1 part\(s\), world_size says 2"),
    (lambda p: _edit_manifest(p, replicated=None), CorruptRecordError,
     "names no replicated part, but this rank's part is one of a TrainingRecord split"),
    (lambda p: _edit_manifest(p, format="trainrec.dcp"), CorruptRecordError,
     r"a DCPRecorder checkpoint .*load it with trainrec.adapters.torch.DCPRecorder\(\).load"),
])
def test_a_damaged_checkpoint_is_refused_clearly(saved, damage, error, match):
    damage(saved)
    with pytest.raises(error, match=match):
        TrainingRecord.load(trt.DistributedRecorder(), saved)


def test_a_missing_checkpoint_is_a_file_missing_error(tmp_path):
    with pytest.raises(FileMissingError, match="no committed DistributedRecorder checkpoint"):
        TrainingRecord.load(trt.DistributedRecorder(), tmp_path / "step-9")


@pytest.mark.parametrize(("overrides", "match"), [
    ([[["model", "nope"], 1]], r"override's path \['model', 'nope'\] is not in the replicated"),
    ([[[], 5]], "leave no model, optimizer and scheduler"),
    ([[[True], 1]], "path of keys and indices"),
    ([5], r"an override must be \[path"),
])
def test_an_override_that_does_not_fit_the_replicated_tree_is_refused(saved, overrides, match):
    part = saved / "rank-00000-of-00001.mpk"
    rec = NamedMpkFileRecorder(trainrec.NativePrecisionSettings())
    header, item = trainrec.read_file(part)
    item["overrides"] = overrides
    part.unlink()
    rec.save_item(item, part, header.record_type)
    with pytest.raises(CorruptRecordError, match=match):
        TrainingRecord.load(trt.DistributedRecorder(), saved)


def test_trainrec_inspect_and_verify_read_a_ddp_checkpoint_directory(saved):
    """`trainrec inspect` / `verify` said 'a directory, not a record file (no format of
    directories claims it)'; now the directory is the trainrec.distributed format, every
    rank's part checked, rank 0's view shown, and a damaged part is refused."""
    import subprocess
    import sys

    header, item = trainrec.read_file(saved)
    assert (header.format, header.record_type) == ("trainrec.distributed", "TrainingRecord")
    assert isinstance(item, list) and len(item) == 5
    cli = [sys.executable, "-m", "trainrec"]
    out = subprocess.run([*cli, "verify", str(saved)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "every rank's part" in out.stdout, out.stdout + out.stderr
    part = saved / "rank-00000-of-00001.mpk"
    part.write_bytes(part.read_bytes()[:-9])
    with pytest.raises(CorruptRecordError, match=r"rank-00000-of-00001\.mpk"):
        trainrec.read_file(saved)
