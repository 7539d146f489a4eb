"""Accelerate and Lightning, made exact (issue 15 item 5).

For each tool: the uninterrupted run, a run checkpointed after micro-step 13 (3 gradients
of a window of 4 pending) by the tool's own save, and its resume in a fresh process, with
trainrec's `ExactResume` (bitwise equal: final parameters and every loss) and without it
(the tool alone: the resumed run differs, so these runs would catch the loss). Accelerate is
also resumed after micro-step 5 (epoch 0) on into epoch 1, with and without the loader's
`generator=`, and with Accelerate's seedable sampler, each against the same resume with
ExactResume's dataloader realignment switched off (it differs). The runs are in
tests/_tool_runs.py: per tool, the uninterrupted run and the saves run one after another in
one bounded subprocess, the resumes in one more (fresh: it never trained), made once for all
of pytest-xdist's workers (`_shared_runs.once`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _shared_runs import once

torch = pytest.importorskip("torch")

import trainrec  # noqa: E402

RUNS = Path(__file__).resolve().parent / "_tool_runs.py"
TIMEOUT_S = 120
SAVE_AT = 13  # 40 samples / batch 4 = 10 micro-batches an epoch: micro-step 13 is 3 into a window


def _start(tool: str, out: Path, *jobs: str) -> tuple[subprocess.Popen[str], Path]:
    return subprocess.Popen([sys.executable, str(RUNS), tool, str(out), *jobs], cwd=out.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def _results(*started: tuple[subprocess.Popen[str], Path]) -> list[list[dict[str, Any]]]:
    results = []
    for proc, out in started:
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"{' '.join(proc.args[2:])} did not finish in {TIMEOUT_S} s")  # type: ignore[index]
        assert proc.returncode == 0, log[-4000:]
        results.append(torch.load(out, weights_only=False))
    return results


def _run_tool(tool: str, tmp: Path, resumes: list[list[str]], saves: list[str], *,
              check_first: bool = True) -> Any:
    """The uninterrupted run and the saves in one process, then every resume in one fresh
    process (that never trained: each resume builds its objects anew); the resumes' results
    grouped as `resumes` lists their jobs."""
    (first,) = _results(_start(tool, tmp / "first.pt", f"full:exact:{tmp / 'none'}", *saves))
    for r in first if check_first else ():
        assert "error" not in r, r["error"]
    (resumed,) = _results(_start(tool, tmp / "resumes.pt", *(job for jobs in resumes for job in jobs)))
    assert len(resumed) == sum(map(len, resumes))
    later, it = [], iter(resumed)
    for jobs in resumes:
        later.append([next(it) for _ in jobs])
    return first, later


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"])


# Accelerate setups whose resume at EARLY crosses into the next epoch: the loader's own
# generator, none (the global RNG), and a plain DataLoader that Accelerate makes stateful with
# use_seedable_sampler (saved in epoch 1: its order is seeded from the epoch counter); and a
# save during the last batch of epoch 0
EARLY = 5
ACCEL_SETUPS = {"generator": ("exact", EARLY), "no generator": ("exact+nogen", EARLY),
                "seedable": ("exact+plainloader+seedable", SAVE_AT), "last batch": ("exact", 10)}


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("accelerate", reason="the extra trainrec[accelerate] is not installed")
    pytest.importorskip("torchdata", reason="torchdata is not installed (trainrec[accelerate])")

    def run(tmp: Path) -> Any:
        ck = {name: tmp / name.replace(" ", "_") for name in ACCEL_SETUPS}
        saves = [f"save:exact:{tmp / 'exact'}:{SAVE_AT}", f"save:plain:{tmp / 'plain'}:{SAVE_AT}"]
        for name, (kind, at) in ACCEL_SETUPS.items():
            saves += [f"full:{kind}:{tmp / 'none'}", f"save:{kind}:{ck[name]}:{at}"]
        saves.append(f"full:exact+plainloader:{tmp / 'none'}")  # refused
        return _run_tool("accelerate", tmp,
                         [[f"resume:exact:{tmp / 'exact'}"]
                          + [f"resume:{kind}:{ck[name]}" for name, (kind, _) in ACCEL_SETUPS.items()],
                          [f"resume:plain:{tmp / 'plain'}"]
                          + [f"resume:{kind}+unfixed:{ck[name]}"
                             for name, (kind, _) in ACCEL_SETUPS.items()]],
                         saves, check_first=False)

    return once(tmp_path_factory, "accelerate-runs", run)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("lightning", reason="the extra trainrec[lightning] is not installed")
    pytest.importorskip("torchdata", reason="torchdata is not installed (trainrec[lightning])")

    def run(tmp: Path) -> Any:
        ck = {k: tmp / f"{k}.ckpt" for k in ("exact", "plain", "replay")}
        early = tmp / "early.ckpt"
        return _run_tool("lightning", tmp,
                         [[f"resume:exact:{ck['exact']}", f"resume:plain:{ck['plain']}",
                           f"resume:exact:{early}"],
                          [f"resume:replay:{ck['replay']}", f"resume:replay_allowed:{ck['replay']}"]],
                         [f"save:{k}:{ck[k]}:{SAVE_AT}" for k in ck] + [f"save:exact:{early}:5"])

    return once(tmp_path_factory, "lightning-runs", run)


def test_accelerate_save_state_mid_window_resumes_bitwise_with_exact_resume(accelerate_runs):
    (full, saved, *_), ((resumed, *_), _) = accelerate_runs
    assert saved["pending_at_save"] == 4  # every parameter of the MLP has a pending .grad
    assert resumed["pending_at_start"] == 4
    assert len(full["losses"]) == 20
    assert resumed["losses"] == full["losses"]  # the counters and losses came back too
    assert _same(full, resumed), _max_diff(full, resumed)


def test_accelerate_alone_loses_the_pending_gradients(accelerate_runs):
    (full, _, saved, *_), (_, (resumed, *_)) = accelerate_runs
    assert saved["pending_at_save"] == 4
    assert resumed["pending_at_start"] == 0  # load_state brings no .grad back
    assert not _same(full, resumed)
    assert resumed["losses"][:SAVE_AT] == full["losses"][:SAVE_AT]
    assert resumed["losses"][SAVE_AT:] != full["losses"][SAVE_AT:]


@pytest.mark.parametrize("setup", list(ACCEL_SETUPS))
def test_accelerate_resume_is_bitwise_across_the_epoch_boundary(accelerate_runs, setup):
    # resuming makes the epoch's iterator again, which draws from the loader's generator (or
    # the global RNG) and resets torchdata's sampler generator to the epoch's start; Accelerate
    # keeps no epoch counter. ExactResume puts them back; without that ("unfixed") the runs
    # part where the next epoch's order, the dropout masks or the resumed epoch's order differ
    first, ((_, *resumed), (_, *unfixed)) = accelerate_runs
    i = list(ACCEL_SETUPS).index(setup)
    full, saved = first[3 + 2 * i], first[4 + 2 * i]
    fixed, broken = resumed[i], unfixed[i]
    assert "error" not in full and "error" not in saved and "error" not in fixed, (full, saved, fixed)
    pending = 0 if setup == "last batch" else 4  # Accelerate steps at the end of an epoch
    assert saved["pending_at_save"] == pending and fixed["pending_at_start"] == pending
    assert len(full["losses"]) == 20
    assert fixed["losses"] == full["losses"]
    assert _same(full, fixed), _max_diff(full, fixed)
    if setup == "last batch":  # Accelerate marked the epoch finished: torchdata starts one more
        assert len(broken["losses"]) == 30
        return
    diverged = next(k for k, (a, b) in enumerate(zip(full["losses"], broken["losses"])) if a != b)
    # the generator's draw is one behind: the next epoch (micro-step 11 on) is shuffled anew;
    # the global RNG is one draw behind: dropout differs from the first resumed micro-step;
    # the epoch counter restarts at 0: the resumed epoch 1 is ordered as epoch 0 was
    assert diverged == {"generator": 10, "no generator": EARLY, "seedable": SAVE_AT}[setup]
    assert not _same(full, broken)


def test_accelerate_exact_resume_refuses_a_sampler_it_cannot_resume_exactly(accelerate_runs):
    (*_, refused), _ = accelerate_runs  # a plain DataLoader(shuffle=True), not seedable
    assert refused["error"].startswith("ValueError: prepared dataloader 0 shuffles with "
                                       "torch.utils.data.sampler.RandomSampler")
    assert "StatefulDataLoader" in refused["error"] and "use_seedable_sampler=True" in refused["error"]


@pytest.mark.parametrize("at", [SAVE_AT, 5])
def test_lightning_mid_window_checkpoint_resumes_bitwise_with_exact_resume(lightning_runs, at):
    # at 5 the resumed run crosses an epoch: the next shuffle needs the loader's generator
    (full, *saved), ((resumed, _, early), _) = lightning_runs
    saved, resumed = (saved[0], resumed) if at == SAVE_AT else (saved[3], early)
    assert saved["pending_at_save"] == 4
    assert resumed["pending_at_start"] == 4
    assert len(full["losses"]) == 20 and len(resumed["losses"]) == 20 - at
    assert resumed["losses"] == full["losses"][at:]  # the data position came back
    assert _same(full, resumed), _max_diff(full, resumed)


def test_lightning_alone_loses_pending_gradients_and_rng(lightning_runs):
    (full, _, saved, _, _), ((_, resumed, _), _) = lightning_runs
    assert saved["pending_at_save"] == 4
    assert resumed["pending_at_start"] == 0
    assert resumed["losses"] != full["losses"][SAVE_AT:]
    assert not _same(full, resumed)


def test_lightning_refuses_a_mid_epoch_resume_that_would_replay_batches(lightning_runs):
    full, (_, (refused, allowed)) = lightning_runs
    assert refused["error"].startswith("ValueError: resuming in the middle of an epoch with a "
                                       "DataLoader that keeps no position")
    assert "StatefulDataLoader" in refused["error"]
    # allowed, the plain DataLoader restarts its epoch: the pending .grad is back, yet the run
    # trains on batches the checkpointed run already used and ends elsewhere
    assert allowed["pending_at_start"] == 4
    assert len(allowed["losses"]) == 20 - SAVE_AT
    assert not _same(full[0], allowed)


# --- the payload both carry, and the misuse each refuses (in-process, no training) ---------

def _mlp(dtype: Any = None) -> Any:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    if dtype is not None:
        model = model.to(dtype)
    model(torch.randn(5, 3, dtype=dtype or torch.float32)).sum().backward()
    return model


def _grads(model: Any) -> list[Any]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same_grads(a: list[Any], b: list[Any]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                             and torch.equal(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_payload_brings_pending_grads_state_and_rng_back_bitwise(dtype):
    import trainrec
    from trainrec.adapters.torch import TorchRngRecord
    from trainrec.adapters.torch.pending import pack, unpack

    @trainrec.record
    class Counters:
        micro: int
        losses: list[float]

    model = _mlp(dtype)
    model[2].bias.grad = None  # a parameter without a pending gradient stays without one
    before = _grads(model)
    payload = pack(model, Counters(7, [0.5, 0.25]), {"step": 3}, rng=TorchRngRecord.capture())
    assert _same_grads(_grads(model), before)  # nothing was cleared
    drawn = torch.rand(4)
    fresh = _mlp(dtype)
    fresh.zero_grad()
    pending = unpack(payload, fresh, Counters, ("step",), source="test", rng=True)
    pending.apply(fresh)
    pending.rng.apply()
    assert _same_grads(_grads(fresh), before)
    assert pending.state == Counters(7, [0.5, 0.25]) and pending.counters == {"step": 3}
    assert torch.equal(torch.rand(4), drawn)


def _broken_payloads() -> list[tuple[str, Any, str]]:
    from trainrec.adapters.torch.pending import pack

    good = pack(_mlp(), None, {"step": 1})
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5))  # "0.weight" of another shape
    wider(torch.randn(2, 3)).sum().backward()
    other = pack(wider, None, {"step": 1})
    cases = [
        ("not a dict", [1, 2], "not a trainrec pending-gradients payload"),
        ("another format", {**good, "format": "trainrec.pending/0"}, "format 'trainrec.pending/0'"),
        ("a counter missing", {k: v for k, v in good.items() if k != "step"}, "lacks ['step']"),
        ("a counter not an int", {**good, "step": "1"}, "counters ['step'] are not ints"),
        ("grads not bytes", {**good, "grads": "x"}, "'grads' must be bytes"),
        ("grads truncated", {**good, "grads": good["grads"][:-9]}, "pending gradients:"),
        ("another model", {**other}, "do not fit the model"),
        ("an unexpected state", {**good, "state": b"x"}, "holds a state but none is expected"),
    ]
    shape = pack(_mlp(), None, {"step": 1})
    return cases + [("a dtype changed", {**pack(_mlp(torch.float64), None, {"step": 1})},
                     "has dtype f64, the parameter float32"),
                    ("shape ok", shape, "")]


@pytest.mark.parametrize(("what", "payload", "message"), _broken_payloads(),
                         ids=[c[0] for c in _broken_payloads()])
def test_a_payload_that_does_not_fit_is_refused_and_changes_nothing(what, payload, message):
    from trainrec import RecorderError
    from trainrec.adapters.torch.pending import unpack

    model = _mlp()
    model[0].weight.grad.mul_(3)
    before = _grads(model)
    if not message:  # the unbroken payload loads: the cases above fail for what they break
        unpack(payload, model, None, ("step",), source="test").apply(model)
        assert not _same_grads(_grads(model), before)
        return
    with pytest.raises(RecorderError, match="test") as e:
        unpack(payload, model, None, ("step",), source="test").apply(model)
    assert message in str(e.value)
    assert _same_grads(_grads(model), before)


def test_accelerate_exact_resume_refuses_misuse_and_a_foreign_payload():
    accelerate = pytest.importorskip("accelerate", reason="trainrec[accelerate] is not installed")
    from trainrec import RecordMismatchError
    from trainrec.adapters.torch.accelerate import ExactResume

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _mlp()
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        ExactResume(object(), model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ExactResume(accelerator, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trainrec Record"):
        ExactResume(accelerator, model, state={"micro": 1})
    exact = ExactResume(accelerator, model)
    accelerator.step, accelerator.sync_gradients = 5, False
    sd = exact.state_dict()
    accelerator.step, accelerator.sync_gradients = 0, True
    grads = _grads(model)
    with pytest.raises(RecordMismatchError, match="ExactResume.*do not fit the model"):
        ExactResume(accelerator, torch.nn.Linear(3, 1)).load_state_dict(sd)
    assert accelerator.step == 0
    model.zero_grad()
    exact.load_state_dict(sd)
    assert _same_grads(_grads(model), grads)
    assert accelerator.step == 5 and accelerator.sync_gradients is False


@trainrec.record
class _Micro:
    micro: int


@trainrec.record
class _Other:
    micro: int


def test_accelerate_load_state_refuses_a_payload_before_accelerate_loads_anything(tmp_path):
    """Another gradient_accumulation_steps mid-window was accepted (pending gradients of
    loss/4 stepped as a window of 2); and a refused payload was refused only after
    Accelerate had loaded model, optimizer and RNG: now a pre-hook checks it first."""
    accelerate = pytest.importorskip("accelerate", reason="trainrec[accelerate] is not installed")
    from trainrec import RecordMismatchError
    from trainrec.adapters.torch.accelerate import ExactResume

    def build(steps: int, state: Any) -> Any:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        exact = ExactResume(accelerator, model, state)
        accelerator.register_for_checkpointing(exact)
        return accelerator, model, opt

    def micro(accelerator: Any, model: Any, opt: Any, n: int) -> None:
        for _ in range(n):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.randn(5, 3)).sum())
                opt.step()
                opt.zero_grad()

    accelerator, model, opt = build(4, _Micro(6))
    micro(accelerator, model, opt, 6)  # 2 micro-steps into the second window of 4
    mid = tmp_path / "mid"
    accelerator.save_state(str(mid))
    micro(accelerator, model, opt, 2)
    end = tmp_path / "end"
    accelerator.save_state(str(end))
    for steps, state, message in [(2, _Micro(0), "gradient_accumulation_steps=4, this accelerator has 2"),
                                  (4, _Other(0), "holds a _Micro, not a _Other")]:
        accelerator, model, opt = build(steps, state)
        micro(accelerator, model, opt, 5)
        before = ([p.detach().clone() for p in model.parameters()], _grads(model),
                  repr(opt.state_dict()), torch.get_rng_state(), accelerator.step)
        with pytest.raises(RecordMismatchError, match=message):
            accelerator.load_state(str(mid))
        assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
        assert _same_grads(before[1], _grads(model)) and before[2] == repr(opt.state_dict())
        assert torch.equal(before[3], torch.get_rng_state()) and before[4] == accelerator.step
    accelerator, model, opt = build(2, _Micro(0))
    accelerator.load_state(str(end))  # at a window's end another window size is fine
    assert accelerator.step == 8 and all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
def test_accelerate_exact_resume_refuses_other_dataloaders_and_an_unresumable_sampler():
    accelerate = pytest.importorskip("accelerate", reason="trainrec[accelerate] is not installed")
    stateful = pytest.importorskip("torchdata.stateful_dataloader",
                                   reason="torchdata is not installed (trainrec[accelerate])")
    from trainrec import RecordMismatchError
    from trainrec.adapters.torch.accelerate import ExactResume

    def prepared(loader: Any = None, seedable: bool = False) -> Any:
        config = accelerate.DataLoaderConfiguration(use_stateful_dataloader=True,
                                                    use_seedable_sampler=seedable)
        accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
        if loader is not None:
            accelerator.prepare(loader)
        return accelerator

    data = list(range(8))
    model = _mlp()
    saved = ExactResume(prepared(stateful.StatefulDataLoader(data, shuffle=True)), model).state_dict()
    assert saved["accelerate_dataloaders"] == 1
    grads = _grads(model)
    model.zero_grad()
    with pytest.raises(RecordMismatchError, match="RNG states of 1 stateful dataloaders, the "
                                                  "accelerator prepared 0"):
        ExactResume(prepared(), model).load_state_dict(saved)
    seedable = prepared(torch.utils.data.DataLoader(data, shuffle=True), seedable=True)
    with pytest.raises(RecordMismatchError, match="holds 1 dataloader generators, the "
                                                  "accelerator's stateful dataloaders have 0"):
        ExactResume(seedable, model).load_state_dict(saved)
    import dataclasses

    from trainrec.adapters.torch import TorchRngRecord
    from trainrec.adapters.torch.pending import pack

    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rng = TorchRngRecord.capture(torch.Generator())
    other_machine = pack(_mlp(), None, {k: v for k, v in saved.items() if isinstance(v, int)},
                         rng=dataclasses.replace(rng, cuda=(rng.torch_cpu,) * (here + 1)))
    with pytest.raises(RecordMismatchError, match=f"RNG states of {here + 1} CUDA devices"):
        ExactResume(prepared(stateful.StatefulDataLoader(data, shuffle=True)),
                    model).load_state_dict(other_machine)
    assert all(p.grad is None for p in model.parameters())  # nothing was written
    ExactResume(prepared(stateful.StatefulDataLoader(data, shuffle=True)), model).load_state_dict(saved)
    assert _same_grads(_grads(model), grads)  # the unbroken variant loads

    unseeded = torch.utils.data.DataLoader(data, shuffle=True)  # torch's RandomSampler
    with pytest.raises(ValueError, match="dataloader 0 shuffles with torch.utils.data.sampler."
                                         "RandomSampler.*use_seedable_sampler=True"):
        ExactResume(prepared(unseeded), model)
    late = prepared()
    exact = ExactResume(late, model)  # prepared after ExactResume: refused when saving
    late.prepare(torch.utils.data.DataLoader(data, shuffle=True))
    with pytest.raises(ValueError, match="shuffles with torch.utils.data.sampler.RandomSampler"):
        exact.state_dict()
    ExactResume(prepared(torch.utils.data.DataLoader(data)), model)  # in order: nothing to draw


def test_lightning_exact_resume_refuses_a_checkpoint_without_it_or_of_another_window():
    pytest.importorskip("lightning", reason="trainrec[lightning] is not installed")
    from trainrec import RecordMismatchError
    from trainrec.adapters.torch.lightning import ExactResume
    from trainrec.adapters.torch.pending import pack

    class Trainer:  # what the callback reads of a Trainer
        accumulate_grad_batches = 4

    model = _mlp()
    cb = ExactResume(rng=False)
    with pytest.raises(TypeError, match="trainrec Record"):
        ExactResume(state=3)
    with pytest.raises(RecordMismatchError, match="written without the callback"):
        cb.on_load_checkpoint(Trainer(), model, {"callbacks": {}})  # type: ignore[arg-type]
    payload = pack(model, None, {"accumulate_grad_batches": 2})
    with pytest.raises(RecordMismatchError, match="accumulate_grad_batches=2, the Trainer has 4"):
        cb.on_load_checkpoint(Trainer(), model, {"callbacks": {cb.state_key: payload}})  # type: ignore[arg-type]
    with pytest.raises(RecordMismatchError, match="holds no rng but one is expected"):
        ExactResume().on_load_checkpoint(Trainer(), model,  # type: ignore[arg-type]
                                         {"callbacks": {cb.state_key: {**payload,
                                                                       "accumulate_grad_batches": 4}}})
    assert cb._pending is None

    from trainrec.adapters.torch import TorchRngRecord

    class FitLoop:
        restarted_mid_epoch = True

    class Resuming(Trainer):
        fit_loop = FitLoop()
        train_dataloader = torch.utils.data.DataLoader(list(range(8)), shuffle=True)  # no generator=

    one_generator = pack(model, None, {"accumulate_grad_batches": 4},
                         rng=TorchRngRecord.capture(torch.Generator()))
    exact = ExactResume(allow_replay=True)
    exact.on_load_checkpoint(Resuming(), model, {"callbacks": {cb.state_key: one_generator}})  # type: ignore[arg-type]
    grads = _grads(model)
    model.zero_grad()
    with pytest.raises(RecordMismatchError, match="generators of 1 train dataloaders, the Trainer's have 0"):
        exact.on_train_start(Resuming(), model)  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())  # nothing was written
    exact.on_load_checkpoint(Resuming(), model, {"callbacks": {cb.state_key: {  # type: ignore[arg-type]
        **one_generator, "rng": pack(model, None, {}, rng=TorchRngRecord.capture())["rng"]}}})
    exact.on_train_start(Resuming(), model)  # type: ignore[arg-type]
    assert _same_grads(_grads(model), grads)  # the unbroken variant loads


@pytest.mark.filterwarnings("ignore")  # Lightning's advice on workers, logging, seeds
def test_a_refused_lightning_resume_leaves_the_module_s_weights_as_they_were(tmp_path):
    """ExactResume refused accumulate_grad_batches=8 for a checkpoint of 4, but only after
    Lightning had loaded the checkpoint's weights into the module (a callback's
    on_load_checkpoint runs after Lightning's restore_model)."""
    pl = pytest.importorskip("lightning.pytorch", reason="trainrec[lightning] is not installed")
    from trainrec import RecordMismatchError
    from trainrec.adapters.torch.lightning import ExactResume

    class Net(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = _mlp()
            torch.manual_seed(seed)
            for p in self.net.parameters():
                torch.nn.init.normal_(p)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class SaveMidWindow(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if batch_idx == 5:  # 2 of a window of 4 pending
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                trainer.should_stop = True

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 3)),
                                       batch_size=4)

    def trainer(window: int, *callbacks: Any) -> Any:
        return pl.Trainer(max_epochs=1, accumulate_grad_batches=window, accelerator="cpu",
                          callbacks=[ExactResume(rng=False, allow_replay=True), *callbacks],
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)

    trainer(4, SaveMidWindow()).fit(Net(0), data)
    module = Net(1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    grads = _grads(module)
    with pytest.raises(RecordMismatchError, match="accumulate_grad_batches=4, the Trainer has 8"):
        trainer(8).fit(module, data, ckpt_path=tmp_path / "mid.ckpt")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert _same_grads(grads, _grads(module))
    resumed = Net(1)  # the unbroken variant: the checkpoint's weights, its pending gradients
    trainer(4).fit(resumed, data, ckpt_path=tmp_path / "mid.ckpt")
    assert not all(torch.equal(before[k], v) for k, v in resumed.state_dict().items())


def test_each_integration_refuses_more_than_one_process(monkeypatch):
    accelerate = pytest.importorskip("accelerate", reason="trainrec[accelerate] is not installed")
    pytest.importorskip("lightning", reason="trainrec[lightning] is not installed")
    from trainrec.adapters.torch import accelerate as tra
    from trainrec.adapters.torch import lightning as trl

    accelerator = accelerate.Accelerator(cpu=True)
    tra.ExactResume(accelerator, _mlp())  # one process: accepted
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match="this accelerator has 2: .*main process only"):
        tra.ExactResume(accelerator, _mlp())

    class Trainer:
        world_size = 2

    cb = trl.ExactResume()
    with pytest.raises(ValueError, match="world_size 2: .*rank 0 only"):
        cb.setup(Trainer(), _mlp(), "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass the callback to Trainer"):
        cb.state_dict()  # never set up by a Trainer


def test_without_the_extra_the_import_says_what_to_install():
    code = ("import sys\n"
            "sys.modules['accelerate'] = None; sys.modules['lightning'] = None\n"
            "for name, extra in (('accelerate', 'accelerate'), ('lightning', 'lightning')):\n"
            "    try:\n"
            "        __import__('trainrec.adapters.torch.' + name)\n"
            "    except ImportError as e:\n"
            "        assert f\"pip install 'trainrec[{extra}]'\" in str(e), str(e)\n"
            "    else:\n"
            "        raise AssertionError(name + ' imported without its package')\n"
            "import trainrec.adapters.torch as trt\n"
            "assert trt.grads_from is not None  # the rest of the adapter is unaffected\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
