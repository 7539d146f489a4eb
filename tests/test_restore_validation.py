"""Restore refuses optimizer state the live optimizer cannot use, and a restore that is
interrupted (any `BaseException`) while writing leaves every live object as it was.

Each bad record below restored without a word before, and then crashed (or silently
trained wrong) at the next `optimizer.step()`."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import trainrec
from trainrec import (
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    StateRecord,
    TensorData,
    TrainingRecord,
)
from trainrec.adapters.numpy import MLP, SGD, AdamW, StepLr


@trainrec.record
class Micro:
    micro: int


def _with_optimizer(rec: TrainingRecord, item) -> TrainingRecord:
    """`rec` with another optimizer item (the same model, scheduler, grads and state)."""
    return TrainingRecord(rec.model, StateRecord(rec.optimizer.kind, item), rec.scheduler, rec.grads,
                          rec.into_item(NativePrecisionSettings())[4], Micro)


def _saved(model, opt, sched, acc) -> bytes:
    """Every value of the live objects, as bytes a restore must leave unchanged."""
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.capture(model, opt, sched, acc, Micro(0)).save(r)


# -- numpy reference ----------------------------------------------------------------------


def _numpy_live(opt_factory=AdamW):
    model, opt, sched, acc = MLP([8, 16, 2], seed=1), opt_factory(), StepLr(0.1, 2), GradientsAccumulator()
    gen = np.random.default_rng(0)
    for i in range(5):
        _, g = model.loss_and_grads(gen.normal(size=(4, 8)).astype(np.float32),
                                    gen.normal(size=(4, 2)).astype(np.float32))
        acc.accumulate(model, g)
        if i % 2:
            opt.step(sched.step(), model, acc.grads())
    return model, opt, sched, acc


def _numpy_cases():
    def state(f):
        def edit(item):
            f(item["state"]["layers.0.weight"])
        return edit

    def hyper(name, value):
        def edit(item):
            item["hyper"][name] = value
        return edit

    return {
        "exp_avg of shape (1,)": (state(lambda s: s.update(exp_avg=TensorData.from_array(np.zeros(1, np.float32)))),
                                  "exp_avg"),
        "exp_avg the int 5": (state(lambda s: s.update(exp_avg=5)), "exp_avg"),
        "exp_avg of ints": (state(lambda s: s.update(exp_avg=TensorData.from_array(np.zeros((16, 8), np.int32)))),
                            "exp_avg"),
        "exp_avg_sq missing": (state(lambda s: s.pop("exp_avg_sq")), "exp_avg_sq"),
        "step a bool": (state(lambda s: s.update(step=True)), "step"),
        "step a string": (state(lambda s: s.update(step="3")), "step"),
        "beta1 a string": (hyper("beta1", "0.9"), "beta1"),
        "weight_decay None": (hyper("weight_decay", None), "weight_decay"),
    }


@pytest.mark.parametrize("case", list(_numpy_cases()))
def test_numpy_restore_refuses_optimizer_state_it_cannot_use_unchanged(case):
    edit, name = _numpy_cases()[case]
    rec = TrainingRecord.capture(*_numpy_live(), Micro(5))
    item = copy.deepcopy(rec.optimizer.item)
    edit(item)
    bad = _with_optimizer(rec, item)
    model, opt, sched, acc = _numpy_live()  # live objects with state of their own
    before = _saved(model, opt, sched, acc)
    with pytest.raises(RecordMismatchError, match=name) as e:
        bad.restore(model, opt, sched, "cpu")
    assert "layers.0.weight" in str(e.value) or "hyper" in str(e.value)
    assert _saved(model, opt, sched, acc) == before


def test_numpy_sgd_state_keys_follow_momentum():
    rec = TrainingRecord.capture(*_numpy_live(lambda: SGD(momentum=0.9)), Micro(5))
    model, opt, sched, _ = _numpy_live(lambda: SGD(momentum=0.9))
    rec.restore(model, opt, sched, "cpu")  # a good record restores
    item = copy.deepcopy(rec.optimizer.item)
    item["state"]["layers.1.bias"] = {}  # no state yet (before the first step): fine
    _with_optimizer(rec, item).restore(model, opt, sched, "cpu")
    item["state"]["layers.1.bias"] = {"exp_avg": rec.optimizer.item["state"]["layers.1.bias"]["momentum_buffer"]}
    with pytest.raises(RecordMismatchError, match="layers.1.bias"):
        _with_optimizer(rec, item).restore(model, opt, sched, "cpu")


# -- an interruption while writing --------------------------------------------------------


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_restore_rolls_back_and_reraises(monkeypatch, interrupt):
    rec = TrainingRecord.capture(*_numpy_live(), Micro(5))
    model, opt, sched, acc = MLP([8, 16, 2], seed=7), AdamW(), StepLr(0.1, 2), GradientsAccumulator()
    sched.step()
    before = _saved(model, opt, sched, acc)
    real = sched.load_record
    calls = {"n": 0}

    def interrupted(*args, **kw):  # the last write: model and optimizer are written by now
        calls["n"] += 1
        if calls["n"] == 1:
            real(*args, **kw)
            raise interrupt()
        return real(*args, **kw)

    monkeypatch.setattr(sched, "load_record", interrupted)
    with pytest.raises(interrupt):
        rec.restore(model, opt, sched, "cpu")
    assert calls["n"] == 2  # the scheduler was rolled back too
    assert _saved(model, opt, sched, acc) == before


def test_an_interrupt_whose_rollback_fails_says_so(monkeypatch):
    rec = TrainingRecord.capture(*_numpy_live(), Micro(5))
    model, opt, sched = MLP([8, 16, 2], seed=7), AdamW(), StepLr(0.1, 2)

    real = model.load_record
    calls = {"n": 0}

    def model_load(*args, **kw):  # the restore's write works, the rollback's fails
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("device lost")
        real(*args, **kw)

    real_opt = opt.load_record

    def interrupted(*args, **kw):  # Ctrl-C in the restore's write, not in the rollback's
        if not hasattr(interrupted, "done"):
            interrupted.done = True
            raise KeyboardInterrupt
        real_opt(*args, **kw)

    monkeypatch.setattr(model, "load_record", model_load)
    monkeypatch.setattr(opt, "load_record", interrupted)
    with pytest.raises(KeyboardInterrupt) as e:
        rec.restore(model, opt, sched, "cpu")
    assert calls["n"] == 2
    assert any("partly restored" in n for n in getattr(e.value, "__notes__", []))


# -- torch --------------------------------------------------------------------------------


def _torch_live(seed=0, pending=True):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    acc = GradientsAccumulator()
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    if pending:  # a gradient in .grad and one in the caller's accumulator
        model(torch.randn(4, 8, generator=g)).square().sum().backward()
        import trainrec.adapters.torch as trt

        acc.accumulate(model, trt.grads_from(model))
    return model, opt, sched, acc


def _torch_cases():
    def state(f):
        def edit(item):
            f(item["state"]["0.weight"])
        return edit

    def group(name, value):
        def edit(item):
            item["param_groups"][0][name] = value
        return edit

    return {
        "exp_avg of shape (1,)": (state(lambda s: s.update(exp_avg=TensorData.from_array(np.zeros(1, np.float32)))),
                                  "exp_avg"),
        "exp_avg the int 5": (state(lambda s: s.update(exp_avg=5)), "exp_avg"),
        "exp_avg of ints": (state(lambda s: s.update(exp_avg=TensorData.from_array(np.zeros((16, 8), np.int64)))),
                            "exp_avg"),
        "exp_avg_sq missing": (state(lambda s: s.pop("exp_avg_sq")), "exp_avg_sq"),
        "an extra key": (state(lambda s: s.update(momentum_buffer=s["exp_avg"])), "momentum_buffer"),
        "step of shape (2,)": (state(lambda s: s.update(step=TensorData.from_array(np.zeros(2, np.float32)))),
                               "step"),
        "step a string": (state(lambda s: s.update(step="3")), "step"),
        "lr the string '0.01'": (group("lr", "0.01"), "lr"),
        "maximize the number 1": (group("maximize", 1), "maximize"),
        "betas of three": (group("betas", [0.9, 0.999, 0.5]), "betas"),
        "eps None": (group("eps", None), "eps"),
        "amsgrad without max_exp_avg_sq": (group("amsgrad", True), "max_exp_avg_sq"),
    }


def _torch_snapshot(model, opt, sched, acc):
    torch = pytest.importorskip("torch")
    sd = opt.state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
         for i, s in sd["state"].items()},
        copy.deepcopy(sd["param_groups"]),
        copy.deepcopy(sched.state_dict()),
        {k: t.array.copy() for k, t in acc.try_to_record().grads.items()},
    )


def _assert_torch_same(a, b):
    torch = pytest.importorskip("torch")

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, np.ndarray):
            return x.dtype == y.dtype and np.array_equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    for i, (x, y) in enumerate(zip(a, b)):
        assert same(x, y), ["model", "grads", "optimizer state", "param groups", "scheduler", "accumulator"][i]


@pytest.mark.parametrize("case", list(_torch_cases()))
def test_torch_restore_refuses_optimizer_state_it_cannot_use_unchanged(case):
    torch = pytest.importorskip("torch")
    edit, name = _torch_cases()[case]
    rec = TrainingRecord.capture(*_torch_live(0), Micro(3))
    item = copy.deepcopy(rec.optimizer.item)
    edit(item)
    bad = _with_optimizer(rec, item)
    model, opt, sched, acc = _torch_live(1)
    before = _torch_snapshot(model, opt, sched, acc)
    with pytest.raises(RecordMismatchError, match=name) as e:
        bad.restore(model, opt, sched, "cpu")
    assert "0.weight" in str(e.value) or "param_groups.0" in str(e.value)
    _assert_torch_same(before, _torch_snapshot(model, opt, sched, acc))
    # the same objects take the good record, and train on
    rec.restore(model, opt, sched, "cpu")
    model(torch.zeros(1, 8)).sum().backward()
    opt.step()


def test_torch_restore_into_a_fresh_optimizer_checks_state_too():
    torch = pytest.importorskip("torch")
    rec = TrainingRecord.capture(*_torch_live(0), Micro(3))
    item = copy.deepcopy(rec.optimizer.item)
    item["state"]["2.bias"]["exp_avg"] = TensorData.from_array(np.zeros((1,), np.float32))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # no state yet: nothing live to compare with
    with pytest.raises(RecordMismatchError, match=r"2\.bias.*|exp_avg"):
        _with_optimizer(rec, item).restore(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), "cpu")
    assert opt.state_dict()["state"] == {}


def test_torch_state_of_an_unknown_optimizer_is_checked_against_its_live_state():
    torch = pytest.importorskip("torch")

    class MyAdam(torch.optim.Adam):  # a subclass: its state keys are its own
        pass

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 16)
    opt = MyAdam(model.parameters(), lr=0.01)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    rec = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), Micro(1))
    rec.restore(model, opt, None, "cpu")
    item = copy.deepcopy(rec.optimizer.item)
    item["state"]["weight"]["exp_avg"] = 5
    with pytest.raises(RecordMismatchError, match="exp_avg"):
        _with_optimizer(rec, item).restore(model, opt, None, "cpu")


def test_torch_interrupted_restore_rolls_back_and_reraises(monkeypatch):
    rec = TrainingRecord.capture(*_torch_live(0), Micro(3))
    model, opt, sched, acc = _torch_live(1)
    before = _torch_snapshot(model, opt, sched, acc)
    real = type(sched).load_state_dict
    calls = {"n": 0}

    def interrupted(self, sd):  # Ctrl-C after the model and the optimizer were written
        calls["n"] += 1
        real(self, sd)
        if calls["n"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(type(sched), "load_state_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rec.restore(model, opt, sched, "cpu")
    assert calls["n"] == 2
    _assert_torch_same(before, _torch_snapshot(model, opt, sched, acc))


# -- JAX / optax --------------------------------------------------------------------------


def _jax_live(seed):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import trainrec.adapters.jax as trj

    params = {"w": jax.random.normal(jax.random.PRNGKey(seed), (16, 8)), "b": jax.numpy.zeros(16)}
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    model, opt = trj.JaxModule(params), trj.JaxOptimizer(tx, tx.init(params))
    for _ in range(2):
        g = jax.grad(lambda p: jax.numpy.sum(jax.numpy.tanh(p["w"] @ jax.numpy.ones(8) + p["b"]) ** 2))(model.params)
        updates, opt.opt_state = tx.update(g, opt.opt_state, model.params)
        model.params = optax.apply_updates(model.params, updates)
    return model, opt


def _jax_cases():
    def leaf(suffix, value):
        def edit(item):
            (k,) = [k for k in item if k.endswith(suffix)]
            item[k] = value
        return edit

    return {
        "mu of shape (1,)": (leaf("mu.w", TensorData.from_array(np.zeros(1, np.float32))), "mu.w"),
        "mu the int 5": (leaf("mu.w", 5), "mu.w"),
        "learning_rate the string '0.01'": (leaf("learning_rate", "0.01"), "learning_rate"),
    }


@pytest.mark.parametrize("case", list(_jax_cases()))
def test_jax_restore_refuses_optimizer_state_it_cannot_use_unchanged(case):
    edit, name = _jax_cases()[case]
    rec = TrainingRecord.capture(*_jax_live(0), None, GradientsAccumulator(), Micro(2))
    item = dict(rec.optimizer.item)
    edit(item)
    model, opt = _jax_live(1)
    before = _saved(model, opt, None, GradientsAccumulator())
    with pytest.raises(RecordMismatchError, match=name):
        _with_optimizer(rec, item).restore(model, opt, None, "cpu")
    assert _saved(model, opt, None, GradientsAccumulator()) == before


def test_jax_scalar_leaves_keep_their_kind():
    pytest.importorskip("jax")
    import trainrec.adapters.jax as trj

    model = trj.JaxModule({"w": np.ones(3, np.float32)})
    opt = trj.JaxOptimizer(None, {"count": 3, "nesterov": False})  # plain Python leaves
    rec = opt.into_record(model)
    opt.check_record(rec, model)
    for bad in ({"count": "3", "nesterov": False}, {"count": 3, "nesterov": 1.0}):
        with pytest.raises(RecordMismatchError, match="count|nesterov"):
            opt.check_record(StateRecord(rec.kind, bad), model)


TORCH_OPTIMIZERS = {
    "sgd": lambda p, t: t.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p, t: t.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam-amsgrad": lambda p, t: t.optim.Adam(p, amsgrad=True),
    "adamw": lambda p, t: t.optim.AdamW(p),
    "adamax": lambda p, t: t.optim.Adamax(p),
    "nadam": lambda p, t: t.optim.NAdam(p),
    "radam": lambda p, t: t.optim.RAdam(p),
    "adagrad": lambda p, t: t.optim.Adagrad(p),
    "adadelta": lambda p, t: t.optim.Adadelta(p),
    "rmsprop-centered": lambda p, t: t.optim.RMSprop(p, momentum=0.5, centered=True),
    "rprop": lambda p, t: t.optim.Rprop(p),
    "asgd": lambda p, t: t.optim.ASGD(p),
}


@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_torch_state_torch_really_keeps_is_accepted_by_a_fresh_optimizer(name):
    torch = pytest.importorskip("torch")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 16)
        return model, TORCH_OPTIMIZERS[name](model.parameters(), torch)

    model, opt = build()
    for _ in range(2):
        model(torch.ones(2, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    rec = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), Micro(2))
    model2, opt2 = build()
    rec.restore(model2, opt2, None, "cpu")
    for m, o in ((model, opt), (model2, opt2)):
        m(torch.ones(2, 8)).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
