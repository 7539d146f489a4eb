"""Hugging Face `Trainer` made exact mid-window (issue 26): `ExactResume.attach(trainer)`.

The runs are tests/_trainer_runs.py jobs (a tiny GPT2LMHeadModel from a config, 20 samples,
batch 2, gradient_accumulation_steps 4: windows of 4, 4 and 2 micro-batches, 3 steps an
epoch, 2 epochs, cosine with warm-up, dropout, an evaluation and a step checkpoint every
2 steps). They go in two phases of at most three processes: (1) the uninterrupted runs and
the runs a SIGTERM stops at a micro-step, one process, with the 2-rank (gloo) runs beside
it; (2) every resume in fresh processes, likewise. Each process is forked from one of two
zygotes that imported torch and transformers (tests/_zygote.py): the two ranks of a phase
from different ones, and each resume from the other one than the run it resumes, so that
no two processes that meet share an interpreter (nor its hash seed). Each stopped run is compared with the
uninterrupted one: every parameter, optimizer and scheduler tensor, the global step, the
final RNG states and logged losses bitwise, and the micro-steps the resume computed (the
digests of their input_ids) exactly the uninterrupted run's remaining ones. The same run
without the callback is measured in the same test (Trainer alone: a SIGTERM kills it,
nothing saved since the last step checkpoint; Trainer's enable_jit_checkpoint: train()
returns after overwriting that step checkpoint, whose resume is off). The two phases run
once for all of pytest-xdist's workers (`_shared_runs.once`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _shared_runs import once
from _zygote import Zygote

torch = pytest.importorskip("torch")

RUNS = Path(__file__).resolve().parent / "_trainer_runs.py"
# what _trainer_runs.py imports (7 s of CPU a process): its processes are forked from two
# zygotes that imported them once
PRELOAD = ["torch", "torch.optim", "transformers", "transformers.trainer", "transformers.training_args",
           "transformers.trainer_jit_checkpoint", "transformers.models.gpt2.modeling_gpt2",
           "trainrec.adapters.torch.transformers"]
TIMEOUT_S = 300
MICRO = 20  # micro-steps of the whole run: 2 epochs of 10
# where a SIGTERM stops the run (during that micro-step) and the checkpoint it commits
STOPS = {
    "mid-window, the resume crosses the epoch boundary": (6, "exact-checkpoint-1-2"),
    "in the epoch's short last window": (9, "exact-checkpoint-2-1"),
    "at a window's end, after its step's log and step checkpoint": (8, "exact-checkpoint-2-0"),
    "at the epoch's end, after its evaluation": (10, "exact-checkpoint-3-0"),
    "at the last micro-step, after train()'s end": (20, "exact-checkpoint-6-0"),
}
BF16_AT = 13  # epoch 1, 3 micro-steps into its first window (after step 3)
# the 2-rank runs (gloo, each rank 10 micro-batches an epoch): one epoch, no evaluation and
# no step checkpoints, which the single-process runs cover; rank 1 alone gets the SIGTERM
TWO_RANKS = {"ddp_find_unused_parameters": False, "num_train_epochs": 1, "eval_strategy": "no",
             "save_strategy": "no"}
KILL_AT = 17  # epoch 1, 3 micro-steps into its second window (step 5), after checkpoint-4


def _job(name: str, tmp: Path, **kw: Any) -> dict[str, Any]:
    return {"name": name, "dir": str(tmp / kw.pop("dir", name)), **kw}


def _processes(jobs: list[dict[str, Any]], out: Path, world: int = 1) -> list[dict[str, Any]]:
    """The `_trainer_runs.py` process running `jobs` (one a rank), as zygote jobs."""
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps(jobs))
    procs = []
    port = _free_port() if world > 1 else 0
    for rank in range(world):
        e = {}
        if world > 1:
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                     LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        procs.append({"argv": [str(RUNS), str(spec), str(out)], "cwd": str(out.parent), "env": e,
                      "timeout": TIMEOUT_S})
    return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(zygotes: tuple[Zygote, Zygote], one: dict[str, Any], ranks: list[dict[str, Any]],
         status: int = 0) -> None:
    """`one` and rank 0 forked from the first zygote, rank 1 from the second, all at once;
    each must end with `status` (a run past TIMEOUT_S ends by SIGALRM)."""
    first, second = zygotes
    first.submit([one, ranks[0]])
    second.submit([ranks[1]])
    for proc in first.collect() + second.collect():
        assert proc.returncode == status, (proc.returncode, proc.stderr[-4000:])


def _start(jobs: list[dict[str, Any]], out: Path, env: dict[str, str] | None = None,
           world: int = 1) -> list[subprocess.Popen[str]]:
    """Fresh `_trainer_runs.py` processes running `jobs`: the GPU test's, which stays on
    them (forked processes were checked on CPU only)."""
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps(jobs))
    procs = []
    port = _free_port() if world > 1 else 0
    for rank in range(world):
        e = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        if world > 1:
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                     LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        procs.append(subprocess.Popen([sys.executable, str(RUNS), str(spec), str(out)],
                                      cwd=out.parent, env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen[str]], deadline: float, status: int = 0) -> None:
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            pytest.fail(f"a Trainer run did not finish in {TIMEOUT_S} s")
        assert proc.returncode == status, err[-4000:]


def _load(out: Path) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in torch.load(out, weights_only=False)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("transformers", reason="the extra trainrec[transformers] is not installed")

    def run(tmp: Path) -> dict[str, Any]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with Zygote(PRELOAD, env) as a, Zygote(PRELOAD, env) as b:
            return runs_from(tmp, (a, b))

    def runs_from(tmp: Path, zygotes: tuple[Zygote, Zygote]) -> dict[str, Any]:
        stops = {name: f"stop{i}" for i, name in enumerate(STOPS)}
        first = [
            _job("full", tmp, exact=True), _job("full_plain", tmp), _job("full_bf16", tmp, exact=True, bf16=True),
            *(_job(stops[n], tmp, exact=True, stop_at=at) for n, (at, _) in STOPS.items()),
            _job("stop_bf16", tmp, exact=True, bf16=True, stop_at=BF16_AT),
            _job("jit", tmp, jit=True, stop_at=KILL_AT),
            _job("killed_plain", tmp, stop_at=KILL_AT, killed=True),
            # last: its SystemExit ends the process, whose exit status the test checks
            _job("killed_exact", tmp, exact=True, stop_at=KILL_AT, uncaught=True),
        ]
        two = [_job("ddp_full", tmp, exact=True, args=TWO_RANKS),
               _job("ddp_stop", tmp, exact=True, stop_at=6, stop_rank=1, args=TWO_RANKS, uncaught=True)]
        (one,) = _processes(first, tmp / "first.pt")
        # each ended by its last job's SystemExit(143)
        _run(zygotes, one, _processes(two, tmp / "two.pt", world=2), status=143)
        one_results = _load(tmp / "first.pt")
        ranks = [_load(Path(f"{tmp / 'two.pt'}.{r}")) for r in range(2)]

        stop6 = tmp / stops[next(iter(STOPS))] / STOPS[next(iter(STOPS))][1]
        damaged = tmp / "damaged" / stop6.name
        shutil.copytree(stop6, damaged)
        part = damaged / "rank-00000-of-00001.mpk"
        part.write_bytes(part.read_bytes()[:-40])
        two_ck = tmp / "ddp_stop" / "exact-checkpoint-1-2"
        refusals = {
            "gradient_accumulation_steps": {"gradient_accumulation_steps": 2},
            "per_device_train_batch_size": {"per_device_train_batch_size": 1},
            "seed": {"seed": 1},
            "data_seed": {"data_seed": 3},
        }
        second = [
            *(_job("r_" + stops[n], tmp, dir=stops[n], exact=True, resume=True) for n in STOPS),
            _job("r_bf16", tmp, dir="stop_bf16", exact=True, bf16=True, resume=True),
            _job("r_killed_exact", tmp, dir="killed_exact", exact=True, resume=True),
            _job("r_step", tmp, dir="resume_step", exact=True, resume=str(tmp / "full" / "checkpoint-4")),
            _job("r_killed_plain", tmp, dir="killed_plain", resume=True),
            _job("r_jit", tmp, dir="jit", resume=True),
            # stopped again inside the window it resumed in, then resumed from that
            _job("chain", tmp, exact=True, resume=str(stop6), stop_at=1),
            _job("r_chain", tmp, dir="chain", exact=True, resume=True),
            *(_job("refuse_" + k, tmp, exact=True, resume=str(stop6), args=a) for k, a in refusals.items()),
            _job("refuse_length", tmp, exact=True, resume=str(stop6), samples=19),
            _job("refuse_world_size", tmp, exact=True, resume=str(two_ck)),
            _job("refuse_damaged", tmp, exact=True, resume=str(damaged)),
            _job("refuse_without_callback", tmp, resume=str(stop6)),
            _job("r_no_pending", tmp, dir="no_pending", exact=True, resume=str(stop6),
                 drop_pending=True),
        ]
        (one,) = _processes(second, tmp / "second.pt")
        two_resumed = _processes([_job("r2", tmp, dir="ddp_stop", exact=True, resume=True, args=TWO_RANKS)],
                                 tmp / "two_resumed.pt", world=2)
        # every resume from the other zygote than the run it resumes (another interpreter)
        _run(zygotes[::-1], one, two_resumed)
        return {"one": {**one_results, **_load(tmp / "second.pt")}, "stops": stops, "tmp": tmp,
                "ranks": [{**ranks[r], **_load(Path(f"{tmp / 'two_resumed.pt'}.{r}"))} for r in range(2)]}

    return once(tmp_path_factory, "trainer-runs", run)


def _max_diff(a: dict[str, Any], b: dict[str, Any], key: str = "params") -> float:
    return max(float((a[key][k].double() - b[key][k].double()).abs().max())
               for k in a[key] if isinstance(a[key][k], torch.Tensor))


def _assert_same_run(full: dict[str, Any], resumed: dict[str, Any], done: int) -> None:
    """`resumed`, which started after `done` micro-steps, ended exactly as `full`."""
    assert resumed["error"] is None and resumed["exit"] is None, resumed["error"]
    # exactly the remaining micro-steps, on the very batches: none replayed, none skipped
    assert resumed["forwards"] == full["forwards"][done:]
    for key in ("params", "optimizer"):
        assert full[key].keys() == resumed[key].keys()
        for k, v in full[key].items():
            w = resumed[key][k]
            same = torch.equal(v, w) and v.dtype == w.dtype if isinstance(v, torch.Tensor) else v == w
            assert same, f"{key} {k} differs by {_max_diff(full, resumed, key)}"
    assert resumed["scheduler"] == full["scheduler"]
    assert resumed["global_step"] == full["global_step"]
    assert torch.equal(resumed["rng"]["torch"], full["rng"]["torch"])
    assert (resumed["rng"]["numpy"] == full["rng"]["numpy"]).all()
    assert resumed["rng"]["python"] == full["rng"]["python"]


@pytest.mark.parametrize("where", list(STOPS))
def test_a_sigterm_at_a_micro_step_resumes_bitwise_in_a_fresh_process(runs, where):
    one, name = runs["one"], runs["stops"][where]
    at, folder = STOPS[where]
    stopped, resumed = one[name], one["r_" + name]
    assert stopped["exit"] == 143 and len(stopped["forwards"]) == at  # no micro-step after it
    assert stopped["handler_restored"] and resumed["handler_restored"]
    assert stopped["forwards"] == one["full"]["forwards"][:at]
    assert folder in stopped["checkpoints"]
    _assert_same_run(one["full"], resumed, at)
    assert resumed["global_step"] == 6
    assert resumed["losses"] == one["full"]["losses"]  # the loss not yet logged came back too


def test_bf16_mixed_precision_resumes_bitwise(runs):
    one = runs["one"]
    assert one["stop_bf16"]["exit"] == 143
    assert "exact-checkpoint-3-3" in one["stop_bf16"]["checkpoints"]
    _assert_same_run(one["full_bf16"], one["r_bf16"], BF16_AT)
    assert _max_diff(one["full_bf16"], one["full"]) > 0  # it is another run than the fp32 one


def test_the_process_ends_with_143_and_trainers_step_checkpoints_are_left_as_they_were(runs):
    one = runs["one"]
    exact, plain = one["killed_exact"], one["killed_plain"]
    # SystemExit(128 + SIGTERM) ended the process (its exit status is checked in `runs`): the
    # script's lines after train() never ran
    assert exact["exit"] == 143 and len(exact["forwards"]) == KILL_AT
    assert sorted(exact["checkpoints"]) == ["checkpoint-2", "checkpoint-4", "exact-checkpoint-4-3"]
    files = exact["checkpoints"]["exact-checkpoint-4-3"]
    assert {"manifest.json", "rank-00000-of-00001.mpk", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", "model/model.safetensors"} <= set(files)
    assert not any(".lock" in f or "tmp" in f for f in files)
    for ck in ("checkpoint-2", "checkpoint-4"):  # byte for byte what Trainer alone wrote
        for f in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert exact["checkpoints"][ck][f] == plain["checkpoints"][ck][f], (ck, f)
    _assert_same_run(one["full"], one["r_killed_exact"], KILL_AT)


def test_trainers_own_step_checkpoints_stay_exact_with_the_callback(runs):
    one = runs["one"]
    _assert_same_run(one["full"], one["r_step"], 14)  # checkpoint-4: 4 + 4 + 2 + 4 micro-steps
    _assert_same_run(one["full"], one["full_plain"], 0)  # attaching changes nothing in a run


def test_without_the_callback_a_sigterm_saves_nothing_or_overwrites_a_step_checkpoint(runs):
    """The same run, Trainer alone, measured in the same test (reported in the README)."""
    one = runs["one"]
    plain = one["killed_plain"]
    assert plain["exit"] == "killed" and plain["default_sigterm"]  # it ends the process there
    assert sorted(plain["checkpoints"]) == ["checkpoint-2", "checkpoint-4"]
    redo = one["r_killed_plain"]  # from checkpoint-4 (after micro-step 14): 15-17 again
    assert len(redo["forwards"]) == MICRO - 14 == len(one["r_killed_exact"]["forwards"]) + 3
    _assert_same_run(one["full_plain"], redo, 14)  # exact, but the work since is done twice

    jit = one["jit"]
    assert jit["jit_returned"]  # train() returned normally: a save_model after it would run
    assert len(jit["forwards"]) == 18  # acted on at its next step hook, the window's end
    ck = jit["checkpoints"]["checkpoint-4"]
    assert ck["rng_state.pth"] != plain["checkpoints"]["checkpoint-4"]["rng_state.pth"]
    assert ck["model.safetensors"] == plain["checkpoints"]["checkpoint-4"]["model.safetensors"]
    off = one["r_jit"]
    params, opt = _max_diff(one["full_plain"], off), _max_diff(one["full_plain"], off, "optimizer")
    print(f"\nenable_jit_checkpoint: resume from the overwritten checkpoint-4 is off by "
          f"{params:.3g} (parameters), {opt:.3g} (optimizer state)")
    assert params > 0 and opt > 0


def test_a_second_sigterm_inside_the_resumed_window_resumes_bitwise(runs):
    one = runs["one"]
    assert one["chain"]["exit"] == 143 and len(one["chain"]["forwards"]) == 1
    assert "exact-checkpoint-1-3" in one["chain"]["checkpoints"]
    _assert_same_run(one["full"], one["r_chain"], 7)


@pytest.mark.parametrize(("job", "message"), [
    ("refuse_gradient_accumulation_steps",
     "gradient_accumulation_steps=4 in the checkpoint, 2 here (the pending gradients are a part "
     "of a window of that many micro-steps"),
    ("refuse_per_device_train_batch_size",
     "per_device_train_batch_size=2 in the checkpoint, 1 here"),
    ("refuse_seed", "seed=0 in the checkpoint, 1 here (the data order (and any model_init) "
                    "derives from it): resume with TrainingArguments(seed=0)"),
    ("refuse_data_seed", "data_seed=None in the checkpoint, 3 here"),
    ("refuse_length", "the train dataset had 20 samples, this one has 19"),
    ("refuse_world_size", "world_size=2 in the checkpoint, 1 here (each rank's pending gradients"),
    ("refuse_damaged", "rank-00000-of-00001.mpk"),
    ("refuse_without_callback", "Can't find a valid checkpoint at"),
])
def test_what_cannot_continue_exactly_is_refused_before_anything_loads(runs, job, message):
    result = runs["one"][job]
    assert result["error"] is not None and message in result["error"], result["error"]
    if job not in ("refuse_damaged", "refuse_without_callback"):
        assert result["error"].startswith("RecordMismatchError"), result["error"]
        assert "resume with" in result["error"]
    assert result["untouched"]  # the model as it was built: nothing was loaded into it
    assert result["forwards"] == []


def test_two_ranks_agree_on_the_signal_and_resume_bitwise(runs):
    for rank, r in enumerate(runs["ranks"]):
        assert r["ddp_stop"]["exit"] == 143, rank  # rank 0 got no signal: it heard of rank 1's
        assert len(r["ddp_stop"]["forwards"]) == 6
        _assert_same_run(r["ddp_full"], r["r2"], 6)
        assert r["r2"]["losses"] == r["ddp_full"]["losses"]
    a, b = runs["ranks"]
    assert a["ddp_full"]["forwards"] != b["ddp_full"]["forwards"]  # each rank its own batches
    manifest = json.loads((runs["tmp"] / "ddp_stop" / "exact-checkpoint-1-2" / "manifest.json").read_text())
    assert manifest["positions"] == [[1, 2], [1, 2]] and manifest["world_size"] == 2


def test_without_the_pending_gradients_the_same_resume_is_not_exact(runs):
    # the broken variant: ExactResume with its pending .grad left out (as a resume from
    # Trainer's own files would be): these comparisons catch it
    one = runs["one"]
    broken = one["r_no_pending"]
    assert broken["forwards"] == one["full"]["forwards"][6:]  # the same micro-steps...
    assert _max_diff(one["full"], broken) > 0  # ...and another result


@pytest.mark.cuda
def test_fp16_with_a_grad_scaler_on_a_gpu_resumes_bitwise(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers", reason="the extra trainrec[transformers] is not installed")
    gpu = {"use_cpu": False, "fp16": True}  # fp16 mixed precision: Accelerate's GradScaler
    deadline = time.monotonic() + TIMEOUT_S
    _wait(_start([_job("full", tmp_path, exact=True, args=gpu),
                  _job("stop", tmp_path, exact=True, stop_at=6, args=gpu)], tmp_path / "a.pt"),
          deadline)
    _wait(_start([_job("resumed", tmp_path, dir="stop", exact=True, resume=True, args=gpu)],
                 tmp_path / "b.pt"), deadline)
    first, second = _load(tmp_path / "a.pt"), _load(tmp_path / "b.pt")
    assert first["stop"]["exit"] == 143
    assert "scaler.pt" in first["stop"]["checkpoints"]["exact-checkpoint-1-2"]
    _assert_same_run(first["full"], second["resumed"], 6)


# --- attaching, and what is refused before any run (in this process) --------------------

@pytest.fixture
def make_trainer(tmp_path):
    transformers = pytest.importorskip("transformers",
                                       reason="the extra trainrec[transformers] is not installed")
    import importlib.util

    spec = importlib.util.spec_from_file_location("_trainer_runs", RUNS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def make(**args: Any) -> Any:
        return module._trainer({"name": "t", "dir": str(tmp_path / "out"), "args": args})

    make.transformers = transformers  # type: ignore[attr-defined]
    return make


def test_attach_refuses_what_it_cannot_make_exact_naming_the_fix(make_trainer):
    from trainrec.adapters.torch.transformers import ExactResume

    with pytest.raises(TypeError, match="must be a transformers.Trainer"):
        ExactResume.attach(object())
    trainer = make_trainer()
    ExactResume.attach(trainer)
    with pytest.raises(ValueError, match="already has an ExactResume"):
        ExactResume.attach(trainer)
    for args, message in [
        ({"enable_jit_checkpoint": True}, r"refuses to run beside it .*"
                                          r"TrainingArguments\(enable_jit_checkpoint=False\)"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size: .*set it False"),
        ({"ignore_data_skip": True}, "ignore_data_skip: .*set it False"),
    ]:
        trainer = make_trainer(**args)
        callbacks = list(trainer.callback_handler.callbacks)
        train = trainer.train
        with pytest.raises(ValueError, match=message):
            ExactResume.attach(trainer)
        assert trainer.callback_handler.callbacks == callbacks and trainer.train == train
    with pytest.raises(TypeError, match="signal numbers"):
        ExactResume.attach(make_trainer(), signals=())


def test_a_callback_passed_to_the_trainer_is_refused_for_attach(make_trainer):
    from trainrec.adapters.torch.transformers import ExactResume

    transformers = make_trainer.transformers
    trainer = make_trainer()
    with pytest.raises(ValueError, match=r"ExactResume.attach\(trainer\), after the Trainer is made"):
        transformers.Trainer(model=trainer.model, args=trainer.args,
                             train_dataset=trainer.train_dataset,
                             eval_dataset=trainer.eval_dataset, callbacks=[ExactResume()])


def test_the_newest_checkpoint_of_either_kind_is_found(tmp_path):
    pytest.importorskip("transformers", reason="the extra trainrec[transformers] is not installed")
    from trainrec.adapters.torch.transformers import checkpoints

    for name in ("checkpoint-4", "checkpoint-12", "exact-checkpoint-4-3", "exact-checkpoint-4-0",
                 "exact-checkpoint-4-3-1", "checkpoint-x", ".exact-checkpoint-9-1.0123.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "exact-checkpoint-20-1").write_text("a file, not a checkpoint")
    assert [(pos, p.name) for pos, p in checkpoints(tmp_path)] == [
        ((4, 0, -1), "checkpoint-4"), ((4, 0, 0), "exact-checkpoint-4-0"),
        ((4, 3, 0), "exact-checkpoint-4-3"), ((4, 3, 1), "exact-checkpoint-4-3-1"),
        ((12, 0, -1), "checkpoint-12")]


def test_without_the_extra_the_import_says_what_to_install():
    code = ("import sys\n"
            "sys.modules['transformers'] = None\n"
            "try:\n"
            "    import trainrec.adapters.torch.transformers\n"
            "except ImportError as e:\n"
            "    assert \"pip install 'trainrec[transformers]'\" in str(e), str(e)\n"
            "else:\n"
            "    raise AssertionError('imported without transformers')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]


def test_batches_that_are_not_tensors_are_refused_at_the_first_window(make_trainer):
    from trainrec.adapters.torch.transformers import ExactResume

    trainer = make_trainer(eval_strategy="no", save_strategy="no")
    collate = trainer.data_collator
    trainer.data_collator = lambda features: {**collate(features), "source": ["a"] * len(features)}
    ExactResume.attach(trainer)
    with pytest.raises(TypeError, match="batch 0 of the window is not a mapping of str to tensors"):
        trainer.train()
    assert all(p.grad is None for p in trainer.model.parameters())  # no micro-step ran


def test_a_save_that_fails_commits_nothing_and_raises(make_trainer, tmp_path, monkeypatch):
    import signal

    from trainrec import NamedMpkFileRecorder, RecorderError
    from trainrec.adapters.torch.transformers import ExactResume

    transformers = make_trainer.transformers

    class Preempted(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # ExactResume's handler is in place

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    trainer = make_trainer(eval_strategy="no", save_strategy="no")
    trainer.add_callback(Preempted())
    handler = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or a test runner's (pytest-xdist's workers)
    ExactResume.attach(trainer)
    monkeypatch.setattr(NamedMpkFileRecorder, "save_item", full_disk)
    with pytest.raises(RecorderError, match="No space left on device; nothing was committed"):
        trainer.train()
    assert os.listdir(tmp_path / "out") == []  # neither the checkpoint nor its temp directory
    assert signal.getsignal(signal.SIGTERM) == handler  # put back as it was
