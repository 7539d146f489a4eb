"""`DCPRecorder.load` loads what it saved or refuses before any change (issue 31 item 2):
the optimizer state comes back whatever `opt.state` held (a `defaultdict`: reading
`opt.state[p]` adds empty entries, after which DCP planned no optimizer entries and the
load dropped every moment and step), the optimizer's class is checked as
`TrainingRecord.restore` checks it, and a failure after the checks is a `RecorderError`
with the live objects rolled back. In one process, without a process group (the 2-rank
resume after reading `opt.state` is in test_torch_fsdp.py's bitwise resumes)."""

from __future__ import annotations

import copy
import errno

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")
from torch import nn  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
import trainrec.adapters.torch.dcp as dcp_mod  # noqa: E402
import trainrec.adapters.torch.dcp_reader as dcp_reader  # noqa: E402
from trainrec import RecorderError, RecordMismatchError  # noqa: E402


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _trained(opt_type=torch.optim.AdamW, **kw):
    """Mid window: one step taken, a gradient pending; a scheduler."""
    torch.manual_seed(0)
    model = _model()
    opt = opt_type(model.parameters(), lr=1e-2, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    return model, opt, sched


def _fresh(opt_type=torch.optim.AdamW, seed=1, **kw):
    torch.manual_seed(seed)
    model = _model()
    opt = opt_type(model.parameters(), lr=1e-2, **kw)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def _snapshot(model, opt, sched):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()), dict(opt.state), sched.state_dict())


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _unchanged(before, model, opt, sched) -> bool:
    params, grads, sd, entries, sched_sd = before
    return (all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            and all((g is None) == (p.grad is None) and (g is None or torch.equal(g, p.grad))
                    for g, p in zip(grads, model.parameters()))
            and _same_state(sd, opt.state_dict()) and entries.keys() == dict(opt.state).keys()
            and sched_sd == sched.state_dict())


def _loaded_as_saved(saved, model, opt, sched) -> bool:
    smodel, sopt, ssched = saved
    return (all(torch.equal(a, b) and torch.equal(a.grad, b.grad)
                for a, b in zip(smodel.parameters(), model.parameters()))
            and _same_state(sopt.state_dict(), opt.state_dict())
            and ssched.state_dict() == sched.state_dict())


@pytest.fixture
def saved(tmp_path):
    run = _trained()
    return run, trt.DCPRecorder().save(tmp_path / "step", *run)


@pytest.mark.parametrize("read", ["none", "every entry", "one entry", "its own state"])
def test_the_optimizer_state_comes_back_whatever_opt_state_holds(saved, read):
    """Every parameter's opt.state[p] read: the load 'succeeded' with every moment and step
    lost; one read: a raw RuntimeError from set_state_dict after the weights were written."""
    run, path = saved
    model, opt, sched = _fresh()
    params = list(model.parameters())
    if read == "every entry":
        assert all(not opt.state[p] for p in params)
    elif read == "one entry":
        assert not opt.state[params[0]]
    elif read == "its own state":
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    trt.DCPRecorder().load(path, model, opt, sched)
    assert _loaded_as_saved(run, model, opt, sched)
    # and the run goes on as the saved one does
    run[1].step()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(run[0].parameters(), model.parameters()))


def test_a_parameter_the_saved_run_never_stepped_has_no_state_after_the_load(tmp_path):
    """The state planned from the live optimizer (stepped once at lr 0 by get_state_dict)
    had an entry for every parameter: DCP refused a checkpoint without one for each."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model[0](torch.randn(3, 4)).sum().backward()  # the last layer gets no gradient
    opt.step()
    path = trt.DCPRecorder().save(tmp_path / "step", model, opt)
    torch.manual_seed(1)
    model2 = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    trt.DCPRecorder().load(path, model2, opt2)
    assert _same_state(opt.state_dict(), opt2.state_dict())
    assert model2[2].weight not in opt2.state


def test_saving_or_loading_takes_no_optimizer_step(tmp_path):
    """get_state_dict stepped an optimizer without state once at lr 0, on the live
    parameters, in save and load: Adam's weight decay turned a -0.0 parameter into +0.0,
    and the empty entries of a read opt.state were dropped."""
    torch.manual_seed(0)
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = -0.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert not opt.state[model[0].weight]  # an empty entry
    path = trt.DCPRecorder().save(tmp_path / "step", model, opt)
    assert torch.signbit(model[0].weight[0, 0]) and list(opt.state) == [model[0].weight]
    assert not trainrec.read_file(path)[1]["manifest"]["optimizer_state"]
    torch.manual_seed(1)
    model2 = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2, weight_decay=0.1)
    trt.DCPRecorder().load(path, model2, opt2)
    assert torch.signbit(model2[0].weight[0, 0]) and not opt2.state


@pytest.mark.parametrize(("saved_type", "live_type", "match"), [
    # decoupled_weight_decay=True went into the live Adam's groups, without a word
    (torch.optim.AdamW, torch.optim.Adam, r"'torch\.optim\.adamw\.AdamW', the live optimizer is "
                                          r"'torch\.optim\.adam\.Adam'"),
    # DCP's "Missing key in checkpoint state_dict: ... momentum_buffer", naming neither class
    (torch.optim.SGD, torch.optim.AdamW, r"'torch\.optim\.sgd\.SGD', the live optimizer is "
                                         r"'torch\.optim\.adamw\.AdamW'"),
])
def test_the_optimizer_s_class_is_checked_before_anything_changes(tmp_path, saved_type, live_type, match):
    kw = {"momentum": 0.9} if saved_type is torch.optim.SGD else {}
    path = trt.DCPRecorder().save(tmp_path / "step", *_trained(saved_type, **kw))
    model, opt, sched = _fresh(live_type)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match=match):
        trt.DCPRecorder().load(path, model, opt, sched)
    assert _unchanged(before, model, opt, sched)


def _fail_dcp_read(monkeypatch):
    """DCP's own read fails once trainrec's in-place reads wrote into the live tensors."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    def fail(self, plan, planner):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(FileSystemReader, "read_data", fail)


def _fail_after(monkeypatch, module, name):
    real = getattr(module, name)

    def written_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(module, name, written_then_fail)


@pytest.mark.parametrize("where", ["dcp's read", "optimizer", "scheduler", "verify=False"])
def test_a_failure_after_the_checks_rolls_every_live_object_back(saved, monkeypatch, where):
    """Such a failure escaped raw (a RuntimeError from set_state_dict) or said 'the model,
    optimizer and pending gradients may be partly restored', and they were."""
    _, path = saved
    model, opt, sched = _fresh()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    model(torch.randn(2, 4)).sum().backward()  # pending
    before = _snapshot(model, opt, sched)
    calls = []
    real = dcp_reader._read_in_place
    monkeypatch.setattr(dcp_reader, "_read_in_place", lambda *a: calls.append(1) or real(*a))
    if where in ("dcp's read", "verify=False"):
        _fail_dcp_read(monkeypatch)
    elif where == "optimizer":
        _fail_after(monkeypatch, dcp_mod, "load_optimizer")
    else:
        _fail_after(monkeypatch, trt.TorchLrScheduler, "load_record")
    with pytest.raises(RecorderError, match="rolled back"):
        trt.DCPRecorder().load(path, model, opt, sched, verify=where != "verify=False")
    assert calls  # the live tensors were written into before the failure
    assert _unchanged(before, model, opt, sched)
    monkeypatch.undo()
    trt.DCPRecorder().load(path, model, opt, sched)  # and the same load goes through now


def test_verify_counts_the_dcp_entries_it_checked(saved, capsys):
    """`trainrec verify` said '0 tensors (0 bytes)' of a DCP directory, checking every entry."""
    from trainrec.cli.commands import main

    _, path = saved
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    checked = trainrec.read_file(path)[1]["checked"]
    assert checked["entries"] > 20
    assert f"{checked['entries']} DCP entries ({checked['bytes']} bytes)" in out, out
    assert main(["verify", str(path), "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["entries"] == checked["entries"] and doc["entry_bytes"] == checked["bytes"]
